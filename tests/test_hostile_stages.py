"""The stages added since 0.2 under hostile input (issue 51): nothing stale, nothing destroyed,
nothing written outside the directories given, one line where a traceback was.

Each test reproduces one of the issue's cases (it failed on the code before the fix) and names
it; the rules live once each: ``mta.store.kinds`` (no cross-kind overwrite), the model
fingerprint of ``mta.models.weights`` (content keys, push, evaluate), ``mta.files``
(``open_inside``: no link followed out; ``read_artefact_json`` / ``corrupt_artefact``: one line per
corrupt artefact), ``mta.generation.vllm_engine.checked_reply`` (the worker's replies).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES
from fixtures.hub import cache_model
from mta.errors import MtaError
from mta.store.layout import manifest_path
from mta.training.config.loading import load_recipe
from mta.training.teacher_cache.teacher import run_teacher_stage

pytestmark = pytest.mark.usefixtures("one_thread")

REPO, COMMIT = "acme/qa", "4c1b2d8e9f0a1b2c3d4e5f60718293a4b5c6d7e8"
LINES = EXAMPLES.read_text(encoding="utf-8").splitlines()


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
        "checkpoints": {
            "s": {
                "checkpoint": str(checkpoint),
                "fingerprint": fingerprint,
                "sets": {"dolly": {"rougeL": {"mean": 9.0}}},
            }
        },
    }


def test_case3_push_results_of_the_same_path_but_another_model_are_refused_naming_both(export, tmp_path):
    from mta.models.push import plan_push
    from mta.models.weights import checkpoint_fingerprint

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


def test_case4_a_model_replaced_while_evaluate_loads_it_generates_nothing(
    tmp_path, tiny_model_dir, data_dir, monkeypatch
):
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


# --------------------------------------------------------------------------- 5 and 10. the vLLM worker's replies

FAKE_WORKER = Path(__file__).parent / "fixtures" / "fake_vllm_worker.py"


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """MTA_VLLM_PYTHON set to a launcher that says it holds vLLM and runs the fake worker in place
    of vllm_worker.py; ``fake_vllm(reply)`` sets what it answers each request with."""
    python = tmp_path / "vllm-python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then echo "vllm-fake 0.0"; exit 0; fi\n'
        f'exec "{sys.executable}" "{FAKE_WORKER}"\n'
    )
    python.chmod(0o755)
    monkeypatch.setenv("MTA_VLLM_PYTHON", str(python))

    def reply(line: str | None) -> None:
        if line is None:
            monkeypatch.delenv("FAKE_VLLM_REPLY", raising=False)
        else:
            monkeypatch.setenv("FAKE_VLLM_REPLY", line)

    return reply


def test_case5_out_of_vocabulary_ids_stop_evaluate_before_anything_is_journalled(
    tmp_path, tiny_model_dir, data_dir, fake_vllm
):
    from mta.evaluation import EvalSettings, evaluate_checkpoints

    settings = EvalSettings(
        benchmarks=["dolly"], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=2, engine="vllm", dtype="fp32"
    )
    fake_vllm(json.dumps({"outputs": [{"token_ids": [5, 10**6], "finish_reason": "length"}] * 2}))
    out = tmp_path / "eval"
    with pytest.raises(
        MtaError,
        match=r"vLLM worker \(.*vllm-python .*pid \d+\) broke the protocol: output 0 holds token id 1000000, "
        r"outside the vocabulary \(0 \.\. 511\)",
    ):
        evaluate_checkpoints([tiny_model_dir], ["m"], data_dir, out, settings)
    assert not [line for path in out.rglob("*.jsonl") for line in path.read_text().splitlines()]
    fake_vllm(None)  # a worker that keeps the protocol: the same run goes through
    results = evaluate_checkpoints([tiny_model_dir], ["m"], data_dir, out, settings)
    assert results["checkpoints"]["m"]["sets"]["dolly"]["rows"] == 2


BROKEN_REPLIES = {
    "truncated JSON": ('{"outputs": [{"token_ids": [1, 2', r"answered a line that is not JSON"),
    "too few outputs": (
        json.dumps({"outputs": [{"token_ids": [1], "finish_reason": "stop"}]}),
        r"1 outputs for 2 prompts",
    ),
    "a list for an object": (json.dumps({"outputs": [[1, 2], [3]]}), r"output 0 is a JSON list, not an object"),
    "a missing key": (json.dumps({"outputs": [{"token_ids": [1]}] * 2}), r"output 0's finish_reason is None"),
    "a negative id": (
        json.dumps({"outputs": [{"token_ids": [1, -3], "finish_reason": "stop"}] * 2}),
        r"token id -3, outside the vocabulary",
    ),
    "a reply that is a list": ("[1, 2]", r"answered a JSON list, not an object"),
    "ids that are not integers": (
        json.dumps({"outputs": [{"token_ids": [1.5], "finish_reason": "stop"}] * 2}),
        r"token_ids is \[1.5\], not a list of integers",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_REPLIES))
def test_case10_each_broken_worker_reply_is_one_line(case, fake_vllm):
    import torch

    from mta.generation.vllm_engine import VLLMEngine

    line, message = BROKEN_REPLIES[case]
    fake_vllm(line)
    with VLLMEngine("m", dtype=torch.float32, device=torch.device("cpu"), vocab_size=512) as engine:
        with pytest.raises(MtaError, match=message) as raised:
            engine.complete([[1, 2], [3]], [0, 1], {})
    assert "\n" not in str(raised.value) and "vllm-python" in str(raised.value)


def test_case10_a_worker_that_hangs_after_ready_is_timed_out_and_ended(fake_vllm, monkeypatch):
    import torch

    from mta.generation.vllm_engine import VLLMEngine

    fake_vllm("HANG")
    monkeypatch.setenv("MTA_VLLM_REPLY_TIMEOUT_S", "1")
    with VLLMEngine("m", dtype=torch.float32, device=torch.device("cpu"), vocab_size=512) as engine:
        process = engine.process
        with pytest.raises(MtaError, match=r"did not answer within 1 s \(MTA_VLLM_REPLY_TIMEOUT_S\) while generating"):
            engine.complete([[1]], [0], {})
    assert process.poll() is not None


def hold_a_hung_worker() -> None:
    """In a forked process (mta): start the engine on the fake worker and wait on a request it
    never answers, as ``mta evaluate`` waits on a generation."""
    import torch

    from mta.generation.vllm_engine import VLLMEngine

    with VLLMEngine("m", dtype=torch.float32, device=torch.device("cpu")) as engine:
        engine.complete([[1]], [0], {})


def test_case10_sigterm_to_mta_ends_the_worker(fake_vllm, tmp_path, monkeypatch):
    import multiprocessing
    import signal
    import time

    fake_vllm("HANG")
    pid_file = tmp_path / "worker.pid"
    monkeypatch.setenv("FAKE_VLLM_PID_FILE", str(pid_file))
    mta = multiprocessing.get_context("fork").Process(target=hold_a_hung_worker)
    mta.start()
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    worker = int(pid_file.read_text())
    time.sleep(0.2)  # mta is waiting on the request
    mta.terminate()  # SIGTERM, whose default action ends mta without running any cleanup
    mta.join(timeout=30)
    assert mta.exitcode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and worker_alive(worker):
        time.sleep(0.05)
    assert not worker_alive(worker), "the vLLM worker outlived mta"


def worker_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by init, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- 6. the TRL plug-in's projectors


def projector_loss(layers, student_hidden=16, teacher_hidden=24):
    from mta.api import MTALoss

    return MTALoss(
        layers,
        student_hidden_size=student_hidden,
        teacher_hidden_size=teacher_hidden,
        vocab_size=32,
        same_tokenizer=True,
        base=None,
    )


def test_case6_trl_projectors_resume_only_onto_their_layer_map_and_sizes(tmp_path):
    import torch

    from mta.integrations.trl import read_projectors, write_projectors

    pytest.importorskip("trl")
    trained = projector_loss([(1, 2, "word"), (2, 4, "phrase")])
    path = tmp_path / "mta_projectors.safetensors"
    write_projectors(path, trained)
    same = projector_loss([(1, 2, "word"), (2, 4, "phrase")])
    read_projectors(path, same)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(same.state_dict()[name], tensor)
    for other in (
        projector_loss([(1, 3, "word"), (2, 4, "phrase")]),  # the same number of pairs, another map
        projector_loss([(1, 2, "word"), (2, 4, "phrase")], teacher_hidden=32),  # another teacher width
    ):
        before = {name: tensor.clone() for name, tensor in other.state_dict().items()}
        with pytest.raises(MtaError, match=r"was made for .*the saved projectors would load onto other layers"):
            read_projectors(path, other)
        assert all(torch.equal(before[name], tensor) for name, tensor in other.state_dict().items())


# ----------------------------------------------------------------- 7. no link followed out of a given directory


def test_case7_a_planted_link_at_a_lock_is_refused_and_its_target_untouched(tmp_path):
    import os

    from mta.store.locks import shard_lock
    from mta.training.lifecycle import run_directory

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / run_directory.RUN_LOCK).symlink_to(victim)
    with pytest.raises(MtaError, match=r"\.run\.lock is a symbolic link .*never writes through a link"):
        run_directory.claim(out, "test", resume=None, overwrite=False)
    run_directory.release(out)
    assert victim.read_text() == "precious\n"
    # A store directory whose .mta/ leads elsewhere: no lock (nor anything) is made there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = tmp_path / "store"
    store.mkdir()
    (store / ".mta").symlink_to(elsewhere)
    with pytest.raises(MtaError, match=rf"{store / '.mta'} is a symbolic link to .*outside {store}"):
        with shard_lock(store, 0, 1):
            pass
    assert os.listdir(elsewhere) == []
    # A directory where the lock file belongs: one line.
    other = tmp_path / "other"
    (other / run_directory.RUN_LOCK).mkdir(parents=True)
    with pytest.raises(MtaError, match=r"\.run\.lock is a directory where mta keeps a file"):
        run_directory.claim(other, "test", resume=None, overwrite=False)
    run_directory.release(other)


def test_case7_a_journal_never_appends_through_a_link(tmp_path):
    from mta.files import Journal

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "eval" / "predictions" / "m" / "dolly"
    out.mkdir(parents=True)
    (out / "seed-1.rank0.journal.jsonl").symlink_to(victim)
    with pytest.raises(MtaError, match=r"is a symbolic link"):
        Journal(out / "seed-1.rank0.journal.jsonl", inside=tmp_path / "eval")
    (tmp_path / "eval" / "predictions" / "n").symlink_to(tmp_path)  # a directory leading out
    with pytest.raises(MtaError, match=r"predictions/n is a symbolic link to .*outside"):
        Journal(tmp_path / "eval" / "predictions" / "n" / "dolly" / "seed-1.jsonl", inside=tmp_path / "eval")
    assert victim.read_text() == "precious\n" and not (tmp_path / "dolly").exists()


# --------------------------------------------------------------------------- 11. smaller


def test_case11_a_lock_names_the_command_that_holds_it(tmp_path, monkeypatch):
    from mta.store.locks import shard_lock

    monkeypatch.setattr(sys, "argv", ["/venv/bin/mta", "teacher", "--recipe", "r.yaml"])  # annotating on first use
    with shard_lock(tmp_path, 0, 1, command="mta annotate"):
        monkeypatch.setattr(sys, "argv", ["/venv/bin/mta", "distill", "--recipe", "r.yaml"])
        with pytest.raises(MtaError, match=r"^another `mta teacher` \(pid \d+ on "):
            with shard_lock(tmp_path, 0, 1, command="mta annotate"):
                pass


# ----------------------------------------------------------------- 8. a Hub dataset's card pulls in local files


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_case8_a_hub_card_naming_files_outside_its_snapshot_is_refused(
    where, tmp_path, monkeypatch, tiny_tokenizer_dir
):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from huggingface_hub import constants

    from fixtures.hub import cache_dataset, qa_rows
    from mta.data.annotate import AnnotateSettings, run_annotate
    from mta.data.sources import input_reference

    cache = tmp_path / "hub"
    snapshot = cache_dataset(cache, REPO, COMMIT, {"train": qa_rows(LINES[:2])})
    secret = tmp_path / "home" / "secret.parquet"
    secret.parent.mkdir()
    pq.write_table(pa.Table.from_pylist([{"question": "my password is", "answer": "hunter2"}]), secret)
    named = str(secret) if where == "absolute" else "../../../../home/secret.parquet"
    (snapshot / "README.md").write_text(
        f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: {named}\n---\n# qa\n"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    settings = AnnotateSettings(
        teacher=str(tiny_tokenizer_dir),
        student=str(tiny_tokenizer_dir),
        max_length=512,
        max_prompt_length=384,
        workers=1,
        fields={"prompt": "question", "response": "answer"},
    )
    with pytest.raises(
        MtaError, match=r"README\.md: configs\[default\]\.data_files names .*outside the dataset's snapshot"
    ):
        run_annotate(input_reference(REPO), tmp_path / "out", settings)
    assert not manifest_path(tmp_path / "out").exists()


# --------------------------------------------------------------------------- 9. one line per corrupt artefact


def test_case9_corrupt_results_cards_perplexity_and_projectors_are_one_line_naming_the_rebuild(export, tmp_path):
    from mta.evaluation.layout import CheckpointPaths
    from mta.integrations.trl import read_projectors, write_projectors
    from mta.models.push import plan_push

    results = tmp_path / "eval"
    results.mkdir()
    (results / "results.json").write_text('{"checkpoints": {"s": ')
    with pytest.raises(
        MtaError, match=r"results\.json is corrupt \(.*\); re-run the `mta evaluate \.\.\. -o .*eval`"
    ) as raised:
        plan_push(export, "me/student", results=results)
    assert "\n" not in str(raised.value)
    (results / "results.json").write_text('{"checkpoints": ["s"]}')  # valid JSON, not what mta wrote
    with pytest.raises(MtaError, match=r"results\.json is corrupt \(its 'checkpoints' is not an object"):
        plan_push(export, "me/student", results=results)
    (export / "README.md").write_text("---\nlicense: [apache\n---\n# s\n")  # the card's front matter
    from mta.hashing import CHECKSUMS, checksum_text, directory_checksums

    (export / CHECKSUMS).write_text(checksum_text(directory_checksums(export)))
    with pytest.raises(MtaError, match=r"README\.md is corrupt \(.*\); its YAML front matter does not parse"):
        plan_push(export, "me/student")
    paths = CheckpointPaths.of(tmp_path / "out", "m")
    paths.root.mkdir(parents=True)
    paths.perplexity.write_text('{"ppl": 3.')
    with pytest.raises(MtaError, match=r"perplexity\.json is corrupt .*re-run the same `mta evaluate`"):
        paths.stored_perplexity()
    projectors = tmp_path / "mta_projectors.safetensors"
    loss = projector_loss([(1, 2, "word")])
    write_projectors(projectors, loss)
    projectors.write_bytes(projectors.read_bytes()[:6])  # a copy cut short: "invalid header length"
    with pytest.raises(MtaError, match=r"mta_projectors\.safetensors is corrupt .*resume from another checkpoint"):
        read_projectors(projectors, loss)


def test_case9_a_corrupt_teacher_cache_manifest_names_mta_teacher_force_which_rebuilds_it(tmp_path, tiny_run_recipe):
    from mta.training.teacher_cache.read import TeacherCache

    cache = tmp_path / "cache"
    recipe = load_recipe(
        tiny_run_recipe(tmp_path / "out", teacher_cache={"dir": str(cache), "top_k": 8}, data={"dev": None})
    )
    run_teacher_stage(recipe)
    manifest = manifest_path(cache / "train")
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(
        MtaError, match=r"manifest\.json is corrupt \(.*\); rebuild it: `mta teacher --recipe RECIPE -o .* --force`"
    ):
        TeacherCache(cache / "train", {})
    with pytest.raises(MtaError, match=r"manifest\.json is corrupt .*rebuild it with `mta teacher --force`"):
        run_teacher_stage(recipe)
    (outcome,) = run_teacher_stage(recipe, force=True)
    assert not outcome.reused and json.loads(manifest.read_text())["artefact"] == "teacher-outputs"


def test_case11_a_dangling_hub_blob_is_named_as_such_not_blamed_on_the_split(tmp_path, monkeypatch, tiny_tokenizer_dir):
    import datasets
    from huggingface_hub import constants

    from fixtures.hub import cache_dataset, qa_rows
    from mta.data.annotate import AnnotateSettings, run_annotate
    from mta.data.sources import input_reference

    cache = tmp_path / "hub"
    snapshot = cache_dataset(cache, REPO, COMMIT, {"train": qa_rows(LINES[:2])})
    (snapshot / "data" / "train-00000-of-00001.parquet").resolve().unlink()  # the blob, cleaned by hand
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    settings = AnnotateSettings(
        teacher=str(tiny_tokenizer_dir),
        student=str(tiny_tokenizer_dir),
        max_length=512,
        max_prompt_length=384,
        workers=1,
        fields={"prompt": "question", "response": "answer"},
    )
    with pytest.raises(
        MtaError,
        match=r"cache's copy is incomplete: .*train-00000-of-00001\.parquet links to .*missing.*"
        r"hf download --repo-type dataset acme/qa",
    ) as raised:
        run_annotate(input_reference(REPO), tmp_path / "out", settings)
    assert "check the split" not in str(raised.value)


def test_case11_an_all_digit_revision_override_says_to_quote_it(tmp_path, tiny_run_recipe):
    path = tiny_run_recipe(tmp_path / "out")
    with pytest.raises(
        MtaError, match=r"data\.revision: .*\(got 1234\); quote it to keep it a string: .*key='\"1234\"'"
    ):
        load_recipe(path, ["data.revision=1234"])
    assert load_recipe(path, ['data.revision="1234"']).data.revision == "1234"


def test_case11_a_half_sharded_cache_does_not_say_train_from_it(tmp_path, tiny_run_recipe):
    from typer.testing import CliRunner

    from mta_cli.main import app

    recipe = tiny_run_recipe(tmp_path / "out", data={"dev": None})
    done = CliRunner().invoke(app, ["teacher", "--recipe", str(recipe), "-o", str(tmp_path / "c"), "--shard", "0/2"])
    assert done.exit_code == 0, done.output
    last = " ".join(done.output.split()).rsplit("└", 1)[-1]
    assert "train from it" not in last and "run the others (--shard I/2" in last
