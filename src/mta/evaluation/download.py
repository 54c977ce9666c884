"""Fetch the evaluation sets from the Hugging Face Hub into the MiniLLM directory layout.

The MiniLLM authors publish each set as a dataset repository of JSONL files
(``MiniLLM/dolly`` ...); a snapshot of it is exactly ``DIR/<set>/``. Needs network access;
offline, copy the files into place by hand (``DIR/<set>/valid.jsonl``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mta.errors import MtaError
from mta.evaluation.datasets import BENCHMARKS, candidate_paths, find_set_file

HUB_REPOSITORIES = {
    "dolly": "MiniLLM/dolly",
    "self-inst": "MiniLLM/self-inst",
    "vicuna": "MiniLLM/Vicuna",
    "sinst": "MiniLLM/sinst",
    "uinst": "MiniLLM/uinst",
}


def download_sets(data_dir: str | Path, names: Sequence[str], *, force: bool = False) -> dict[str, Path]:
    """Download each named set unless its file is already there; returns set -> test file."""
    from huggingface_hub import snapshot_download  # a transformers dependency, imported when used

    data_dir = Path(data_dir)
    unknown = [n for n in names if n not in HUB_REPOSITORIES]
    if unknown:
        raise MtaError(f"unknown set(s) {', '.join(unknown)}; choose from {', '.join(HUB_REPOSITORIES)}")
    files: dict[str, Path] = {}
    for name in names:
        benchmark = BENCHMARKS[name]
        existing = find_set_file(data_dir, benchmark)
        if existing is not None and not force:
            files[name] = existing
            continue
        repository = HUB_REPOSITORIES[name]
        try:
            snapshot_download(repository, repo_type="dataset", local_dir=data_dir / name)
        except Exception as error:  # offline, hub down, gated: all leave the user the same fix
            raise MtaError(
                f"cannot download {repository} from the Hugging Face Hub ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else 'no detail'}). Run this on a machine "
                f"with network access, or copy the set's file to {candidate_paths(data_dir, benchmark)[-1]}."
            ) from error
        found = find_set_file(data_dir, benchmark)
        if found is None:
            raise MtaError(
                f"{repository} was downloaded to {data_dir / name} but holds no "
                f"{' or '.join(str(p) for p in candidate_paths(data_dir, benchmark))}; "
                "the repository layout may have changed: move its test file there."
            )
        files[name] = found
    return files
