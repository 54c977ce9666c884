"""The teacher once: ``mta teacher`` stores what a recipe's losses read from the teacher, and
``mta distill`` with ``teacher_cache.dir`` trains from it (docs/teacher-cache.md). ``content``:
what a recipe's cache holds and its content key; ``build``: the stage; ``read``: a finished cache
checked against the recipe and each gold micro batch's ``TeacherOutput`` rebuilt. The layout:
ARCHITECTURE.md, "2b. teacher" (one row per Parquet row group, so a micro batch reads only its own).
"""
