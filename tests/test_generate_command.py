"""`mta generate` on tiny random models: each row is the engine's keyed sample, SIGKILL and resume,
refused journals and outputs, bad rows, torchrun, --help."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import EXAMPLES, REPO, torchrun
from mta.errors import MtaError
from mta.files import read_jsonl_lenient
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.models.tiny import build_tiny_model
from mta.models.tokenizers import load_tokenizer
from mta.pairs.generate import PairSettings, PairsPaths, generate_pairs
from mta.reporting import SilentReporter
from mta.scoring import completion_text

# Short prompts (some over the limit on each tokenizer), short responses: quick runs.
FAST = dict(max_new_tokens=8, max_prompt_length=40, batch_size=3)
FAST_ARGS = ["--max-new-tokens", "8", "--max-prompt-length", "40", "--batch-size", "3"]


@pytest.fixture(scope="module")
def teacher_dir(other_tokenizer_dir, tmp_path_factory) -> Path:
    """A second random Llama (d=48, another seed) with the 300-token tokenizer: the tokenizers differ."""
    return build_tiny_model(other_tokenizer_dir, tmp_path_factory.mktemp("teacher"), hidden_size=48, seed=1)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def input_rows(limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit]


def invoke(*args):
    from mta_cli.main import app

    return CliRunner().invoke(app, ["generate", *map(str, args)])


class Counting(SilentReporter):
    """Counts the responses generated (rows advanced), per task description."""

    def __init__(self):
        self.rows = 0
        self.messages: list[str] = []

    def advance(self, amount: int = 1, **counters: float) -> None:
        self.rows += amount

    def message(self, text: str) -> None:
        self.messages.append(text)


class Interrupt(Exception):
    pass


class InterruptAfter(Counting):
    """Raises after ``rows`` responses, as a crash between two batches would stop the run."""

    def __init__(self, rows: int):
        super().__init__()
        self.stop_after = rows

    def advance(self, amount: int = 1, **counters: float) -> None:
        super().advance(amount, **counters)
        if self.rows >= self.stop_after:
            raise Interrupt


def direct(
    model_dir: Path, prompts: list[str], seeds: list[int], params: SamplingParams, max_prompt_length: int
) -> list[str]:
    """What the engine gives for each prompt alone (batch size 1, one call per row)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    generator = HFGenerator(model, tokenizer, params, batch_size=1)
    texts = []
    for prompt, seed in zip(prompts, seeds, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_prompt_length]
        [[completion]] = list(generator.generate([ids], [seed]))
        texts.append(completion_text(tokenizer, completion.token_ids))
    return texts


def test_each_response_is_the_engines_keyed_sample_of_its_row(teacher_dir, tiny_model_dir, tmp_path):
    settings = PairSettings(limit=7, seed=5, temperature=0.9, top_p=0.9, top_k=50, **FAST)
    out = generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, tmp_path / "pairs.jsonl", settings).path
    pairs = read_jsonl(out)
    expected_prompts = [r.get("prompt") or r["instruction"] for r in input_rows(7)]
    assert [p["id"] for p in pairs] == list(range(7))
    assert all(e in p["prompt"] for e, p in zip(expected_prompts, pairs, strict=True))  # the Alpaca prompt of the row
    assert set(pairs[0]) == {"id", "prompt", "chosen", "rejected"}
    prompts = [p["prompt"] for p in pairs]
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_new_tokens=8)
    for side, field, model in (("teacher", "chosen", teacher_dir), ("student", "rejected", tiny_model_dir)):
        seeds = [sampling_seed(5, f"generate/{side}", 0, row) for row in range(7)]
        assert [p[field] for p in pairs] == direct(model, prompts, seeds, params, 40), side
    assert [p["chosen"] for p in pairs] != [p["rejected"] for p in pairs]
    assert not PairsPaths(out).journal_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]  # no journal, no lock left


