"""`mta demo`: the whole pipeline on a real instruction model, in one process."""

from __future__ import annotations

from pathlib import Path

import typer

from mta.errors import MtaError
from mta_cli.consoles import stderr_console
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.results import run_demo_command

# The demo's wall times as measured, each with the load average it ran under (the machine is
# shared): the one source of `mta demo --help`, the demo's first line, `make help` and the README,
# which state them word for word (tests/test_demo_output.py).
MEASURED = {
    "quick": "1.2 min measured on an idle machine (load average 0.4 before it; 2-core CPU, torch on both cores, "
    "teacher converted, install excluded)",
    "full": "8.0 min measured on an idle machine (load average 0.4 before it; 2-core CPU, torch on both cores, "
    "teacher converted, install excluded)",
}


def demo(
    quick: bool = typer.Option(
        False,
        "--quick",
        help=f"a plumbing check: 4 steps of 2 rows, 2 rows per set, 1 seed; {MEASURED['quick']}",
    ),
    evidence: bool = typer.Option(
        False,
        "--evidence",
        help="instead: does MTA help DistiLLM? a Dolly-fine-tuned teacher, a 15-layer student, 3 training "
        "seeds a variant, ROUGE-L, teacher and trajectory agreement with bootstrap intervals (under 8 h with "
        "bf16; --plan shows the estimate; mta.demo.evidence)",
    ),
    plan: bool = typer.Option(False, "--plan", help="with --evidence: print the plan and its estimate, run nothing"),
    report: bool = typer.Option(
        False, "--report", help="with --evidence: write the report again from a finished OUT, run nothing"
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", "-o", help="where every stage writes [default: runs/demo, runs/evidence]", show_default=False
    ),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="instruction sets (dolly/, self-inst/, ...); default $MTA_DATA_DIR, else ./data"
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Distill SmolLM2-135M-Instruct into a 10-layer student three ways and compare them.

    Converts the teacher (once, into the model cache), prunes it to 10 layers, annotates Dolly
    rows, trains SFT, skew-reverse-KL and skew-reverse-KL + MTA students from the same start,
    evaluates all five models (ROUGE-L and Dolly-dev perplexity) and writes results.md and
    summary.png. Re-running reuses every finished stage; --quick and full overwrite each other.
    The full demo: FULL_MEASURED.

    --evidence (`make evidence`) answers whether MTA helps DistiLLM under the paper's protocol: the
    teacher fine-tuned on Dolly first, then 6 runs of a 15-layer student with DistiLLM's sampling,
    chosen on Dolly dev ROUGE-L; ROUGE-L on the four sets, teacher agreement and trajectory
    agreement, each with its 95 % interval and detectable difference, in results.md and
    evidence.png. It prints its plan first (a plan over its budget runs nothing); every stage resumes.
    """
    quiet_third_party(verbose)  # the demo draws its own bars
    if evidence:
        _evidence(out_dir or Path("runs/evidence"), data_dir, plan=plan, report=report, quick=quick)
        return
    if plan or report:
        raise MtaError(f"{'--plan' if plan else '--report'} belongs to --evidence; give both")
    out_dir = out_dir or Path("runs/demo")
    from mta.demo.pipeline import run_demo
    from mta.demo.report import table, write_report
    from mta.demo.settings import DemoSettings

    settings = DemoSettings.quick() if quick else DemoSettings.full()

    def run(reporter):
        _use_idle_cores(reporter)
        return run_demo(settings, out_dir, data_dir=data_dir, reporter=reporter)

    run_demo_command(
        f"mta demo ({settings.name}{': a plumbing check, not a result' if quick else ''}; {MEASURED[settings.name]})",
        settings.estimated_seconds(),
        out_dir,
        run,
        write_report,
        table,
    )


def _use_idle_cores(reporter) -> None:
    """torch's threads: the cores other work leaves idle (``mta.distributed.idle_cores``), unless
    OMP_NUM_THREADS says otherwise; ``reporter`` says so when fewer than every core."""
    import os

    import torch

    from mta.distributed import available_cores, idle_cores

    if "OMP_NUM_THREADS" in os.environ:
        return
    threads, cores = idle_cores(), available_cores()
    torch.set_num_threads(threads)
    if threads < cores:
        reporter.message(
            f"torch threads: {threads} of {cores} cores (the others are busy with other work; "
            "OMP_NUM_THREADS=N chooses)"
        )


# The docstring is the --help: it states the measured time from MEASURED, not a copy of it.
demo.__doc__ = (demo.__doc__ or "").replace("FULL_MEASURED", MEASURED["full"])


def _evidence(out_dir: Path, data_dir: Path | None, *, plan: bool, report: bool, quick: bool) -> None:

    from mta.demo.evidence import EvidenceSettings, plan_lines, read_back, run_evidence
    from mta.demo.evidence_report import difference_table, write_report
    from mta_cli.results import print_results

    if quick:
        raise MtaError("--evidence has one size (its plan is fixed before its runs); leave out --quick")
    if report:
        results = read_back(out_dir)
        print_results("mta demo --evidence", *difference_table(results), *write_report(results, out_dir))
        return
    settings = EvidenceSettings.full()
    stderr_console(soft_wrap=True).print("\n".join(plan_lines(settings, out_dir)), markup=False, highlight=False)
    if plan:
        return
    run_demo_command(
        "mta demo --evidence",
        sum(settings.estimated_seconds().values()),
        out_dir,
        lambda reporter: run_evidence(settings, out_dir, data_dir=data_dir, reporter=reporter),
        write_report,
        difference_table,
    )
