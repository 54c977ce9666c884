"""`mta teacher` and training from its cache (mta.training.teacher_cache): at k = V in fp32 a run
whose teacher's weight files are deleted equals the online run step by step; a cache that does
not match the recipe is refused naming the key; a stage cut short resumes without redoing its
finished chunks; shards merge into the same cache; FDD is refused with the reason."""

from __future__ import annotations

import json
import shutil
import signal

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from fixtures.distill import weights
from fixtures.processes import sigkill_when_it_says, stalling_journal
from mta.errors import MtaError
from mta.losses.teacher_topk import dense_log_probs
from mta.training.config.loading import load_recipe
from mta.training.dry_run import plan_run
from mta.training.lifecycle.metrics import read_metrics
from mta.training.teacher_cache import teacher as stage_module
from mta.training.teacher_cache.compact import id_bits, unpack_ids
from mta.training.teacher_cache.content import teacher_reads
from mta.training.teacher_cache.teacher import run_teacher_stage
from mta.training.trainer import run_distillation
from mta_cli.main import app

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512  # the tiny tokenizer's: k = V keeps the whole distribution
EXACT = {"top_k": VOCAB, "storage": "fp32", "states": "storage"}


def losses(out) -> list[dict]:
    keys = ("loss", "loss/base", "loss/dsa", "loss/hra")
    return [{k: r[k] for k in keys if k in r} | {"split": r["split"]} for r in read_metrics(out / "metrics.jsonl")]


def table(directory) -> list[dict]:
    return pq.read_table(sorted(directory.glob("part-*.parquet"))).sort_by("id").to_pylist()


def states_of(row: dict) -> torch.Tensor:
    """A stored row's hidden states as values: int8 ones times their per-token scales."""
    hidden, scales = torch.tensor(row["hidden"], dtype=torch.float32), torch.tensor(row["hidden_scales"])
    return (hidden.view(len(scales), -1) * scales.unsqueeze(1)).view(-1) if len(scales) else hidden


def assert_same_rows(got: list[dict], expected: list[dict]) -> None:
    """Ids, token counts and positions equal; hidden states (to an 8-bit step) and each position's
    rebuilt teacher distribution to fp16's rounding (other batches pad rows to other widths, which moves the last
    bits, and may swap two near-tied tokens at the k-th place)."""
    assert [row["id"] for row in got] == [row["id"] for row in expected]
    for row, want in zip(got, expected, strict=True):
        for key in ("tokens", "positions"):
            assert row[key] == want[key], (row["id"], key)
        got_states, want_states = (states_of(r) for r in (row, want))
        step = max(max(row["hidden_scales"], default=0.0), max(want["hidden_scales"], default=0.0))  # int8: a step
        torch.testing.assert_close(got_states, want_states, rtol=2e-3, atol=2e-3 + step)
        k = len(row["top_log_probs"]) // max(len(row["positions"]), 1)
        rebuilt = [
            dense_log_probs(
                torch.from_numpy(unpack_ids(r["top_ids"], id_bits(VOCAB), len(r["top_log_probs"]))).view(-1, k),
                torch.tensor(r["top_log_probs"]).view(-1, k),
                torch.tensor(r["tail"]),
                VOCAB,
            ).exp()
            for r in (row, want)
        ]
        torch.testing.assert_close(rebuilt[0], rebuilt[1], rtol=0, atol=1e-4)


