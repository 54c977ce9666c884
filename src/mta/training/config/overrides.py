"""``key=value`` overrides from the command line, applied to a recipe's mapping before it is
validated (so they are checked exactly like the file: ``mta.training.config.loading``)."""

from __future__ import annotations

from typing import Any

from mta.errors import MtaError
from mta.training.config.yaml_reader import load_yaml


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested mapping, in order; values are YAML scalars.

    Missing mappings on the way are created (``deepspeed.zero_optimization.offload_param.device=
    cpu``), a numeric part indexes a list (``loss.layers.0.teacher=20``) and the recipe's
    validation then checks the result exactly like a value written in the file.
    """
    for override in overrides:
        key, sep, text = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise MtaError(f"override {override!r} is not of the form key.path=value (e.g. train.lr=5e-5)")
        value = load_yaml(text, f"override {override!r}")
        node: Any = raw
        for depth, part in enumerate(parts):
            here = ".".join(parts[: depth + 1])
            last = depth == len(parts) - 1
            step: str | int = part  # a mapping's key, or a list's index
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise MtaError(
                        f"override {override!r}: {here} indexes a list of {len(node)} items; "
                        f"use an index from 0 to {len(node) - 1}"
                    )
                step = int(part)
            elif not isinstance(node, dict):
                raise MtaError(f"override {override!r}: {'.'.join(parts[:depth])} is a value, not a mapping")
            if last:
                node[step] = value
            else:
                if isinstance(node, dict) and node.get(step) is None:
                    node[step] = {}
                node = node[step]
    return raw