def test_a_sigkilled_run_resumes_to_the_uninterrupted_file(teacher_dir, tiny_model_dir, tmp_path):
    settings = PairSettings(max_new_tokens=8, max_prompt_length=40, batch_size=1)
    complete = generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, tmp_path / "complete.jsonl", settings).path
    out = tmp_path / "killed" / "pairs.jsonl"
    journal = PairsPaths(out).journal(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "cli"), str(REPO / "src"), env.get("PYTHONPATH", "")])
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mta_cli.main",
            "generate",
            "--teacher",
            str(teacher_dir),
            "--student",
            str(tiny_model_dir),
            "--data",
            str(EXAMPLES),
            "-o",
            str(out),
            "--max-new-tokens",
            "8",
            "--max-prompt-length",
            "40",
            "--batch-size",
            "1",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    try:
        while not read_jsonl_lenient(journal):
            assert process.poll() is None, f"the run ended before it journalled a row: {process.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no journalled row in 120 s"
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not out.exists()
    journalled = {(r["side"], r["id"]) for r in read_jsonl_lenient(journal)}
    assert 0 < len(journalled) < 2 * 36

    reporter = Counting()
    outcome = generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, out, settings, reporter)
    assert read_jsonl(out) == read_jsonl(complete)  # row for row: no duplicates, no gaps
    assert reporter.rows == 2 * 36 - len(journalled)  # what was journalled is not generated again
    assert sum(outcome.resumed.values()) == len(journalled)
    assert any("resuming" in m for m in reporter.messages)
    assert sorted(p.name for p in out.parent.iterdir()) == ["pairs.jsonl"]  # journal and stale lock gone


def test_a_journal_of_other_settings_is_refused_and_its_own_resumes(teacher_dir, tiny_model_dir, tmp_path):
    settings = PairSettings(limit=9, **{**FAST, "batch_size": 1})  # batches of one: resumed bits equal
    out = tmp_path / "pairs.jsonl"
    with pytest.raises(Interrupt):  # a crash after the first teacher batch
        generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, out, settings, InterruptAfter(3))
    assert PairsPaths(out).settings.exists() and len(read_jsonl_lenient(PairsPaths(out).journal(0))) == 3
    for other, changed in (
        (PairSettings(limit=9, seed=7, **FAST), "seed: 42 -> 7"),
        (PairSettings(limit=9, temperature=1.0, **FAST), "temperature: 0.8 -> 1.0"),
    ):
        with pytest.raises(MtaError, match="unfinished run with other settings") as refused:
            generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, out, other)
        assert changed in str(refused.value) and "remove" in str(refused.value) and "another -o" in str(refused.value)
    with pytest.raises(MtaError, match="teacher_fingerprint"):  # teacher and student swapped
        generate_pairs(tiny_model_dir, teacher_dir, EXAMPLES, out, settings)
    result = invoke(
        "--teacher",
        teacher_dir,
        "--student",
        tiny_model_dir,
        "--data",
        EXAMPLES,
        "-o",
        out,
        "--limit",
        9,
        "--seed",
        7,
        *FAST_ARGS,
    )
    assert isinstance(result.exception, MtaError) and "other settings" in str(result.exception)
    assert not out.exists()

    reporter = Counting()
    generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, out, settings, reporter)
    assert reporter.rows == 2 * 9 - 3
    fresh = generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, tmp_path / "fresh.jsonl", settings).path
    assert read_jsonl(out) == read_jsonl(fresh)


def test_an_existing_output_is_kept_unless_overwrite(teacher_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "pairs.jsonl"
    out.write_text("precious\n", encoding="utf-8")
    args = [
        "--teacher",
        teacher_dir,
        "--student",
        tiny_model_dir,
        "--data",
        EXAMPLES,
        "-o",
        out,
        "--limit",
        4,
        *FAST_ARGS,
    ]
    result = invoke(*args)
    assert isinstance(result.exception, MtaError)
    assert "already exists" in str(result.exception) and "--overwrite" in str(result.exception)
    assert out.read_text(encoding="utf-8") == "precious\n"
    result = invoke(*args, "--overwrite")
    assert result.exit_code == 0, result.output
    assert [p["id"] for p in read_jsonl(out)] == [0, 1, 2, 3]
    with pytest.raises(MtaError, match="is a directory"):
        generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, tmp_path, PairSettings(limit=2, **FAST))