def test_at_full_k_a_run_without_the_teachers_weights_equals_the_online_run(tmp_path, tiny_run_recipe, teacher_dir):
    cache = tmp_path / "cache"
    recipe = tiny_run_recipe(tmp_path / "online", teacher_cache={"dir": str(cache), **EXACT})
    result = CliRunner().invoke(app, ["teacher", "--recipe", str(recipe), "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    assert (cache / "train" / ".mta" / "manifest.json").is_file() and (
        cache / "dev" / ".mta" / "manifest.json"
    ).is_file()
    online = run_distillation(load_recipe(recipe, ["teacher_cache.dir=null"]))

    weightless = tmp_path / "teacher-without-weights"
    shutil.copytree(teacher_dir, weightless)
    (weightless / "model.safetensors").unlink()
    # Exact states serve a recipe asking for 8 bits: the cached run reads them as stored.
    overrides = [f"output_dir={tmp_path / 'cached'}", f"teacher.path={weightless}", "teacher_cache.states=int8_token"]
    cached = run_distillation(load_recipe(recipe, overrides))

    expected, got = losses(tmp_path / "online"), losses(tmp_path / "cached")
    assert [r["split"] for r in got] == [r["split"] for r in expected] and "dev" in [r["split"] for r in got]
    for step_expected, step_got in zip(expected, got, strict=True):
        for key, value in step_expected.items():
            if key != "split":
                assert step_got[key] == pytest.approx(value, rel=2e-4, abs=1e-6), (key, step_expected, step_got)
    # Adam magnifies float noise where a gradient is ~0: the online fused loss reads the teacher's
    # head, the cached one its top k rebuilt (one of 16,384 entries 1.2e-4 apart).
    for name, tensor in weights(online).items():
        torch.testing.assert_close(weights(cached)[name], tensor, rtol=1e-3, atol=3e-4)


def test_a_cache_that_does_not_match_the_recipe_is_refused_by_key(tmp_path, tiny_run_recipe):
    cache = tmp_path / "cache"
    recipe = tiny_run_recipe(tmp_path / "out", teacher_cache={"dir": str(cache), "top_k": 8}, data={"dev": None})
    run_teacher_stage(load_recipe(recipe))
    for override, key in (
        ("teacher_cache.top_k=16", "top_k"),
        ("loss.temperature=2.0", "temperature"),
        ("loss.layers=[[1, 1, word], [4, 4, phrase]]", "layers"),
        ("teacher_cache.storage=fp32", "storage"),
        ("teacher_cache.states=storage", "states"),  # 8-bit states do not serve a recipe asking for exact ones
    ):
        with pytest.raises(MtaError, match=rf"was built for another run.*\b{key}\b"):
            run_distillation(load_recipe(recipe, [override, f"output_dir={tmp_path / key}"]))
    # A run that reads less of it (the base alone: logits, no layers) trains from the same cache.
    base = load_recipe(
        recipe, ["loss.dsa_weight=0", "loss.hra_weight=0", "train.max_steps=2", f"output_dir={tmp_path / 'b'}"]
    )
    assert (run_distillation(base) / "config.json").is_file()


KILLED_STAGE = (
    stalling_journal(2)
    + """
from pathlib import Path
from mta.training.config.loading import load_recipe
from mta.training.teacher_cache import teacher as build

build.CHUNK_BYTES = 1  # one batch a chunk
build.run_teacher_stage(load_recipe(sys.argv[1]), out_dir=Path(sys.argv[2]), batch_size=2)
"""
)


def test_the_stage_resumes_after_sigkill_without_redoing_finished_chunks(tmp_path, tiny_run_recipe, monkeypatch):
    path = tiny_run_recipe(tmp_path / "out", teacher_cache={"dir": str(tmp_path / "whole")})
    recipe = load_recipe(path)
    run_teacher_stage(recipe, batch_size=2)
    assert sigkill_when_it_says(KILLED_STAGE, [path, tmp_path / "cut"], "journalled") == -signal.SIGKILL
    assert not (tmp_path / "cut" / "train" / ".mta" / "manifest.json").exists()
    monkeypatch.setattr(stage_module, "CHUNK_BYTES", 1)  # the killed run's plan
    outcomes = run_teacher_stage(recipe, out_dir=tmp_path / "cut", batch_size=2)
    train = next(outcome for outcome in outcomes if outcome.split == "train")
    assert train.resumed_rows == 4 and train.rows == train.manifest["rows"]["written"] - 4
    assert_same_rows(table(tmp_path / "cut" / "train"), table(tmp_path / "whole" / "train"))
    assert not (tmp_path / "cut" / "train" / ".mta" / "work").exists()
    assert all(outcome.reused for outcome in run_teacher_stage(recipe, out_dir=tmp_path / "cut", batch_size=2))


def test_shards_merge_into_the_same_cache(tmp_path, tiny_run_recipe):
    recipe = load_recipe(
        tiny_run_recipe(tmp_path / "out", teacher_cache={"dir": str(tmp_path / "one")}, data={"dev": None})
    )
    run_teacher_stage(recipe)
    first = run_teacher_stage(recipe, out_dir=tmp_path / "two", shard=(0, 2))
    assert first[0].manifest is None
    second = run_teacher_stage(recipe, out_dir=tmp_path / "two", shard=(1, 2))
    assert second[0].manifest is not None and second[0].manifest["num_shards"] == 2
    assert_same_rows(table(tmp_path / "two" / "train"), table(tmp_path / "one" / "train"))


def test_fdd_and_what_the_cache_does_not_hold_are_refused_with_the_reason(tmp_path, tiny_run_recipe):
    cache = {"dir": str(tmp_path / "cache")}
    with pytest.raises(MtaError, match=r"loss\.fdd_weight.*FDD needs the online teacher"):
        load_recipe(tiny_run_recipe(tmp_path / "a", teacher_cache=cache, loss={"fdd_weight": 1.0}))
    with pytest.raises(MtaError, match=r"no teacher"):
        load_recipe(
            tiny_run_recipe(tmp_path / "b", teacher_cache=cache, loss={"base": "ce", "dsa_weight": 0, "hra_weight": 0}),
            ["teacher=null"],
        )


def test_the_dry_run_estimates_the_cache_size_before_it_exists(tmp_path, tiny_run_recipe):
    recipe = load_recipe(
        tiny_run_recipe(tmp_path / "out", teacher_cache={"dir": str(tmp_path / "c")}, data={"dev": None})
    )
    notes = [note for note in plan_run(recipe).notes if note.startswith("teacher cache")]
    assert "never loaded" in notes[-1] and "k = 512" in notes[0] and "hidden states over" in notes[0], notes
    assert "logits per response position" in notes[0] and "states per token" in notes[0], notes
    run_teacher_stage(recipe)
    stored = sum(path.stat().st_size for path in (tmp_path / "c" / "train").glob("part-*.parquet"))
    manifest = json.loads((tmp_path / "c" / "train" / ".mta" / "manifest.json").read_text())
    assert manifest["layers"] == list(teacher_reads(recipe, 4, 4).layers) and manifest["top_k"] == VOCAB  # min(1024, V)
    assert f"over {manifest['rows']['written']} rows" in notes[0]
    size = notes[0]  # "teacher cache, data.train (...): X KB logits + Y MB hidden states over 34 rows (...)"
    total = _parse_bytes(size.split("logits + ")[0].rsplit(": ", 1)[1]) + _parse_bytes(
        size.split("logits + ")[1].split(" hidden")[0]
    )
    assert 1.0 <= total / stored < 2.0, (total, stored)  # an upper bound: Parquet's dictionaries store less


def _parse_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def test_under_torchrun_each_rank_computes_its_share_into_one_cache(tmp_path, tiny_run_recipe):
    from conftest import torchrun

    path = tiny_run_recipe(tmp_path / "out", teacher_cache={"dir": str(tmp_path / "one")}, data={"dev": None})
    run_teacher_stage(load_recipe(path))
    torchrun(["-m", "mta_cli.main", "teacher", "--recipe", path, "-o", tmp_path / "two"])
    manifest = json.loads((tmp_path / "two" / "train" / ".mta" / "manifest.json").read_text())
    assert manifest["num_shards"] == 2 and len(manifest["parts"]) == 2
    assert_same_rows(table(tmp_path / "two" / "train"), table(tmp_path / "one" / "train"))
