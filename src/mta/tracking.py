"""Experiment tracking: the records of a run sent to TensorBoard, Weights & Biases and MLflow.

``train.report_to: [tensorboard, wandb, mlflow]`` (default ``[]``) and ``mta evaluate --report-to``
name the backends. ``metrics.jsonl`` and ``results.json`` stay the record of truth; a tracker
gets a copy of each record as it is written:

* every numeric field of a record as a scalar ``<split>/<key>`` at the record's ``step``
  (``train/loss``, ``train/loss/base``, ``dev/off_policy/dev_ce``...; MLflow's file store cannot
  hold ``train/loss`` beside ``train/loss/base``, so there the key's own ``/`` become ``.``:
  ``train/loss.base``);
* a record's ``samples`` (``[{prompt, generation}]``, the dev lines) as text: TensorBoard text
  ``dev/samples``, a W&B table ``dev/samples``, an MLflow artifact ``samples/dev-step-NNNNNN.md``;
* the resolved recipe (``log_config``): TensorBoard text ``config``, the W&B run's config,
  MLflow params (dotted keys, ``train.lr``) plus the artifact ``config.yaml``.

Where each backend writes: TensorBoard ``OUT/tensorboard/``; W&B ``OUT/wandb/`` (``WANDB_MODE``,
``WANDB_PROJECT`` as W&B reads them; the project defaults to the recipe's name); MLflow
``$MLFLOW_TRACKING_URI``, else a local file store ``OUT/mlruns`` (experiment
``$MLFLOW_EXPERIMENT_NAME``, else the recipe's name). Runs are named ``<recipe name>-<run id's
first 8 characters>`` and carry the whole run id (MLflow tag ``mta.run_id``, W&B tag
``mta-run-<id>``). Only the main process reports.

A run resumed from a checkpoint continues the same backend run: TensorBoard writes into the same
directory with ``purge_step`` = the resumed step + 1, so what a killed run logged past its last
checkpoint is hidden, as ``metrics.jsonl`` drops those lines; W&B and MLflow continue the run
whose id ``OUT/tracking.json`` holds (W&B drops steps it has already seen; MLflow keeps both
values of such a step, and a recipe value a resume changed is added as the tag
``resume-step-N/<key>`` since MLflow params cannot change). A new run in the directory
(``--overwrite``) replaces ``OUT/tensorboard/``'s event files and opens new W&B and MLflow runs.

Backends are imported only when listed, and a listed one that is not installed is refused
before any work (``require``) with the ``pip install 'mta-distill[NAME]'`` that installs it, and so is an
MLflow tracking server (``MLFLOW_TRACKING_URI=http(s)://…``) that does not answer one request within
seconds (MLflow's own client retries for minutes before it gives up). A backend
that fails while training (a tracking server gone) is reported once in the log and dropped; the
run goes on.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from mta import distributed
from mta.errors import MtaError
from mta.files import atomic_write_json

log = logging.getLogger(__name__)

BACKENDS = ("tensorboard", "wandb", "mlflow")
# The module a backend needs, to check it is installed before any work.
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow.tracking"}
STATE_FILE = "tracking.json"  # the backend run ids a resumed run continues
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # W&B writes OUT/wandb/
MLFLOW_DIR = "mlruns"
_MLFLOW_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
REACH_TIMEOUT_S = 4.0  # connect + first byte of the one request to a tracking server


class Tracker(Protocol):
    """One backend: receives records as metrics.jsonl gets them, then is closed once."""

    name: str

    def log(self, record: Mapping[str, Any]) -> None: ...

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


# --------------------------------------------------------------------------- what is sent


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """``{"<split>/<key>": value}`` for every numeric field but ``step``."""
    split = record.get("split", "train")
    return {
        f"{split}/{key}": float(value)
        for key, value in record.items()
        if key not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def samples_text(samples: Sequence[Mapping[str, str]]) -> str:
    """Sampled generations as Markdown (indented blocks keep any text literal)."""

    def block(text: str) -> str:
        return "\n".join("    " + line for line in (text.splitlines() or [""]))

    return "\n\n".join(
        f"**sample {i}: prompt**\n\n{block(s.get('prompt', ''))}\n\n**generation**\n\n{block(s.get('generation', ''))}"
        for i, s in enumerate(samples, 1)
    )


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys; lists and other values as JSON text (``train.lr: "0.001"``)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(flat_params(value, name + "."))
        else:
            params[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return params


def config_text(config: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True)


def evaluation_record(results: Mapping[str, Any]) -> dict[str, Any]:
    """results.json as one record (split ``eval``, step 0): per checkpoint and set the mean and
    std over seeds of ROUGE-L and exact match, each seed's mean ROUGE-L, the averages and the
    perplexity: ``<label>/<set>/rougeL``, ``<label>/<set>/rougeL_std``,
    ``<label>/<set>/rougeL/seed-<s>``, ``<label>/avg4``, ``<label>/perplexity``..."""
    record: dict[str, Any] = {"split": "eval", "step": 0}
    for label, checkpoint in results["checkpoints"].items():
        for name, summary in checkpoint["sets"].items():
            for metric in ("rougeL", "exact_match"):
                record[f"{label}/{name}/{metric}"] = summary[metric]["mean"]
                record[f"{label}/{name}/{metric}_std"] = summary[metric]["std"]
            for seed, value in summary["rougeL"]["per_seed"].items():
                record[f"{label}/{name}/rougeL/seed-{seed}"] = value
        for average in ("avg4", "avg", "avg_ood"):
            if checkpoint.get(average) is not None:
                record[f"{label}/{average}"] = checkpoint[average]
        for key in ("perplexity", "nll"):
            if (checkpoint.get("perplexity") or {}).get(key) is not None:
                record[f"{label}/{key}"] = checkpoint["perplexity"][key]
    return record


# --------------------------------------------------------------------------- backends


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, output_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = output_dir / TENSORBOARD_DIR
        if resume_step is None:  # a new run: the events of the one it replaces go
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        # Continuing: events of the earlier run at or past this step are discarded by readers.
        self.first_step = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else self.first_step)

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        if record.get("samples"):
            self.writer.add_text(f"{record.get('split', 'train')}/samples", samples_text(record["samples"]), step)
        self.writer.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = "\n".join("    " + line for line in config_text(config).splitlines())
        self.writer.add_text("config", text, self.first_step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, output_dir: Path, run_name: str, project: str, run_id: str, state: _State):
        import wandb

        stored = state.get(self.name)
        (output_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        arguments: dict[str, Any] = dict(
            project=os.environ.get("WANDB_PROJECT") or project,
            name=run_name,
            dir=str(output_dir),
            tags=[f"mta-run-{run_id}"] if run_id else None,
        )
        if stored is not None and isinstance(stored.get("id"), str):
            arguments.update(id=stored["id"], resume="allow")
        try:
            self.run = wandb.init(**arguments)
        except Exception as error:  # noqa: BLE001 - wandb raises its own types for these
            raise MtaError(
                f"W&B could not start a run ({type(error).__name__}: {error}); log in with `wandb login`, "
                "or set WANDB_MODE=offline (sync later with `wandb sync`), or remove wandb from report_to"
            ) from error
        self._table = wandb.Table
        state.put(self.name, {"id": self.run.id, "project": self.run.project})

    def log(self, record: Mapping[str, Any]) -> None:
        values: dict[str, Any] = dict(scalars(record))
        if record.get("samples"):
            values[f"{record.get('split', 'train')}/samples"] = self._table(
                columns=["prompt", "generation"],
                data=[[s.get("prompt", ""), s.get("generation", "")] for s in record["samples"]],
            )
        self.run.log(values, step=int(record["step"]))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def mlflow_key(name: str) -> str:
    """``train/loss/base`` -> ``train/loss.base`` (a file store keeps a metric per file), other
    characters MLflow refuses as ``_``."""
    split, _, key = name.partition("/")
    return re.sub(r"[^\w\-. /]", "_", f"{split}/{key.replace('/', '.')}" if key else split)


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self, output_dir: Path, run_name: str, experiment: str, run_id: str, state: _State, resume_step: int | None
    ):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = uri or "local"  # recorded as "local" so a moved OUT still finds its run
        if uri is None:
            uri = (output_dir / MLFLOW_DIR).resolve().as_uri()
            # MLflow 3 refuses a file store unless asked for; mlflow-skinny has no database one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        self._metric, self._param = Metric, Param
        self._max_value = MAX_PARAM_VAL_LENGTH
        self.resume_step = resume_step
        stored = state.get(self.name)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            if stored is not None and stored.get("store") == store and isinstance(stored.get("run_id"), str):
                self.run_id = stored["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment
                found = self.client.get_experiment_by_name(name)
                experiment_id = found.experiment_id if found is not None else self.client.create_experiment(name)
                tags = {"mta.run_id": run_id} if run_id else None
                self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        except Exception as error:  # noqa: BLE001 - MlflowException, a missing database driver...
            raise MtaError(
                f"MLflow could not start a run at {uri} ({type(error).__name__}: {error}); check "
                "MLFLOW_TRACKING_URI (unset: a file store in OUT/mlruns; mlflow-skinny reads file stores "
                "and tracking servers, a database URI needs the full mlflow), or remove mlflow from report_to"
            ) from error
        state.put(self.name, {"run_id": self.run_id, "store": store})

    def log(self, record: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        step = int(record["step"])
        metrics = [self._metric(mlflow_key(tag), value, now, step) for tag, value in scalars(record).items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
        if record.get("samples"):
            split = record.get("split", "train")
            self.client.log_text(self.run_id, samples_text(record["samples"]), f"samples/{split}-step-{step:06d}.md")

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = {key: value[: self._max_value] for key, value in flat_params(config).items()}
        logged = self.client.get_run(self.run_id).data.params
        new = [self._param(key, value) for key, value in params.items() if key not in logged]
        for start in range(0, len(new), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + _MLFLOW_PARAMS_PER_BATCH])
        for key, value in params.items():  # a param never changes: a resume's change is a tag
            if key in logged and logged[key] != value:
                self.client.set_tag(self.run_id, f"resume-step-{self.resume_step}/{key}", value)
        suffix = "" if self.resume_step is None else f"-step-{self.resume_step}"
        self.client.log_text(self.run_id, config_text(config), f"config{suffix}.yaml")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# --------------------------------------------------------------------------- opening


def check_names(names: Iterable[str], source: str) -> list[str]:
    """``names`` without repeats, each a known backend; ``MtaError`` naming ``source`` otherwise."""
    checked: list[str] = []
    for name in names:
        if name not in BACKENDS:
            raise MtaError(f"{source}: unknown tracker {name!r}; choose from {', '.join(BACKENDS)}")
        if name not in checked:
            checked.append(name)
    return checked


def require(names: Iterable[str], source: str = "train.report_to") -> list[str]:
    """Import every listed backend now, so a missing one stops the command before any work; and
    with mlflow listed and ``MLFLOW_TRACKING_URI`` a tracking server, refuse it within seconds
    when it does not answer (``server_unreachable``) instead of after MLflow's minutes of retries."""
    checked = check_names(names, source)
    for name in checked:
        try:
            importlib.import_module(_MODULES[name])
        except ImportError as error:
            raise MtaError(
                f"{source} lists {name}, which is not installed ({error}); install it with "
                f"pip install 'mta-distill[{name}]', or remove {name} from {source}"
            ) from error
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if "mlflow" in checked and uri and urlsplit(uri).scheme in ("http", "https"):
        reason = server_unreachable(uri)
        if reason is not None:
            raise MtaError(
                f"{source} lists mlflow, and the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI) "
                f"cannot be reached ({reason}); start the server or correct MLFLOW_TRACKING_URI, unset it "
                f"to track into a file store in OUT/{MLFLOW_DIR}, or remove mlflow from {source}"
            )
    return checked


