"""The user's environment and the rough edges: the version, help pages, a Hub that cannot be
reached, evaluation labels, a single seed's report, perplexity throughput, the model card, and
the README's offline commands run as written."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from mta.errors import MtaError

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# A marked block: an HTML comment line, then a ```bash fence (see README "The pipeline").
OFFLINE_BLOCK = re.compile(r"^<!-- offline(?P<slow>: slow)? -->\n```bash\n(?P<code>.*?)^```$", re.M | re.S)


def _flat(text: str) -> str:
    """Help and error text with rich's line wrapping undone."""
    return " ".join(text.split())


def _closed_port() -> int:
    """A local port nothing listens on (connections to it are refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="250")
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# --------------------------------------------------------------------------- version and help


def test_version_is_the_package_version():
    from mta import __version__
    from mta.versions import package_versions
    from mta_cli.main import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    expected = package_versions(("mta",))["mta"] or __version__
    assert result.output.strip() == f"mta {expected}"


def _all_commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _all_commands(sub, (*path, name))


def test_help_pages_show_examples_the_real_default_and_no_bool_metavar():
    import typer

    from mta_cli.main import app

    runner = CliRunner()
    pages = {}
    for path, _ in _all_commands(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
        assert result.exit_code == 0, (path, result.output)
        pages[" ".join(path)] = result.output
    assert {"annotate", "evaluate", "models qwen-tokenizer", "recipes list"} <= set(pages)
    for name, page in pages.items():
        assert "<bool>" not in page, name  # flags take no value: no type shown
    assert "--force" in pages["annotate"] and "--truncate-prompt" in pages["annotate"]  # flags still listed
    assert re.search(r"--max-length\s+(<int>|INTEGER)", pages["annotate"])  # options with values keep theirs
    assert "Example: mta annotate rows.jsonl --teacher" in _flat(pages["annotate"])
    assert "Example: mta evaluate runs/base/final runs/mta/final -o runs/eval" in _flat(pages["evaluate"])
    qwen = _flat(pages["models qwen-tokenizer"])
    assert "Default output: $MTA_CACHE_DIR/qwen-tokenizer" in qwen and "~/.cache/mta/models/qwen-tokenizer" in qwen
    assert "--version" in pages[""]


# --------------------------------------------------------------------------- the Hub


def test_an_unreachable_hub_fails_in_seconds_naming_the_fixes(tmp_path):
    """`mta evaluate gpt2` with the Hub's endpoint refusing connections: one line, exit 2, no retries."""
    env = _env(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mta_cli.main", "evaluate", "gpt2", "-o", str(tmp_path / "x"), "--limit", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    message = _flat(result.stderr)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "'gpt2'" in message and "cannot be reached" in message and "HF_HUB_OFFLINE=1" in message
    assert "local model directory" in message
    assert "Retrying" not in result.stderr + result.stdout and "Traceback" not in result.stderr
    assert elapsed < 20, f"{elapsed:.1f} s: the retries are back (about 30 s per file before)"


def test_distill_with_an_unreachable_hub_names_the_tokenizer(tmp_path, monkeypatch):
    """`mta distill --recipe gpt2` (no dry run): the first hub name it loads is refused at once."""
    from huggingface_hub import constants

    from mta.models import hub
    from mta_cli.main import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "endpoint", lambda: f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    real, checks = hub.unreachable_reason, []

    def timed(url):
        start = time.monotonic()
        reason = real(url)
        checks.append(time.monotonic() - start)
        return reason

    monkeypatch.setattr(hub, "unreachable_reason", timed)
    real.cache_clear()
    monkeypatch.setenv("MTA_DATA_DIR", str(tmp_path))
    try:
        result = CliRunner().invoke(app, ["distill", "--recipe", "gpt2"])
    finally:
        real.cache_clear()
    assert isinstance(result.exception, MtaError), result.output
    message = str(result.exception)
    assert "'gpt2'" in message and "HF_HUB_OFFLINE=1" in message and "cannot be reached" in message
    assert len(checks) == 1 and checks[0] < hub.REACH_TIMEOUT_S + 1  # one request, refused at once


def test_a_path_that_is_not_there_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    from mta.models import hub
    from mta.models.tokenizers import load_tokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "unreachable_reason", lambda url: pytest.fail("the Hub was asked"))
    with pytest.raises(MtaError, match=r"'runs/x/final': no such file or directory"):
        load_tokenizer("runs/x/final")
    assert hub.load_options(tmp_path) == {}  # a local directory: nothing to decide


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """A Hub that knows no model: it answers what the Hub answers for a repository that does not
    exist (401 + X-Error-Code). Under /down it hangs up without answering: an unreachable Hub."""

    def _answer(self):
        if self.path.startswith("/down"):
            self.close_connection = True
            return
        self.send_response(401)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


