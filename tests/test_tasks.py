"""The task registry (``mta.task_registry``): every ``task:`` a recipe may name is registered,
and the LLM path loads nothing of the embedding wing."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.task_registry import Task, task_named, task_names, task_of
from mta.training.config.loading import load_recipe
from mta.training.config.schema import Recipe

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "mta"


def test_every_task_a_recipe_may_name_is_registered():
    assert task_names() == typing.get_args(Recipe.model_fields["task"].annotation)
    for name in task_names():
        task = task_named(name)
        assert isinstance(task, Task) and task.name == name
        assert task_named(name) is task  # a real object, loaded once
        assert name in typing.get_args(task.schema.model_fields["task"].annotation)


def test_a_recipe_is_read_and_run_by_its_task():
    llm, embedding = (load_recipe(REPO / "recipes" / name) for name in ("tiny.yaml", "tiny-embed.yaml"))
    assert type(llm) is task_of(llm).schema is Recipe
    assert type(embedding) is task_of(embedding).schema and task_of(embedding).name == "embedding"
    assert task_of(embedding).group_factor == 1 and not task_of(embedding).samples_dev_prompts


def test_an_unknown_task_is_refused_by_name():
    with pytest.raises(MtaError, match="'llm', 'embedding'"):
        task_named("vision")


def test_the_llm_path_imports_nothing_of_the_embedding_wing():
    modules = sorted(
        "mta." + ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for path in (SRC / "training").rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "from mta.training.config.loading import load_recipe\n"
        f"load_recipe({str(REPO / 'recipes' / 'tiny.yaml')!r})\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    leaked = [name for name in result.stdout.split() if name.startswith("mta.embedding")]
    assert not leaked, f"the LLM path loads {leaked}"
