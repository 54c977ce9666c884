"""Logs a batch system can read: `mta distill` with its output piped (not a terminal) prints one
plain line per log step whose numbers are metrics.jsonl's, none of the other libraries' bars or
warnings unless --verbose, and Ctrl-C names the last checkpoint and a command that resumes.
The plain reporter's row progress, the MTA_PROGRESS choice and the noise filter, in process."""

from __future__ import annotations

import io
import logging
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from rich.console import Console

from conftest import subprocess_env
from mta.errors import MtaError
from mta.training.lifecycle.checkpointing import latest_checkpoint
from mta.training.lifecycle.metrics import read_metrics
from mta_cli import quiet
from mta_cli.reporting import PlainReporter, RichReporter, make_reporter

pytestmark = pytest.mark.usefixtures("one_thread")

NOISE = ("Writing model shards", "Loading weights", "Setting accelerator")
BARS = ("\r", "━", "█")
CLOCK = r"\d+:\d\d:\d\d"


def command_env() -> dict[str, str]:
    env = subprocess_env()
    for name in ("MTA_PROGRESS", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(name, None)  # the defaults under test, whatever this shell exports
    return env


PAUSED = b"first checkpoint written: waiting"
# `mta ARGS` whose run waits on its stdin once its first checkpoint is written (the piped Ctrl-C test).
PAUSE_AFTER_FIRST_CHECKPOINT = f"""
import sys
from mta.training.lifecycle import checkpointing
save = checkpointing.save_checkpoint
def save_then_wait(*args, **kwargs):
    path = save(*args, **kwargs)
    if not getattr(save_then_wait, "done", False):
        save_then_wait.done = True
        print({PAUSED.decode()!r}, flush=True)
        sys.stdin.readline()
    return path
checkpointing.save_checkpoint = save_then_wait
from mta_cli.main import main
sys.argv = ["mta", *sys.argv[1:]]
main()
"""


def mta(*args: str) -> list[str]:
    """``mta ARGS`` as this interpreter runs it (the console script may not be on PATH)."""
    return [sys.executable, "-m", "mta_cli.main", *args]


def run_piped(argv: list[str]) -> tuple[int, str]:
    """Exit code and stdout + stderr, as bytes decoded: no newline translation hides a ``\\r``."""
    done = subprocess.run(argv, env=command_env(), capture_output=True, timeout=300)
    return done.returncode, (done.stdout + done.stderr).decode()


def train_lines(output: str) -> dict[int, dict[str, str]]:
    """The plain train lines, ``step -> {field: text}``: ``distill: step 3/8 · loss 1.2 · base ...``."""
    found = {}
    for line in output.splitlines():
        match = re.fullmatch(r"distill: step (\d+)/(\d+) · (.*)", line)
        if not match:
            continue
        fields = {"total": match.group(2)}
        for part in match.group(3).split(" · "):
            if part.endswith(" tok/s"):
                fields["tokens_per_s"] = part[: -len(" tok/s")]
            else:
                name, value = part.split(" ", 1)
                fields[name] = value
        step = int(match.group(1))
        assert step not in found, f"step {step} printed twice"
        found[step] = fields
    return found


def assert_lines_are_the_records(lines: dict[int, dict[str, str]], records: list[dict], total: int) -> None:
    assert sorted(lines) == [r["step"] for r in records]
    for record in records:
        fields = lines[record["step"]]
        assert int(fields["total"]) == total
        assert float(fields["loss"]) == pytest.approx(record["loss"], rel=5e-4)  # 4 significant digits
        components = {key[5:]: value for key, value in record.items() if key.startswith("loss/")}
        assert set(components) == {"base", "dsa", "hra"}
        for name, value in components.items():
            assert float(fields[name]) == pytest.approx(value, rel=5e-4), name
        assert float(fields["lr"]) == pytest.approx(record["lr"], rel=5e-3)
        assert float(fields["grad_norm"]) == pytest.approx(record["grad_norm"], rel=5e-4)
        assert float(fields["tokens_per_s"]) == pytest.approx(record["tokens_per_s"], abs=0.5)
        assert re.fullmatch(CLOCK, fields["elapsed"]) and re.fullmatch(CLOCK + "|\\?", fields["ETA"])
    if total in lines:
        assert lines[total]["ETA"] == "0:00:00"


def assert_quiet(output: str) -> None:
    for noise in NOISE + BARS:
        assert noise not in output, f"{noise!r} in the log:\n{output[-3000:]}"
    assert "\n\n" not in output.strip("\n"), "a blank line in the log"


@pytest.mark.slow
def test_piped_distill_prints_plain_lines_ctrl_c_prints_a_command_that_resumes_verbose_the_noise(
    tmp_path, tiny_run_recipe
):
    out = tmp_path / "run"
    recipe = tiny_run_recipe(
        out,
        train={
            "max_steps": 8,
            "log_interval": 2,
            "save_interval": 2,
            "num_sample_generations": 1,
            "sample_max_new_tokens": 3,
        },
    )
    overrides = ["seed=5", "train.lr=4e-3"]
    # The eight steps take about a second, so the run waits after its first checkpoint (on its
    # stdin) until the Ctrl-C has been sent, rather than being raced by a poll for it.
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AFTER_FIRST_CHECKPOINT, "distill", "--recipe", str(recipe), *overrides],
        env=command_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # Ctrl-C as a terminal sends it, whatever this suite inherited: a shell's background job
        # (`make test &`) ignores SIGINT, and so would the run, so Python's KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    chunks: list[bytes] = []
    paused = threading.Event()

    def read() -> None:  # line by line, so that the pause is seen; a full pipe would stall the run
        for line in process.stdout:
            if line.strip() == PAUSED:
                paused.set()
            else:
                chunks.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert paused.wait(timeout=300), b"".join(chunks).decode(errors="replace")[-3000:]
        assert latest_checkpoint(out) is not None
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)  # the signal is handled before the run goes on
        try:  # a run that stops at the signal at once no longer reads
            process.stdin.write(b"go on\n")
            process.stdin.close()
        except BrokenPipeError:
            pass
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join()
    output = b"".join(chunks).decode()
    assert process.returncode == 130, output[-3000:]
    assert not (out / "final").exists(), "the run ended before Ctrl-C"
    assert_quiet(output)
    assert "Traceback" not in output and "Aborted" not in output

    # One line: where the newest complete checkpoint is, and the command that continues.
    checkpoint = latest_checkpoint(out)
    hints = [line for line in output.splitlines() if line.startswith("interrupted: ")]
    assert len(hints) == 1, output[-3000:]
    step = int(checkpoint.name.split("-")[1])
    where, command = hints[0].split("; resume with: ")
    assert where == f"interrupted: last complete checkpoint {checkpoint} (step {step})"
    assert shlex.split(command) == ["mta", "distill", "--recipe", str(recipe), *overrides, "--resume", "auto"]

    # The lines printed before Ctrl-C are the train records (a signal between writing a record
    # and printing it may leave the last one unprinted).
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    before = train_lines(output)
    assert before and len(train) - len(before) in (0, 1)
    assert_lines_are_the_records(before, train[: len(before)], total=8)
    dev = [line for line in output.splitlines() if line.startswith("dev @ step 0: loss ")]
    assert len(dev) == 1 and output.splitlines()[output.splitlines().index(dev[0]) + 1].startswith("  '")

    # The printed command continues from that checkpoint to the end; with --verbose added (it
    # changes only what the other libraries print) their bars and warnings are back, and our
    # lines are still whole and still the records.
    code, log = run_piped(mta(*shlex.split(command)[1:], "--verbose"))
    assert code == 0, log[-3000:]
    assert f"resumed from {checkpoint} at step {step}" in log
    assert "Writing model shards" in log and "Loading weights" in log and "\r" in log
    if not torch.cuda.is_available():  # DeepSpeed says so only when it finds no GPU
        assert "Setting accelerator to CPU" in log
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert_lines_are_the_records(train_lines(log), [r for r in train if r["step"] > step], total=8)
    assert (out / "final" / "model.safetensors").exists()
    assert f"done: {out / 'final'}" in log


