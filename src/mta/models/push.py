"""`mta push DIR REPO_ID`: an exported student (``final/``, ``best/``) onto the Hugging Face Hub.

:func:`plan_push` checks the directory before anything leaves the machine: it must be a model
directory (``config.json`` and weights) whose files match its ``checksums.sha256`` (every
``mta distill`` export has one; a directory without it, or one whose files changed, is refused
naming each file), with a model card whose YAML front matter the Hub reads
(``huggingface_hub.metadata_load``). The plan lists the files and their bytes, the repository,
its visibility and revision, and the card's metadata: ``mta push --dry-run`` prints it and stops.
:func:`push` uploads it through ``huggingface_hub`` (``create_repo(exist_ok=True)``, then one
``create_commit`` of every file), the token from the usual places (``HF_TOKEN``, ``hf auth login``);
with ``HF_HUB_OFFLINE=1`` or an unreachable Hub it fails at once, naming the fix.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mta.errors import MtaError
from mta.files import corrupt_artefact, read_artefact_json, reading_artefact
from mta.hashing import CHECKSUMS, checksum_differences, read_checksums
from mta.models.hub import endpoint, offline_mode, unreachable_reason
from mta.models.weights import WEIGHT_PATTERNS, checkpoint_fingerprint

CARD = "README.md"


@dataclass(frozen=True)
class PushPlan:
    """What ``push`` uploads: ``files`` (relative paths -> bytes) of ``directory`` to ``repo_id``."""

    directory: Path
    repo_id: str
    files: dict[str, int]
    card: dict[str, Any]  # the model card's front matter, as uploaded
    private: bool = False
    revision: str | None = None
    card_text: str | None = None  # README.md as uploaded, when it differs from the directory's (--results)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def plan_push(
    directory: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    results: str | Path | None = None,
) -> PushPlan:
    """The upload of ``directory`` to ``repo_id``, checked (module docstring); nothing is sent.
    ``results``: an ``mta evaluate`` output whose results.json scored this directory: the
    uploaded card gains its ``model-index`` (:func:`with_model_index`; the directory's own card,
    which its checksums cover, is left as it is)."""
    from huggingface_hub import metadata_load
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    directory = Path(directory)
    if not directory.is_dir():
        raise MtaError(f"{directory} is not a directory; give an exported student (OUT/final or OUT/best)")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise MtaError(f"REPO_ID {repo_id!r} is not a Hub repository id (user/name or org/name): {error}") from None
    if "/" not in repo_id:
        raise MtaError(f"REPO_ID {repo_id!r}: name its owner too, as user/name or org/name")
    names = [path.name for path in directory.iterdir() if path.is_file()]
    if "config.json" not in names or not any(fnmatch.fnmatch(n, p) for n in names for p in WEIGHT_PATTERNS):
        raise MtaError(
            f"{directory} holds no config.json and weights: give an exported student (OUT/final or OUT/best)"
        )
    recorded = read_checksums(directory)
    if recorded is None:
        raise MtaError(
            f"{directory} has no {CHECKSUMS}: mta pushes only directories it can verify (every `mta distill` export "
            f"has one; `sha256sum` of each file into {CHECKSUMS} makes one for another directory)"
        )
    differences = checksum_differences(directory, recorded)
    if differences:
        raise MtaError(
            f"{directory} does not match its {CHECKSUMS}: "
            + "; ".join(differences)
            + ". It changed after it was written: re-export it (or re-run the step that wrote it)"
        )
    with reading_artefact(
        directory / CARD, "its YAML front matter does not parse: re-export the model (mta distill writes the card)"
    ):
        card = metadata_load(directory / CARD) if (directory / CARD).is_file() else None
    if not card:
        raise MtaError(f"{directory}/{CARD}: no model card with YAML front matter (mta distill writes one)")
    files = {
        path.relative_to(directory).as_posix(): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    }
    card_text = None
    if results is not None:
        card_text = with_model_index((directory / CARD).read_text(encoding="utf-8"), directory, repo_id, Path(results))
        card = metadata_from_text(card_text)
    return PushPlan(directory, repo_id, files, dict(card), private=private, revision=revision, card_text=card_text)


def metadata_from_text(text: str) -> dict[str, Any]:
    from huggingface_hub import ModelCard

    return ModelCard(text).data.to_dict()


def with_model_index(card_text: str, directory: Path, repo_id: str, results_dir: Path) -> str:
    """``card_text`` with a ``model-index``: the mean ROUGE-L over seeds of every set
    ``results_dir/results.json`` scored for the model at ``directory`` (found by its fingerprint,
    :func:`scored_entry`), through ``huggingface_hub.EvalResult``. ``MtaError`` when the file
    scored another model, or is corrupt."""
    from huggingface_hub import EvalResult, ModelCard

    path = results_dir / "results.json"
    rebuild = (
        f"re-run the `mta evaluate ... -o {results_dir}` that wrote it (it rebuilds results.json from its predictions)"
    )
    results = read_artefact_json(path, rebuild)
    if results is None:
        raise MtaError(f"--results {results_dir}: no results.json; give the -o directory of `mta evaluate`")
    entry = scored_entry(results, Path(directory), path, rebuild)
    seeds = len(results.get("settings", {}).get("seeds", []) or [])
    sets = results.get("sets", {})
    card = ModelCard(card_text)
    card.data.model_name = repo_id.split("/", 1)[1]
    card.data.eval_results = [
        EvalResult(
            task_type="text-generation",
            task_name="Instruction following (MiniLLM protocol)",
            dataset_type=sets.get(name, {}).get("hub_id", name),  # a Hub set: its id, as the Hub links it
            dataset_name=sets.get(name, {}).get("title", name),
            dataset_split=sets.get(name, {}).get("split"),
            dataset_revision=sets.get(name, {}).get("revision"),
            metric_type="rougeL",
            metric_name=f"ROUGE-L (mean over {seeds} sampling seeds)" if seeds else "ROUGE-L",
            metric_value=round(float(summary["rougeL"]["mean"]), 4),
        )
        for name, summary in entry["sets"].items()
    ]
    return str(card)


def scored_entry(results: dict[str, Any], directory: Path, path: Path, rebuild: str) -> dict[str, Any]:
    """The checkpoint entry of ``results`` (read from ``path``) that scored the model now at
    ``directory``: the one whose fingerprint is the model's (:func:`mta.models.weights.checkpoint_fingerprint`,
    the rule evaluation keys its predictions on), wherever it was evaluated from. Scores of the
    same path with another fingerprint (the directory retrained or changed since) are refused,
    naming both."""
    runs = results.get("checkpoints")
    if not isinstance(runs, dict) or not all(isinstance(e, dict) for e in runs.values()):
        raise corrupt_artefact(path, rebuild, TypeError("its 'checkpoints' is not an object of checkpoint entries"))
    fingerprint = checkpoint_fingerprint(directory)[0]
    for entry in runs.values():
        if entry.get("fingerprint") == fingerprint:
            if not isinstance(entry.get("sets"), dict):
                raise corrupt_artefact(path, rebuild, TypeError("the checkpoint's 'sets' is not an object"))
            return entry
    wanted = directory.resolve()
    same_path = [e for e in runs.values() if Path(str(e.get("checkpoint"))).resolve() == wanted]
    if same_path:
        raise MtaError(
            f"--results {path.parent} scored {directory} when its fingerprint was {same_path[0].get('fingerprint')}; "
            f"it is {fingerprint} now (the model changed since, e.g. retrained): those scores are not this "
            f"model's. Evaluate it again (`mta evaluate {directory}`) and push with that -o"
        )
    scored = ", ".join(f"{e.get('checkpoint')} ({e.get('fingerprint')})" for e in runs.values()) or "none"
    raise MtaError(
        f"--results {path.parent} scored {scored}, not {directory} ({fingerprint}): evaluate it first "
        f"(`mta evaluate {directory}`)"
    )


def require_hub(what: str = "pushing") -> None:
    """``MtaError`` at once when the Hub cannot take a push: ``HF_HUB_OFFLINE=1``, or unreachable
    (one short request, :func:`mta.models.hub.unreachable_reason`)."""
    if offline_mode():
        raise MtaError(f"HF_HUB_OFFLINE=1 is set: {what} needs the Hub; unset it where the Hub is reachable")
    reason = unreachable_reason(endpoint())
    if reason is not None:
        raise MtaError(f"the Hugging Face Hub ({endpoint()}) cannot be reached ({reason}); {what} needs it")


def push(plan: PushPlan, *, api: Any = None) -> str:
    """Upload ``plan`` (one commit); returns the commit's URL. ``api``: an ``HfApi`` (the default
    one when None), e.g. for another endpoint."""
    if api is None:
        require_hub()
        from huggingface_hub import HfApi

        api = HfApi()
    from huggingface_hub import CommitOperationAdd

    api.create_repo(plan.repo_id, private=plan.private, exist_ok=True, repo_type="model")
    if plan.revision is not None:
        api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True, repo_type="model")
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(plan.directory / name))
        for name in plan.files
        if not (name == CARD and plan.card_text is not None)
    ]
    if plan.card_text is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=plan.card_text.encode("utf-8")))
    commit = api.create_commit(
        repo_id=plan.repo_id,
        repo_type="model",
        revision=plan.revision,
        operations=operations,
        commit_message=f"mta push: {plan.directory.name} ({len(plan.files)} files)",
    )
    return str(getattr(commit, "commit_url", commit))


def push_run_exports(output_dir: Path, repo_id: str) -> list[str]:
    """``train.push_to_hub``: a finished run's ``final/`` to ``repo_id`` and its ``best/`` (when
    there is one) to the branch ``best``; the commits' URLs. A failed push leaves the run as it is
    and names the `mta push` command that retries it."""
    urls = []
    for name, revision in (("final", None), ("best", "best")):
        directory = Path(output_dir) / name
        if name == "best" and not directory.is_dir():
            continue
        try:
            urls.append(push(plan_push(directory, repo_id, revision=revision)))
        except Exception as error:
            retry = f"mta push {directory} {repo_id}" + (f" --revision {revision}" if revision else "")
            raise MtaError(f"train.push_to_hub: {error}; the run is complete: push it with `{retry}`") from error
    return urls


__all__ = ["PushPlan", "plan_push", "push", "push_run_exports", "require_hub", "scored_entry"]
