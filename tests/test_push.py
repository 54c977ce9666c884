"""`mta push` (mta.models.push): an exported student is checked against its checksums and card
before anything is sent; --dry-run plans the upload; the upload is one `upload_folder` commit.
huggingface_hub ships no local stand-in of the Hub, so the upload calls are checked on a
recording `HfApi` stand-in; the real Hub path is not exercised here (no network)."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from mta.errors import MtaError
from mta.hashing import CHECKSUMS, checksum_text, directory_checksums
from mta.models.push import plan_push, push
from mta_cli.main import app

CARD = (
    "---\nlicense: apache-2.0\nlibrary_name: transformers\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n---\n# s\n"
)


@pytest.fixture
def export(tmp_path, tiny_model_dir):
    directory = tmp_path / "final"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "README.md").write_text(CARD)
    (directory / CHECKSUMS).write_text(checksum_text(directory_checksums(directory)))
    return directory


class RecordingApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **options):
        self.calls.append(("create_repo", repo_id, options))

    def create_branch(self, repo_id, **options):
        self.calls.append(("create_branch", repo_id, options))

    def create_commit(self, **options):
        self.calls.append(("create_commit", options["repo_id"], options))
        return "https://huggingface.co/o/m/commit/abc"


def uploaded(options) -> dict[str, object]:
    """``path in repo -> what is sent`` (a file's path, or bytes) of one recorded commit."""
    return {op.path_in_repo: op.path_or_fileobj for op in options["operations"]}


def test_the_dry_run_lists_the_files_the_repository_and_the_card(export):
    result = CliRunner().invoke(
        app, ["push", str(export), "me/student", "--private", "--dry-run"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "model.safetensors" in result.stdout and CHECKSUMS in result.stdout and "README.md" in result.stdout
    assert "me/student (private)" in result.stdout and "license: apache-2.0" in result.stdout
    assert "dry run: nothing was sent" in result.stdout


def test_the_upload_is_one_commit_of_the_checked_files(export):
    api = RecordingApi()
    plan = plan_push(export, "me/student", private=True, revision="v1")
    assert push(plan, api=api) == "https://huggingface.co/o/m/commit/abc"
    (_, _, repo), (_, _, branch), (_, repo_id, commit) = api.calls
    assert repo["private"] is True and branch["branch"] == "v1" and repo_id == "me/student"
    assert commit["revision"] == "v1" and set(uploaded(commit)) == set(plan.files) and CHECKSUMS in plan.files
    assert uploaded(commit)["README.md"] == str(export / "README.md")  # the directory's own card


def test_a_changed_file_a_missing_list_or_a_bad_repo_id_is_refused_before_anything_is_sent(export):
    with pytest.raises(MtaError, match="not a Hub repository id|name its owner"):
        plan_push(export, "no slash")
    with pytest.raises(MtaError, match="name its owner"):
        plan_push(export, "student")
    (export / "config.json").write_text((export / "config.json").read_text() + " ")
    with pytest.raises(MtaError, match=r"config\.json \(changed"):
        plan_push(export, "me/student")
    (export / CHECKSUMS).unlink()
    with pytest.raises(MtaError, match="has no checksums.sha256"):
        plan_push(export, "me/student")


def test_offline_the_upload_fails_at_once_naming_the_setting(export, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(MtaError, match="HF_HUB_OFFLINE=1"):
        push(plan_push(export, "me/student"))


def test_train_push_to_hub_pushes_final_and_best_when_the_run_ends(tmp_path, tiny_run_recipe, monkeypatch):
    import huggingface_hub

    from mta.models import push as push_module
    from mta.training.config.loading import load_recipe
    from mta.training.trainer import run_distillation

    api = RecordingApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    monkeypatch.setattr(push_module, "unreachable_reason", lambda url: None)
    recipe = load_recipe(tiny_run_recipe(tmp_path / "out", train={"push_to_hub": "me/tiny", "max_steps": 2}))
    final = run_distillation(recipe)
    commits = [options for name, _, options in api.calls if name == "create_commit"]
    assert (tmp_path / "out" / "best").is_dir() and len(commits) == 2  # a dev split: best/ by dev loss
    assert uploaded(commits[0])["config.json"] == str(final / "config.json") and commits[0]["revision"] is None
    assert uploaded(commits[1])["config.json"] == str(tmp_path / "out" / "best" / "config.json")
    assert commits[1]["revision"] == "best"


def test_train_push_to_hub_offline_stops_before_any_work(tmp_path, tiny_run_recipe, monkeypatch):
    from huggingface_hub import constants

    from mta.training.config.loading import load_recipe
    from mta.training.trainer import run_distillation

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    recipe = load_recipe(tiny_run_recipe(tmp_path / "out", train={"push_to_hub": "me/tiny"}))
    with pytest.raises(MtaError, match="HF_HUB_OFFLINE=1 is set: train.push_to_hub needs the Hub"):
        run_distillation(recipe)
    assert not (tmp_path / "out" / "run.json").exists()
    with pytest.raises(MtaError, match="push_to_hub"):
        load_recipe(tiny_run_recipe(tmp_path / "out", train={"push_to_hub": "no owner"}))


def test_results_add_a_model_index_to_the_uploaded_card_and_leave_the_directory_s_own(export, tmp_path):
    import json

    from huggingface_hub import ModelCard

    from mta.models.weights import checkpoint_fingerprint

    results = tmp_path / "eval"
    results.mkdir()
    sets = {"dolly": {"rougeL": {"mean": 24.51234}}, "vicuna": {"rougeL": {"mean": 17.2}}}
    payload = {
        "settings": {"seeds": [10, 20, 30]},
        "sets": {"dolly": {"title": "Dolly"}, "vicuna": {"title": "Vicuna"}},
        "checkpoints": {
            "other": {"checkpoint": str(tmp_path / "x"), "sets": {}},
            "s": {"checkpoint": str(export), "fingerprint": checkpoint_fingerprint(str(export))[0], "sets": sets},
        },
    }
    (results / "results.json").write_text(json.dumps(payload))
    before = (export / "README.md").read_text()
    plan = plan_push(export, "me/student", results=results)
    card = ModelCard(plan.card_text)
    assert card.data.license == "apache-2.0" and card.data.model_name == "student"
    scores = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert scores == {("dolly", "rougeL"): 24.5123, ("vicuna", "rougeL"): 17.2}
    assert "mean over 3 sampling seeds" in card.data.eval_results[0].metric_name
    api = RecordingApi()
    push(plan, api=api)
    assert uploaded(api.calls[-1][2])["README.md"] == plan.card_text.encode("utf-8")
    assert (export / "README.md").read_text() == before  # its checksums still hold
    payload["checkpoints"].pop("s")
    (results / "results.json").write_text(json.dumps(payload))
    with pytest.raises(MtaError, match=r"not .*final \(sha256:[0-9a-f]+\): evaluate it first"):
        plan_push(export, "me/student", results=results)