def test_plain_row_progress_every_ten_percent_or_thirty_seconds_with_rate_and_eta():
    now = [100.0]
    stream = io.StringIO()
    reporter = PlainReporter(Console(file=stream), clock=lambda: now[0])
    with reporter:
        reporter.message("reused nothing\n\nsecond line")
        reporter.start("annotate rows.jsonl", 200, unit="rows")
        for _ in range(40):  # 1 row/s: 20 % after 40 s, one line per 10 %
            now[0] += 1.0
            reporter.advance(1, tokens=10)
        reporter.start("slow set", 1000, completed=100, unit="rows")  # 100 done before (resumed)
        for _ in range(3):  # 1 row per 20 s: under 10 %, a line every 30 s
            now[0] += 20.0
            reporter.advance(1)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "reused nothing",
        "second line",
        "annotate rows.jsonl: 0/200 rows",
        "annotate rows.jsonl: 20/200 rows (10%) · 1.00 rows/s · 10 tok/s · elapsed 0:00:20 · ETA 0:03:00",
        "annotate rows.jsonl: 40/200 rows (20%) · 1.00 rows/s · 10 tok/s · elapsed 0:00:40 · ETA 0:02:40",
        "slow set: 100/1000 rows",
        "slow set: 102/1000 rows (10%) · 0.05 rows/s · elapsed 0:00:40 · ETA 4:59:20",
        "slow set: 103/1000 rows (10%) · 0.05 rows/s · elapsed 0:01:00 · ETA 4:59:00",  # at stop
    ]


