"""DistiLLM-2 pairs: `mta generate` (``mta.pairs.generate``), the teacher's and the student's response per prompt."""
