"""DistiLLM-2 pairs: ``mta generate`` (``mta.pairs.generate``), the teacher's and the student's
response per prompt."""

from mta.deprecation import renamed_names

# mta.pairs was the module mta.pairs.generate until 0.3.0: its names, with a warning, until mta.deprecation.REMOVED_IN.
__getattr__ = renamed_names(
    globals(),
    {name: f"mta.pairs.generate:{name}" for name in ("PairSettings", "PairsPaths", "generate_pairs")},
)
