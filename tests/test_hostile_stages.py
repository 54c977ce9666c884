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


# --------------------------------------------------------------------------- 2. the teacher cache's content key


def cache_model(cache, repo_id: str, commit: str, source) -> None:
    """``source``'s files as Hub model ``repo_id`` at ``commit`` in the Hub cache ``cache``, the
    default branch moved to it (huggingface_hub's layout: snapshot files linking to blobs)."""
    import hashlib

    root = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            blob = root / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copyfile(path, blob)
            (snapshot / path.name).symlink_to(f"../../blobs/{blob.name}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def test_case2_the_teacher_content_key_covers_every_model_file_and_the_hub_commit(tmp_path, teacher_dir, monkeypatch):
    from huggingface_hub import constants

    from mta.training.teacher_cache.content import teacher_weights

    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir, teacher)
    seen = {teacher_weights(str(teacher))}
    count = 1
    for name, change in (
        ("model.safetensors", lambda b: b[:-4] + bytes(4)),  # the weights
        ("config.json", lambda b: b.replace(b"{", b'{"torch_dtype": "float32", ', 1)),  # the config
        ("tokenizer.json", lambda b: b + b" "),  # the tokenizer
        ("generation_config.json", lambda b: b.replace(b"{", b'{"top_k": 3, ', 1)),  # sampling defaults
    ):
        path = teacher / name
        path.write_bytes(change(path.read_bytes()))
        seen.add(teacher_weights(str(teacher)))
        assert len(seen) == count + 1, f"{name} changed and the key did not"
        count += 1
    (teacher / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (teacher / "adapter_model.safetensors").write_bytes((teacher / "model.safetensors").read_bytes())
    seen.add(teacher_weights(str(teacher)))  # an adapter transformers applies on load
    assert len(seen) == 6, seen
    # A Hub name: the commit its snapshot resolves to, so a moved snapshot is another teacher.
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_model(cache, "acme/teacher", "a" * 40, teacher_dir)
    first = teacher_weights("acme/teacher")
    cache_model(cache, "acme/teacher", "b" * 40, teacher)
    assert first == f"hub:acme/teacher@{'a' * 40}" and teacher_weights("acme/teacher") == f"hub:acme/teacher@{'b' * 40}"


# --------------------------------------------------------------------------- 3. push matches scores by fingerprint


@pytest.fixture
def export(tmp_path, tiny_model_dir):
    from mta.hashing import CHECKSUMS, checksum_text, directory_checksums

    directory = tmp_path / "final"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "README.md").write_text("---\nlicense: apache-2.0\n---\n# s\n")
    (directory / CHECKSUMS).write_text(checksum_text(directory_checksums(directory)))
    return directory


def scores_of(checkpoint, fingerprint) -> dict:
    return {
        "settings": {"seeds": [1]},
        "sets": {"dolly": {"title": "Dolly"}},
        "checkpoints": {"s": {"checkpoint": str(checkpoint), "fingerprint": fingerprint, "sets": {"dolly": {"rougeL": {"mean": 9.0}}}}},
    }


def test_case3_push_results_of_the_same_path_but_another_model_are_refused_naming_both(export, tmp_path):
    from mta.evaluation.model_files import checkpoint_fingerprint
    from mta.models.push import plan_push

    results = tmp_path / "eval"
    results.mkdir()
    old = "sha256:" + "0" * 64  # what final/ was when it was evaluated, before it was retrained
    (results / "results.json").write_text(json.dumps(scores_of(export, old)))
    now = checkpoint_fingerprint(str(export))[0]
    with pytest.raises(MtaError, match=rf"when its fingerprint was {old}; it is {now} now"):
        plan_push(export, "me/student", results=results)
    # Scored under another path (evaluated from a copy): the fingerprint finds it.
    (results / "results.json").write_text(json.dumps(scores_of(tmp_path / "copy", now)))
    assert "9.0" in plan_push(export, "me/student", results=results).card_text


# --------------------------------------------------------------------------- 4. a model replaced while evaluated


def test_case4_a_model_replaced_while_evaluate_loads_it_generates_nothing(tmp_path, tiny_model_dir, data_dir, monkeypatch):
    from contextlib import contextmanager

    from mta.evaluation import EvalSettings, evaluate_checkpoints
    from mta.evaluation import runner as runner_module

    model = tmp_path / "best"
    shutil.copytree(tiny_model_dir, model)
    loaded = runner_module.loaded_checkpoint

    @contextmanager
    def replaced_while_loading(checkpoint, device, dtype):
        with loaded(checkpoint, device, dtype) as held:
            config = model / "config.json"  # a training run publishes a new best/ meanwhile
            config.write_text(config.read_text().replace("{", '{"torch_dtype": "float32", ', 1))
            yield held

    monkeypatch.setattr(runner_module, "loaded_checkpoint", replaced_while_loading)
    settings = EvalSettings(benchmarks=["dolly"], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=2)
    out = tmp_path / "eval"
    with pytest.raises(MtaError, match=r"changed while it was being loaded .*Nothing was generated"):
        evaluate_checkpoints([model], ["m"], data_dir, out, settings)
    assert not list(out.rglob("*.jsonl")) and not (out / "results.json").exists()
