"""The GPU step benchmark's --smoke mode: the paper's three bases, alone and with MTA, through
the real objective in a DeepSpeed ZeRO-1 engine, at tiny widths on this CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_paper_shapes_benchmark_runs_every_part_in_smoke_mode(tmp_path):
    out = tmp_path / "paper_shapes.json"
    env = subprocess_env()
    result = subprocess.run(
        [sys.executable, "bench/paper_shapes.py", "--smoke", "--budget-s", "0", "--output", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["setup"]["smoke"] is True and payload["setup"]["zero_stage"] == 1
    results = payload["results"]
    assert sorted(results) == ["distillm", "distillm2", "fdd", "logits"]
    logits = results.pop("logits")  # issue 52's shapes: the whole logits vs the fused head + loss
    assert sorted(logits["variants"]) == ["fkl_fused", "fkl_materialized", "srkl_fused", "srkl_materialized"]
    for base in ("srkl", "fkl"):
        assert logits[f"{base}_time_ratio_fused_vs_materialized"] == pytest.approx(
            logits["variants"][f"{base}_fused"]["seconds_per_step_median"]
            / logits["variants"][f"{base}_materialized"]["seconds_per_step_median"]
        )
    for part, result in results.items():
        assert result["rounds"] >= 3
        cached = [] if part == "fdd" else [f"{part}_mta_cached"]  # FDD needs the online teacher
        assert sorted(result["variants"]) == sorted([part, f"{part}_mta", *cached])
        for name, variant in result["variants"].items():
            assert len(variant["seconds_per_step"]) == result["rounds"]
            assert variant["seconds_per_step_median"] > 0 and variant["tokens_per_s"] > 0
            # Model FLOPs: 6·N·tokens of the student (GPT-2 ties its embedding, so every weight is
            # in a product) + 2·N·tokens of the teacher's whole forward, + the projectors with MTA.
            tokens = result["tokens_per_step"]
            teacher = 0 if name.endswith("_cached") else 2 * result["teacher_parameters"]  # no teacher forward
            expected = (6 * result["student_parameters"] + teacher) * tokens
            assert variant["model_flops_per_step"] >= expected
            assert variant["mfu"] is None and variant["peak_memory_gib"] is None  # a CPU
        expected = (6 * result["student_parameters"] + 2 * result["teacher_parameters"]) * tokens
        assert result["variants"][part]["model_flops_per_step"] == expected  # no projector: exact
        if cached:
            assert result["ratio_mta_cached_to_mta"] == pytest.approx(
                result["variants"][cached[0]]["seconds_per_step_median"]
                / result["variants"][f"{part}_mta"]["seconds_per_step_median"]
            )
        assert result["ratio_mta_to_base"] == pytest.approx(
            result["variants"][f"{part}_mta"]["seconds_per_step_median"]
            / result["variants"][part]["seconds_per_step_median"]
        )