def test_a_bad_row_names_its_line_or_is_skipped_and_counted(teacher_dir, tiny_model_dir, tmp_path):
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:6]
    lines.insert(2, '{"instruction": "broken", "output": ')  # line 3: cut JSON
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "pairs.jsonl"
    with pytest.raises(MtaError, match=rf"{data}:3: malformed JSON.*--on-error skip"):
        generate_pairs(teacher_dir, tiny_model_dir, data, out, PairSettings(**FAST))
    assert not out.exists() and not PairsPaths(out).journal_dir.exists()

    result = invoke(
        "--teacher",
        teacher_dir,
        "--student",
        tiny_model_dir,
        "--data",
        data,
        "-o",
        out,
        "--on-error",
        "skip",
        *FAST_ARGS,
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "skipped 1 bad input row(s), e.g." in text and "rows.jsonl:3: malformed JSON" in text
    assert "wrote 6 pairs" in text
    assert [p["id"] for p in read_jsonl(out)] == [0, 1, 3, 4, 5, 6]  # ids are the input rows' positions
    outcome = generate_pairs(
        teacher_dir, tiny_model_dir, data, tmp_path / "again.jsonl", PairSettings(on_error="skip", **FAST)
    )
    assert (outcome.rows, outcome.skipped) == (6, 1) and outcome.skipped_examples[0].startswith(f"{data}:3:")
    assert read_jsonl(outcome.path) == read_jsonl(out)


def test_bad_models_and_options_fail_before_anything_runs(teacher_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "pairs.jsonl"
    with pytest.raises(MtaError, match="does not exist"):
        generate_pairs(tmp_path / "nope", tiny_model_dir, EXAMPLES, out)
    with pytest.raises(MtaError, match="input file not found"):
        generate_pairs(teacher_dir, tiny_model_dir, tmp_path / "nope.jsonl", out)
    with pytest.raises(MtaError, match="top_p"):
        PairSettings(top_p=0)
    with pytest.raises(MtaError, match="unknown dtype"):
        PairSettings(dtype="fp8")
    assert sorted(tmp_path.iterdir()) == []


def test_two_processes_under_torchrun_write_the_one_process_file(teacher_dir, tiny_model_dir, tmp_path):
    # Batches of one, so each row's logits are bit for bit the same however the rows are split.
    args = [
        "--teacher",
        teacher_dir,
        "--student",
        tiny_model_dir,
        "--data",
        EXAMPLES,
        "--limit",
        11,
        *FAST_ARGS,
        "--batch-size",
        1,
    ]
    torchrun(["-m", "mta_cli.main", "generate", *args, "-o", tmp_path / "two" / "pairs.jsonl"])
    settings = PairSettings(limit=11, **{**FAST, "batch_size": 1})
    one = generate_pairs(teacher_dir, tiny_model_dir, EXAMPLES, tmp_path / "one" / "pairs.jsonl", settings)
    assert read_jsonl(tmp_path / "two" / "pairs.jsonl") == read_jsonl(one.path)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["pairs.jsonl"]


def test_help_lists_the_sampling_defaults():
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for default in ("[default: 0.8]", "[default: 0.95]", "[default: 0]", "[default: 256]", "[default: 42]"):
        assert default in text
    assert "chosen" in text and "rejected" in text and "DistiLLM-2" in text
    defaults = PairSettings()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.8, 0.95, 0)
    from mta_cli.commands import generate as cli

    assert (
        cli.TEMPERATURE,
        cli.TOP_P,
        cli.TOP_K,
        cli.MAX_NEW_TOKENS,
        cli.MAX_PROMPT_LENGTH,
        cli.BATCH_SIZE,
        cli.SEED,
    ) == (
        defaults.temperature,
        defaults.top_p,
        defaults.top_k,
        defaults.max_new_tokens,
        defaults.max_prompt_length,
        defaults.batch_size,
        defaults.seed,
    )
