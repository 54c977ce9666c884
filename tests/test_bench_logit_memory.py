"""bench/logit_memory.py --quick: every variant in its own process at tiny shapes, and a JSON whose
ratios are its variants' medians (the full bench is run on a quiet machine, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_logit_memory_benchmark_runs_end_to_end_on_tiny_shapes(tmp_path):
    out = tmp_path / "logit_memory.json"
    result = subprocess.run(
        [sys.executable, "bench/logit_memory.py", "--quick", "--output", str(out)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["setup"]["quick"] is True and payload["setup"]["chunk_size"] == 128
    assert str(REPO) not in out.read_text()  # no machine paths
    losses = payload["losses"]
    assert sorted(losses) == ["fkl", "srkl"]
    for loss in losses.values():
        fused, whole = loss["variants"]["fused"], loss["variants"]["materialized"]
        for variant in (fused, whole):
            assert variant["peak_rss"] >= variant["rss_after_load"] > 0 and variant["step_cpu_seconds"] > 0
        assert loss["peak_ratio_fused_vs_materialized"] == pytest.approx(fused["peak_rss"] / whole["peak_rss"])
        assert loss["time_ratio_fused_vs_materialized"] == pytest.approx(
            fused["step_cpu_seconds"] / whole["step_cpu_seconds"]
        )
        assert fused["dry_run_estimate_error"] == pytest.approx(
            abs(fused["dry_run_estimate"] - fused["step_bytes"]) / max(fused["step_bytes"], 1)
        )
        assert loss["dry_run_estimate_error"] == fused["dry_run_estimate_error"]
    for key in ("peak_ratio_fused_vs_materialized", "time_ratio_fused_vs_materialized", "dry_run_estimate_error"):
        assert payload[key] == max(loss[key] for loss in losses.values())