def test_plain_train_and_dev_records_and_generation_fields():
    now = [0.0]
    stream = io.StringIO()
    reporter = PlainReporter(Console(file=stream), clock=lambda: now[0])
    reporter.start("distill", 10, completed=4, unit="steps")
    reporter.record(
        {
            "split": "dev",
            "step": 4,
            "loss": 2.0,
            "loss/base": 2.0,
            "off_policy/dev_ce": 1.5,
            "samples": [{"prompt": "p" * 70, "generation": "g\nh"}],
        }
    )
    for _ in range(2):
        now[0] += 3.0
        reporter.advance(1)
    reporter.record(
        {
            "split": "train",
            "step": 6,
            "loss": 1.23456,
            "loss/base": 1.0,
            "loss/dsa": 0.117,
            "loss/hra": 1.234567e-06,
            "lr": 1e-4,
            "grad_norm": 0.8312345,
            "tokens_per_s": 99.6,
            "off_policy/gold": 1,
            "off_policy/generated": 2,
            "off_policy/buffer": 0,
            "off_policy/threshold": 0.25,
        }
    )
    reporter.stop()
    assert stream.getvalue().splitlines() == [
        "distill: 4/10 steps",
        "dev @ step 4: loss 2 · base 2 · dev_ce 1.5",
        f"  {'p' * 70!r} → 'g\\nh'",  # the prompt from its start (issue 50), whole up to 240 characters
        "distill: step 6/10 · loss 1.235 · base 1 · dsa 0.117 · hra 1.235e-06 · lr 1.00e-04 · grad_norm 0.8312"
        " · 100 tok/s"
        " · τ 0.25 · gold 1 / generated 2 / buffer 0 · elapsed 0:00:06 · ETA 0:00:12",
    ]


def test_metrics_print_to_four_significant_digits_so_a_small_term_never_reads_zero():
    from mta_cli.reporting import loss_summary, significant, step_summary

    # tiny-embed's LASD term is 1e-6 to 2e-5: four fixed decimals printed it as 0.0000.
    record = {
        "split": "train",
        "step": 4,
        "loss": 0.3375,
        "loss/simcse": 2.302585,
        "loss/tamd": 0.44691,
        "loss/lasd": 1.7e-05,
        "lr": 1e-3,
        "grad_norm": None,  # DeepSpeed reported none
        "tokens_per_s": 1234.4,
    }
    assert loss_summary(record) == "loss 0.3375 · simcse 2.303 · tamd 0.4469 · lasd 1.7e-05"
    assert step_summary(record) == loss_summary(record) + " · lr 1.00e-03 · grad_norm - · 1234 tok/s"
    assert [significant(value) for value in (1234.5678, 12345.6, 0.0001234, 0.0, 3, None)] == [
        "1235",
        "1.235e+04",
        "0.0001234",
        "0",
        "3",
        "-",
    ]


def test_the_console_decides_unless_mta_progress_says(monkeypatch):
    monkeypatch.delenv("MTA_PROGRESS", raising=False)
    assert isinstance(make_reporter(Console(file=io.StringIO())), PlainReporter)
    assert isinstance(make_reporter(Console(file=io.StringIO(), force_terminal=True)), RichReporter)
    monkeypatch.setenv("MTA_PROGRESS", "plain")
    assert isinstance(make_reporter(Console(file=io.StringIO(), force_terminal=True)), PlainReporter)
    monkeypatch.setenv("MTA_PROGRESS", "rich")
    assert isinstance(make_reporter(Console(file=io.StringIO())), RichReporter)
    monkeypatch.setenv("MTA_PROGRESS", "bars")
    with pytest.raises(MtaError, match="MTA_PROGRESS='bars': give one of auto, rich, plain"):
        make_reporter(Console(file=io.StringIO()))


def test_quiet_hides_other_libraries_but_not_mta_and_verbose_undoes_it(capsys):
    from transformers.utils import logging as transformers_logging

    def emit() -> None:
        logging.getLogger("DeepSpeed").warning("ds warning")
        logging.getLogger("DeepSpeed").error("ds error")
        logging.getLogger("mta.training.x").warning("mta warning")
        exec(
            compile("import warnings; warnings.warn('third-party warning', FutureWarning)", "lib.py", "exec"),
            {"__name__": "somelib.module"},
        )
        exec(
            compile("import warnings; warnings.warn('mta own warning', UserWarning)", "mta.py", "exec"),
            {"__name__": "mta.training.y"},
        )

    handler = logging.StreamHandler(sys.stderr)  # what DeepSpeed installs on its logger (and a CLI on mta's)
    loggers = [logging.getLogger("DeepSpeed"), logging.getLogger("mta")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.quiet_third_party(verbose=False)
            assert not transformers_logging.is_progress_bar_enabled()
            emit()
            hidden = capsys.readouterr().err + "".join(str(w.message) for w in caught)
            caught.clear()
            quiet.quiet_third_party(verbose=True)
            assert transformers_logging.is_progress_bar_enabled()
            emit()
            shown = capsys.readouterr().err + "".join(str(w.message) for w in caught)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
            logger.propagate = True
    assert "ds warning" not in hidden and "third-party warning" not in hidden
    assert "ds error" in hidden and "mta warning" in hidden and "mta own warning" in hidden
    for text in ("ds warning", "third-party warning", "ds error", "mta warning", "mta own warning"):
        assert text in shown
