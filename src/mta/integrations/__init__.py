"""MTA inside other training stacks: ``mta.integrations.trl`` (``pip install 'mta-distill[trl]'``).

Nothing in mta imports this package; it imports mta's public API and what that API wraps.
"""