HUB_SCRIPT = textwrap.dedent("""
    import json, time, torch
    from mta.errors import MtaError
    from mta.evaluation.models_under_test import check_checkpoint, loaded_checkpoint
    from mta.models import hub
    from mta.models.tokenizers import load_tokenizer

    def refused(load, name):
        try:
            load(name)
        except MtaError as error:
            return str(error)

    out = {"typo": [refused(load_tokenizer, "gtp2"), refused(check_checkpoint, "gtp2")]}
    # The same Hub, now unreachable: org/tiny is in the cache (HF_HUB_CACHE), org/absent is not.
    endpoint = hub.endpoint()
    hub.endpoint = lambda: endpoint + "/down"
    hub.unreachable_reason.cache_clear()
    start = time.monotonic()
    out["vocab"] = len(load_tokenizer("org/tiny"))
    check_checkpoint("org/tiny")
    with loaded_checkpoint("org/tiny", torch.device("cpu"), torch.float32) as (model, _):
        out["layers"] = model.config.num_hidden_layers
    out["absent"] = refused(load_tokenizer, "org/absent")
    out["seconds"] = time.monotonic() - start
    print(json.dumps(out))
""")


def test_typos_and_cached_models_against_a_hub_that_knows_no_model_then_cannot_be_reached(tmp_path, tiny_model_dir):
    """A name the Hub does not know is named as one; with the Hub unreachable, a model in the
    Hugging Face cache loads from it (no retries) and one that is not is refused at once."""
    snapshot = tmp_path / "hub-cache" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in tiny_model_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = _env(HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}", HF_HUB_CACHE=str(tmp_path / "hub-cache"))
        result = subprocess.run(
            [sys.executable, "-c", HUB_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for message in out["typo"]:
        assert message is not None
        assert "'gtp2' is neither a local directory nor a model on the Hugging Face Hub" in message
        assert "check the spelling" in message
    assert out["vocab"] == 512 and out["layers"] == 4
    assert "'org/absent'" in out["absent"] and "HF_HUB_OFFLINE=1" in out["absent"]
    assert "cannot be reached" in out["absent"]
    assert "loads from the local Hugging Face cache" in result.stderr and "Retrying" not in result.stderr
    assert out["seconds"] < 20


# --------------------------------------------------------------------------- evaluation labels and report


def test_labels_are_run_names_lengthened_only_where_they_collide(tmp_path, monkeypatch):
    from mta.evaluation.models_under_test import checkpoint_labels, checkpoint_names

    monkeypatch.chdir(tmp_path)
    for relative in (
        "runs/tiny-long/final",
        "runs/a/final",
        "other/a/final",
        "runs/a/best",
        "runs/a/checkpoints/step-40",
        "models/student",
    ):
        (tmp_path / relative).mkdir(parents=True)
    assert checkpoint_labels(["runs/tiny-long/final", "gpt2", "Qwen/Qwen1.5-1.8B", "models/student"]) == [
        "tiny-long",
        "gpt2",
        "Qwen1.5-1.8B",
        "student",
    ]
    assert checkpoint_labels([str(tmp_path / "runs/tiny-long/final")]) == ["tiny-long"]  # absolute, same
    assert checkpoint_labels(["runs/a/final", "other/a/final"]) == ["runs--a", "other--a"]
    assert checkpoint_labels(["runs/a/final", "runs/a/best", "runs/a/checkpoints/step-40"]) == [
        "a-final",
        "a-best",
        "a-step-40",
    ]
    assert checkpoint_labels(["runs/a/final", "runs/tiny-long/final"]) == ["a", "tiny-long"]
    with pytest.raises(MtaError, match="share the label"):
        checkpoint_names(["runs/a/final", "./runs/a/final"])


def _results(seeds: list[int]) -> dict:
    def score(values):
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        return {"mean": mean, "std": std, "per_seed": {str(s): v for s, v in zip(seeds, values, strict=True)}}

    values = [12.0, 14.0][: len(seeds)]
    return {
        "sets": {"dolly": {}},
        "settings": {"seeds": seeds, "perplexity": None},
        "checkpoints": {
            "tiny": {"sets": {"dolly": {"rougeL": score(values)}}, "avg4": None, "avg": values[0], "avg_ood": None}
        },
    }


def test_a_single_seed_shows_its_mean_without_a_spread():
    from mta.evaluation.report import results_markdown, table_rows

    one = results_markdown(_results([10]))
    assert "| tiny | 12.00 |" in one and "±" not in one and "one seed (10)" in one
    _, body = table_rows(_results([10, 20]))
    assert body[0][1] == "13.00 ± 1.00"  # two seeds: mean ± population std, as before


class _Recording:
    def __init__(self):
        self.rows, self.tokens = 0, 0

    def start(self, *args, **kwargs):
        pass

    def advance(self, amount=1, **counters):
        self.rows += amount
        self.tokens += counters.get("tokens", 0)

    def stop(self):
        pass


def test_perplexity_progress_counts_the_real_tokens(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from mta.evaluation.datasets import EvalRow
    from mta.evaluation.perplexity import encode_for_scoring, response_perplexity
    from mta.models.tokenizers import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = load_tokenizer(tiny_model_dir)
    texts = [("Say hello.\n", "Hello there, friend."), ("Count:", " one two three four five six"), ("Hi", " ok")]
    rows = [EvalRow(index=i, line=i + 1, prompt=p, references=(r,)) for i, (p, r) in enumerate(texts)]
    reporter = _Recording()
    response_perplexity(model, tokenizer, rows, batch_size=2, reporter=reporter)
    unpadded = sum(
        len(encode_for_scoring(tokenizer, p, r, max_prompt_length=256, max_response_length=256).input_ids)
        for p, r in texts
    )
    assert reporter.rows == 3 and reporter.tokens == unpadded  # padding of the shorter rows not counted


# --------------------------------------------------------------------------- the model card


def _fake_engine(model):
    """What save_final asks of a DeepSpeed engine, for a model that is not partitioned."""
    return SimpleNamespace(module=SimpleNamespace(student=model), zero_optimization_partition_weights=lambda: False)


def test_final_carries_a_model_card_that_the_hub_library_reads(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mta.hashing import json_sha256, read_checksums
    from mta.training.config.catalog import find_recipe
    from mta.training.config.loading import load_recipe
    from mta.training.lifecycle import checkpointing
    from mta.versions import package_versions

    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(find_recipe("gpt2").path, ["train.batch_size=64"])  # student: gpt2, data: Dolly
    out = tmp_path / "out"
    (out / "checkpoints" / "step-30").mkdir(parents=True)
    (out / "checkpoints" / "step-30" / "trainer_state.json").write_text(
        json.dumps({"step": 30, "total_steps": 30, "rng": [], "run_id": "r"})
    )
    records = [
        {"split": "dev", "step": 0, "loss": 9.0},
        {"split": "train", "step": 20, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 10.0},
        {"split": "dev", "step": 20, "loss": 2.5, "loss/base": 2.25, "samples": [{"prompt": "p", "generation": "g"}]},
        {"split": "dev", "step": 40, "loss": 1.0},  # after the saved step: not this card's
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = checkpointing.save_final(_fake_engine(model), AutoTokenizer.from_pretrained(tiny_model_dir), recipe, out)

    card_path = final / "README.md"
    assert "README.md" in read_checksums(final)  # written before the checksum list
    text = card_path.read_text(encoding="utf-8")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["base_model"] == "gpt2"
    assert front["datasets"] == ["databricks/databricks-dolly-15k"] and "mta" in front["tags"]
    recipe_hash = json_sha256(yaml.safe_load((final / "recipe.yaml").read_text()))
    assert f"sha256:{recipe_hash}" in text and "`gpt2`" in text and "`MiniLLM/teacher-gpt2-1.5B`" in text
    assert "| steps | 30 (global batch 64" in text
    assert "## Dev metrics at step 20" in text and "| loss | 2.5000 |" in text and "| loss/base | 2.2500 |" in text
    assert "1.0000" not in text and "samples" not in text
    assert f"| mta | {package_versions(('mta',))['mta']} |" in text
    try:
        from huggingface_hub import ModelCard
    except ImportError:
        return
    card = ModelCard.load(card_path)
    assert card.data.base_model == "gpt2" and card.data.library_name == "transformers"
    assert card.data.datasets == ["databricks/databricks-dolly-15k"]


def test_the_card_of_a_tiny_run_names_no_hub_base_model(tmp_path, monkeypatch):
    from mta.training.config.catalog import find_recipe
    from mta.training.config.loading import load_recipe
    from mta.training.lifecycle.model_card import model_card

    monkeypatch.chdir(tmp_path)
    text = model_card(load_recipe(find_recipe("tiny").path, ["loss.fdd_weight=1"]), step=None, dev=None)
    front = yaml.safe_load(text.split("---\n")[1])
    assert "base_model" not in front and "datasets" not in front and "fdd" in front["tags"]
    assert "a random tiny llama built by mta" in text and "| steps | not recorded" in text
    assert "No dev metrics were recorded" in text


# --------------------------------------------------------------------------- the README's offline commands


def readme_blocks() -> list[tuple[bool, str]]:
    """(slow, code) of every README block marked offline, in order."""
    return [(bool(m.group("slow")), m.group("code")) for m in OFFLINE_BLOCK.finditer(README.read_text("utf-8"))]


def _run_blocks(blocks: list[str], root: Path) -> None:
    """Each block in a bash -e shell, in order, in one empty directory, as a reader would; with a
    home of its own (its ~/.cache) and a Hub that refuses connections, so nothing is downloaded."""
    (root / "home").mkdir()
    work = root / "work"
    work.mkdir()
    bin_dir = root / "bin"  # `mta` is this interpreter's, wherever its console script lies
    bin_dir.mkdir()
    (bin_dir / "mta").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mta_cli.main "$@"\n')
    (bin_dir / "mta").chmod(0o755)
    env = _env(
        HOME=str(root / "home"),
        MTA_CACHE_DIR=None,
        MTA_DATA_DIR=None,
        HF_HOME=None,
        HF_HUB_CACHE=None,
        XDG_CACHE_HOME=None,
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
    )
    for code in blocks:
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{result.stderr[-3000:]}"


def test_the_readme_marks_fast_and_slow_offline_blocks():
    blocks = readme_blocks()
    fast = [code for slow, code in blocks if not slow]
    assert fast and any(slow for slow, _ in blocks)
    assert all("mta " in code for _, code in blocks)


def test_the_readme_fast_offline_blocks_run_as_written(tmp_path):
    _run_blocks([code for slow, code in readme_blocks() if not slow], tmp_path)
    assert (tmp_path / "work" / "tiny.yaml").is_file()  # `mta recipes copy tiny .` ran here


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MTA_TEST_README_SLOW") != "1",
    reason="the README's slow offline blocks take minutes: set MTA_TEST_README_SLOW=1",
)
def test_every_readme_offline_block_runs_as_written(tmp_path):
    _run_blocks([code for _, code in readme_blocks()], tmp_path)
    work = tmp_path / "work"
    assert (work / "runs" / "tiny" / "final" / "README.md").is_file()
    assert (work / "runs" / "tiny-teacher" / "train" / ".mta" / "manifest.json").is_file()
    assert (work / "runs" / "tiny-cached" / "final" / "config.json").is_file()  # trained from the cache
    results = json.loads((work / "runs" / "eval" / "results.json").read_text())
    assert list(results["checkpoints"]) == ["tiny", "tiny-fdd"]
