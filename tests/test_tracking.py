"""`train.report_to` / `mta evaluate --report-to`: what each tracker received, read back with the
backend's own readers (TensorBoard's EventAccumulator, W&B's offline run file, MLflow's client)
and compared with metrics.jsonl / results.json; a resume continues the same backend runs; a
tracker that is not installed is refused before any work."""

from __future__ import annotations

import http.server
import json
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fixtures.commands import only_line, run_mta
from fixtures.distill import write_recipe
from mta import tracking
from mta.errors import MtaError
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.metrics import read_metrics
from mta.training.trainer import run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "recipes" / "examples" / "tiny.jsonl"
ALL = ["tensorboard", "wandb", "mlflow"]
SFT = {"base": "ce", "dsa_weight": 0, "hra_weight": 0}  # no teacher to build


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """W&B offline with its caches in a temporary directory, MLflow's default (OUT/mlruns), no
    tracker settings from the machine running the tests."""
    patch = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("wandb-home")
    for name in (
        "WANDB_PROJECT",
        "WANDB_DIR",
        "WANDB_RUN_ID",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_ALLOW_FILE_STORE",
    ):
        patch.setenv(name, "")  # recorded, so the code's own setdefault is undone afterwards
        patch.delenv(name)
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    patch.setenv("WANDB_DISABLE_GIT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        patch.setenv(name, str(home / name.lower()))
    patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    patch.setenv("DO_NOT_TRACK", "true")
    yield
    patch.undo()


# --------------------------------------------------------------------------- readers


def read_tensorboard(directory: Path) -> dict:
    """``{"scalars": {tag: {step: value}}, "text": {tag: {step: str}}}`` as TensorBoard shows it
    (events an earlier run logged past a resume's purge step are gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    scalars: dict = {}
    for tag in tags["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag} shows a step twice: {steps}"
        scalars[tag] = {e.step: e.value for e in events.Scalars(tag)}
    text = {
        tag.removesuffix("/text_summary"): {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}
        for tag in tags["tensors"]
    }
    return {"scalars": scalars, "text": text}


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (LevelDB log format: 7-byte file header, 32 KiB
    blocks of chunks each with a 7-byte header: crc32, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # the block's tail is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb(out: Path) -> list[dict]:
    """Every offline W&B run file under OUT/wandb, in the order they started: id, name, project,
    config, history rows keyed by step."""
    runs = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"dir": path.parent, "config": {}, "history": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(
                    id=record.run.run_id,
                    name=record.run.display_name,
                    project=record.run.project,
                    tags=list(record.run.tags),
                    started=record.run.start_time.ToNanoseconds(),
                )
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                run["history"].setdefault(row["_step"], {}).update(row)
                continue
            else:
                continue
            run["config"].update({item.key: json.loads(item.value_json) for item in updates})
        runs.append(run)
    # Not by directory name: two runs started in the same second are -ID and -ID-1.
    return sorted(runs, key=lambda run: run["started"])


def read_mlflow(store: Path) -> list[dict]:
    """Every run of the local store: name, status, tags, params, metric histories, text artifacts."""
    from mlflow.artifacts import load_text
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    runs = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            run_id = run.info.run_id
            metrics = {
                key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics
            }
            artifacts = {}
            pending = [a for a in client.list_artifacts(run_id)]
            while pending:
                item = pending.pop()
                if item.is_dir:
                    pending += client.list_artifacts(run_id, item.path)
                else:
                    artifacts[item.path] = load_text(f"{run.info.artifact_uri}/{item.path}")
            runs.append(
                {
                    "run_id": run_id,
                    "name": run.info.run_name,
                    "status": run.info.status,
                    "experiment": experiment.name,
                    "tags": run.data.tags,
                    "params": run.data.params,
                    "metrics": metrics,
                    "artifacts": artifacts,
                }
            )
    return runs


def numeric(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k not in ("split", "step") and isinstance(v, (int, float))}


# --------------------------------------------------------------------------- one run, then its resume


@pytest.fixture(scope="module")
def tracked_runs(tracker_env, tmp_path_factory, teacher_dir, tiny_model_dir, same_data):  # noqa: F811
    """A 3-step run reporting to all three backends (dev at steps 0, 2 and 3, the last, with one sample each,
    checkpoints at steps 2 and 3), read back; then the same run resumed from step 2 for 4 steps
    at a lower learning rate (step 3 trained again, otherwise), read back again."""
    tmp = tmp_path_factory.mktemp("tracked")
    out = tmp / "run"
    recipe_path = write_recipe(
        tmp / "r.yaml",
        teacher=teacher_dir,
        student=tiny_model_dir,
        annotations=same_data,
        output_dir=out,
        train={
            "max_steps": 3,
            "eval_interval": 2,
            "save_interval": 2,
            "num_sample_generations": 1,
            "sample_max_new_tokens": 4,
            "report_to": ALL,
        },
    )
    run_distillation(load_recipe(recipe_path))
    first = {
        "metrics": read_metrics(out / "metrics.jsonl"),
        "run": json.loads((out / "run.json").read_text()),
        "recipe": load_recipe(recipe_path).model_dump(mode="json"),
        "tensorboard": read_tensorboard(out / "tensorboard"),
        "wandb": read_wandb(out),
        "mlflow": read_mlflow(out / "mlruns"),
        "state": json.loads((out / "tracking.json").read_text()),
    }
    # A lower rate from the resume on, so that its step 3 differs from the first run's.
    run_distillation(
        load_recipe(recipe_path, ["train.max_steps=4", "train.lr=1e-3"]), resume=str(out / "checkpoints" / "step-2")
    )
    resumed = {
        "metrics": read_metrics(out / "metrics.jsonl"),
        "tensorboard": read_tensorboard(out / "tensorboard"),
        "wandb": read_wandb(out),
        "mlflow": read_mlflow(out / "mlruns"),
    }
    return first, resumed


@pytest.mark.slow
def test_every_record_the_recipe_and_the_samples_reach_each_backend(tracked_runs):
    first, _ = tracked_runs
    records, recipe = first["metrics"], first["recipe"]
    assert [(r["split"], r["step"]) for r in records] == [
        ("dev", 0),
        ("train", 1),
        ("train", 2),
        ("dev", 2),
        ("train", 3),
        ("dev", 3),  # the last step, off the eval_interval
    ]
    dev_samples = {r["step"]: r["samples"] for r in records if r["split"] == "dev"}
    assert all(len(samples) == 1 for samples in dev_samples.values())
    run_id = first["run"]["run_id"]

    # TensorBoard: every numeric field of every record as <split>/<key> at its step, the recipe
    # as text, the dev samples as text.
    board = first["tensorboard"]
    expected = {}
    for record in records:
        for key, value in numeric(record).items():
            expected.setdefault(f"{record['split']}/{key}", {})[record["step"]] = value
    assert {"train/loss/base", "train/loss/dsa", "train/lr", "train/tokens_per_s", "dev/loss/hra"} <= set(expected)
    assert set(board["scalars"]) == set(expected)
    for tag, values in expected.items():
        assert board["scalars"][tag] == pytest.approx(values, rel=1e-6), tag
    config = board["text"]["config"][0]
    assert yaml.safe_load("\n".join(line[4:] for line in config.splitlines())) == recipe
    assert board["text"]["dev/samples"] == {step: tracking.samples_text(s) for step, s in dev_samples.items()}
    assert (
        dev_samples[0][0]["prompt"] and dev_samples[0][0]["prompt"].splitlines()[0] in board["text"]["dev/samples"][0]
    )

    # W&B (offline): one run named after the recipe and run id, the recipe as its config, every
    # metric in the history at its step, the samples as a table.
    (wandb_run,) = first["wandb"]
    assert wandb_run["id"] == first["state"]["wandb"]["id"]
    assert wandb_run["name"] == f"test-{run_id[:8]}" and wandb_run["project"] == "test"
    assert f"mta-run-{run_id}" in wandb_run["tags"]
    assert {key: wandb_run["config"][key] for key in recipe} == recipe
    for record in records:
        row = wandb_run["history"][record["step"]]
        for key, value in numeric(record).items():
            assert row[f"{record['split']}/{key}"] == pytest.approx(value, rel=1e-6), (record["step"], key)
    for step, samples in dev_samples.items():
        table = json.loads((wandb_run["dir"] / "files" / wandb_run["history"][step]["dev/samples/path"]).read_text())
        assert table["columns"] == ["prompt", "generation"]
        assert table["data"] == [[s["prompt"], s["generation"]] for s in samples]

    # MLflow (local file store OUT/mlruns): one finished run, the recipe as dotted params, every
    # metric's history, the samples as text artifacts.
    (mlflow_run,) = first["mlflow"]
    assert mlflow_run["run_id"] == first["state"]["mlflow"]["run_id"]
    assert mlflow_run["experiment"] == "test" and mlflow_run["name"] == f"test-{run_id[:8]}"
    assert mlflow_run["status"] == "FINISHED" and mlflow_run["tags"]["mta.run_id"] == run_id
    assert mlflow_run["params"] == tracking.flat_params(recipe)
    assert float(mlflow_run["params"]["train.lr"]) == recipe["train"]["lr"]
    assert json.loads(mlflow_run["params"]["train.report_to"]) == ALL
    history = {tracking.mlflow_key(tag): values for tag, values in expected.items()}
    assert set(mlflow_run["metrics"]) == set(history)
    for key, values in history.items():
        logged = mlflow_run["metrics"][key]
        assert len(logged) == len(values) and dict(logged) == pytest.approx(values, rel=1e-6), key
    assert yaml.safe_load(mlflow_run["artifacts"]["config.yaml"]) == recipe
    for step, samples in dev_samples.items():
        assert mlflow_run["artifacts"][f"samples/dev-step-{step:06d}.md"] == tracking.samples_text(samples)


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_backend_runs(tracked_runs):
    first, resumed = tracked_runs
    records = resumed["metrics"]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert sorted(train) == [1, 2, 3, 4]
    # Step 3 again, at another rate (its loss is the same: computed before its update).
    first_step_3 = next(r for r in first["metrics"] if r["step"] == 3)
    assert train[3]["lr"] == pytest.approx(1e-3) and first_step_3["lr"] == pytest.approx(5e-3)

    # TensorBoard: the same directory shows each step once: step 3 as the resumed run trained it.
    scalars = resumed["tensorboard"]["scalars"]
    assert scalars["train/lr"] == pytest.approx({s: r["lr"] for s, r in train.items()}, rel=1e-6)
    assert scalars["train/loss"] == pytest.approx({s: r["loss"] for s, r in train.items()}, rel=1e-6)
    assert scalars["dev/loss"] == pytest.approx(
        {r["step"]: r["loss"] for r in records if r["split"] == "dev"}, rel=1e-6
    )
    assert set(resumed["tensorboard"]["text"]["config"]) == {0, 3}  # the resumed recipe from step 3 on

    # W&B: the resume logged into a run with the same id.
    assert [run["id"] for run in resumed["wandb"]] == [first["wandb"][0]["id"]] * 2
    assert resumed["wandb"][1]["history"][4]["train/loss"] == pytest.approx(train[4]["loss"], rel=1e-6)

    # MLflow: still one run, now with steps 3 (again) and 4, finished; the changed max_steps,
    # which a param cannot take, as a tag.
    (mlflow_run,) = resumed["mlflow"]
    assert mlflow_run["run_id"] == first["mlflow"][0]["run_id"] and mlflow_run["status"] == "FINISHED"
    losses = mlflow_run["metrics"]["train/loss"]
    assert sorted(step for step, _ in losses) == [1, 2, 3, 3, 4]
    assert (4, pytest.approx(train[4]["loss"], rel=1e-6)) in losses
    rates = mlflow_run["metrics"]["train/lr"]
    assert sorted(value for step, value in rates if step == 3) == pytest.approx([1e-3, 5e-3])  # both kept
    assert mlflow_run["params"]["train.max_steps"] == "3" and float(mlflow_run["params"]["train.lr"]) == 5e-3
    assert mlflow_run["tags"]["resume-step-2/train.max_steps"] == "4"
    assert float(mlflow_run["tags"]["resume-step-2/train.lr"]) == 1e-3
    assert yaml.safe_load(mlflow_run["artifacts"]["config-step-2.yaml"])["train"]["max_steps"] == 4


# --------------------------------------------------------------------------- refusals, recipe key


def test_a_tracker_that_is_not_installed_is_refused_before_any_work(tmp_path, monkeypatch, tiny_model_dir, same_data):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    out = tmp_path / "run"
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            teacher=None,
            student=tiny_model_dir,
            annotations=same_data,
            output_dir=out,
            loss=SFT,
            train={"report_to": ["tensorboard", "wandb"]},
        )
    )
    with pytest.raises(
        MtaError, match=r"train\.report_to lists wandb, which is not installed .*pip install 'mta-distill\[wandb\]'"
    ):
        run_distillation(recipe)
    assert not out.exists()  # nothing claimed, loaded or written
    with pytest.raises(MtaError, match=r"--report-to lists wandb.*pip install 'mta-distill\[wandb\]'"):
        tracking.require(["wandb"], "--report-to")
    with pytest.raises(MtaError, match="unknown tracker 'comet'; choose from tensorboard, wandb, mlflow"):
        tracking.require(["comet"], "--report-to")


def closed_loopback_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed: a connection is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_mlflow_server_is_refused_within_seconds_before_any_model_loads(
    tracker_env, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    from mta.training import trainer

    uri = f"http://127.0.0.1:{closed_loopback_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracking.server_unreachable.cache_clear()
    monkeypatch.setattr(trainer, "build_run", lambda *a, **k: pytest.fail("the run was claimed or a model loaded"))
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        teacher=None,
        student=tiny_model_dir,
        annotations=EXAMPLES,
        output_dir=out,
        loss=SFT,
        train={"report_to": ["mlflow"]},
    )
    started = time.monotonic()
    code, lines = run_mta(monkeypatch, capsys, "distill", "--recipe", recipe)
    assert time.monotonic() - started < 10  # MLflow's own retries take minutes
    assert code == 2
    assert only_line(lines, "error:").startswith(
        f"error: train.report_to lists mlflow, and the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI) "
        "cannot be reached (ConnectionError: "
    )
    assert not out.exists()
    tracking.server_unreachable.cache_clear()


def test_a_tracking_server_that_answers_at_all_counts_as_reachable(tracker_env, monkeypatch):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), NotFound) as server:
        threading.Thread(target=server.handle_request, daemon=True).start()
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        tracking.server_unreachable.cache_clear()
        assert tracking.require(["mlflow"], "--report-to") == ["mlflow"]
    tracking.server_unreachable.cache_clear()


def test_report_to_defaults_to_none_and_takes_a_name_or_a_list(tmp_path, tiny_model_dir, same_data):  # noqa: F811
    path = write_recipe(
        tmp_path / "r.yaml",
        teacher=None,
        student=tiny_model_dir,
        annotations=same_data,
        output_dir=tmp_path / "o",
        loss=SFT,
    )
    assert load_recipe(path).train.report_to == []
    assert load_recipe(path, ["train.report_to=tensorboard"]).train.report_to == ["tensorboard"]
    assert load_recipe(path, ["train.report_to=[mlflow,wandb,mlflow]"]).train.report_to == ["mlflow", "wandb"]
    with pytest.raises(MtaError, match="report_to"):
        load_recipe(path, ["train.report_to=[comet]"])


# --------------------------------------------------------------------------- evaluate


@pytest.mark.slow
def test_evaluate_reports_the_results_to_tensorboard_and_mlflow(tracker_env, tmp_path, tiny_model_dir):
    from mta_cli.main import app

    rows = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    (tmp_path / "data" / "dolly").mkdir(parents=True)
    (tmp_path / "data" / "dolly" / "valid.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:2]), encoding="utf-8"
    )
    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app,
        [
            "evaluate",
            str(tiny_model_dir),
            "--names",
            "tiny",
            "--out",
            str(out),
            "--data-dir",
            str(tmp_path / "data"),
            "--seeds",
            "1,2",
            "--max-new-tokens",
            "4",
            "--max-prompt-length",
            "48",
            "--report-to",
            "tensorboard,mlflow",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    results = json.loads((out / "results.json").read_text())
    dolly = results["checkpoints"]["tiny"]["sets"]["dolly"]
    expected = {
        "eval/tiny/dolly/rougeL": dolly["rougeL"]["mean"],
        "eval/tiny/dolly/rougeL_std": dolly["rougeL"]["std"],
        "eval/tiny/dolly/exact_match": dolly["exact_match"]["mean"],
        "eval/tiny/dolly/rougeL/seed-1": dolly["rougeL"]["per_seed"]["1"],
        "eval/tiny/dolly/rougeL/seed-2": dolly["rougeL"]["per_seed"]["2"],
        "eval/tiny/avg": results["checkpoints"]["tiny"]["avg"],
    }
    scalars = read_tensorboard(out / "tensorboard")["scalars"]
    for tag, value in expected.items():
        assert scalars[tag] == pytest.approx({0: value}, rel=1e-6), tag
    (run,) = read_mlflow(out / "mlruns")
    assert run["status"] == "FINISHED" and run["experiment"] == "mta" and run["name"].startswith("evaluate-eval-")
    for tag, value in expected.items():
        assert run["metrics"][tracking.mlflow_key(tag)] == [(0, pytest.approx(value, rel=1e-6))], tag
    assert json.loads(run["params"]["settings.seeds"]) == [1, 2]
