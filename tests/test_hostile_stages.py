"""The stages added since 0.2 under hostile input (issue 51): nothing stale, nothing destroyed,
nothing written outside the directories given, one line where a traceback was.

Each test reproduces one of the issue's cases (it failed on the code before the fix) and names
it; the rules live once each: ``mta.store.kinds`` (no cross-kind overwrite), the model
fingerprint of ``mta.models.fingerprint`` (content keys, push, evaluate), ``mta.files``
(``open_inside``: no link followed out; ``read_artefact_json`` / ``corrupt_artefact``: one line per
corrupt artefact), ``mta.generation.vllm_engine.checked_reply`` (the worker's replies).
"""

from __future__ import annotations

import json
import shutil

import pytest

from mta.errors import MtaError
from mta.store.layout import manifest_path
from mta.training.config.loading import load_recipe
from mta.training.teacher_cache.build import run_teacher_stage

pytestmark = pytest.mark.usefixtures("one_thread")


def tree(directory) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes."""
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


# --------------------------------------------------------------------------- 1. no cross-kind overwrite


def test_case1_teacher_into_an_annotations_directory_is_refused_even_with_force(tmp_path, tiny_run_recipe, same_data):
    annotations = tmp_path / "data" / "train"
    shutil.copytree(same_data, annotations)
    before = tree(annotations)
    recipe = load_recipe(tiny_run_recipe(tmp_path / "out", data={"dev": None}))
    for force in (False, True):
        with pytest.raises(MtaError, match=r"holds another stage's output \(annotations.*`mta teacher` writes"):
            run_teacher_stage(recipe, out_dir=tmp_path / "data", force=force)
        assert tree(annotations) == before
