"""The embedded default: the whole pipeline on a real instruction model, on a CPU.

``mta demo`` converts SmolLM2-135M-Instruct (teacher), prunes it to a 10-layer student,
annotates Dolly rows, distills three students from the same start (SFT, skew reverse KL,
skew reverse KL + MTA), evaluates all five models and writes ``results.md`` and
``summary.png``. It only chains the library's stages; it adds no training logic of its own.
"""