@functools.cache
def server_unreachable(url: str) -> str | None:
    """None when ``url`` answers one short request (any HTTP status counts), else why not, in a few
    words. Once per process (``server_unreachable.cache_clear()`` forgets it); made with requests,
    as MLflow's client is, so the same proxy and certificate settings apply."""
    import requests

    try:
        requests.head(url, timeout=REACH_TIMEOUT_S, allow_redirects=False)
    except Exception as error:  # noqa: BLE001 - refused, DNS, timeout, TLS, proxy: all "not reachable"
        detail = str(error).splitlines()[0] if str(error) else ""
        return f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    return None


class _State:
    """``OUT/tracking.json``: the backend run ids of the mta run ``run_id`` (written atomically)."""

    def __init__(self, output_dir: Path, run_id: str, continued: bool):
        self.path = output_dir / STATE_FILE
        stored: dict[str, Any] = {}
        if continued:
            try:
                stored = json.loads(self.path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                pass
            except ValueError as error:
                log.warning("%s is unreadable (%s): new tracker runs are started", self.path, error)
            if not isinstance(stored, dict) or stored.get("run_id") != run_id:
                stored = {}
        self.data: dict[str, Any] = {**stored, "run_id": run_id}

    def get(self, backend: str) -> dict[str, Any] | None:
        value = self.data.get(backend)
        return value if isinstance(value, dict) else None

    def put(self, backend: str, value: dict[str, Any]) -> None:
        self.data[backend] = value
        atomic_write_json(self.path, self.data)


class Trackers:
    """The open trackers as one: a failing backend is reported once and dropped."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, call: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as error:  # noqa: BLE001 - metrics.jsonl keeps every record
                log.warning(
                    "%s failed (%s: %s); it receives nothing more from this run (metrics.jsonl has every record)",
                    tracker.name,
                    type(error).__name__,
                    error,
                )
                self.trackers.remove(tracker)
                if call != "close":
                    self._close_quietly(tracker)

    @staticmethod
    def _close_quietly(tracker: Tracker) -> None:
        try:
            tracker.close(failed=True)
        except Exception:  # noqa: BLE001
            pass

    def log(self, record: Mapping[str, Any]) -> None:
        self._each("log", record)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each("log_config", config)

    def close(self, failed: bool = False) -> None:
        """Finish every backend run (``failed``: marked failed where the backend can); once."""
        self._each("close", failed)
        self.trackers = []


def open_trackers(
    names: Iterable[str],
    output_dir: Path,
    *,
    name: str,
    run_id: str,
    resume_step: int | None = None,
    project: str | None = None,
    source: str = "train.report_to",
) -> Trackers:
    """The listed backends, opened on the main process (empty elsewhere).

    name: the recipe's name (the run is ``<name>-<run_id[:8]>``); project: the W&B project and
    MLflow experiment when the environment names none (default: ``name``); resume_step: the step
    a run continues from (None: a new run).
    """
    names = require(names, source)
    if not names or not distributed.is_main():
        return Trackers()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    state = _State(output_dir, run_id, continued=resume_step is not None)
    run_name = f"{name}-{run_id[:8]}" if run_id else name
    opened: list[Tracker] = []
    try:
        for backend in names:
            if backend == "tensorboard":
                opened.append(TensorBoardTracker(output_dir, resume_step))
            elif backend == "wandb":
                opened.append(WandbTracker(output_dir, run_name, project or name, run_id, state))
            else:
                opened.append(MlflowTracker(output_dir, run_name, project or name, run_id, state, resume_step))
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    return Trackers(opened)


def report_evaluation(
    names: Iterable[str], out_dir: Path, results: Mapping[str, Any], *, run_id: str, source: str = "--report-to"
) -> None:
    """Send an evaluation's results.json (``evaluation_record``; its settings and checkpoints as
    the config) to the listed backends, as a new run ``evaluate-<out dir name>-<run_id[:8]>`` in
    the W&B project / MLflow experiment ``mta`` (unless the environment names one)."""
    trackers = open_trackers(
        names, out_dir, name=f"evaluate-{Path(out_dir).resolve().name}", run_id=run_id, project="mta", source=source
    )
    try:
        trackers.log_config(
            {
                "settings": results.get("settings", {}),
                "checkpoints": {k: v.get("checkpoint") for k, v in results["checkpoints"].items()},
            }
        )
        trackers.log(evaluation_record(results))
    except BaseException:
        trackers.close(failed=True)
        raise
    trackers.close()


__all__ = [
    "BACKENDS",
    "Tracker",
    "Trackers",
    "open_trackers",
    "require",
    "report_evaluation",
    "evaluation_record",
    "scalars",
    "samples_text",
    "flat_params",
    "mlflow_key",
]
