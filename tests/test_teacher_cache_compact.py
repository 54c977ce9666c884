"""The teacher cache in fewer bytes (mta.training.teacher_cache.compact, teacher_cache.logits:
sampled, teacher_cache.states): ids packed in the fewest bits over a vocabulary beyond 2**17;
8-bit states within half a quantisation step; a run trains from a sampled cache with the
teacher's weights deleted and its loss equals the online run's within the estimator's measured
spread; the manifest counts the bytes of each part; a version-1 cache still reads."""

from __future__ import annotations

import json
import shutil
import statistics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mta.errors import MtaError
from mta.generation.sampling import keyed_uniforms
from mta.hashing import file_sha256
from mta.losses.kd import build_base_loss
from mta.losses.teacher_sampled import SampledTeacher, draw_tail_samples
from mta.reporting import SilentReporter
from mta.training.config.loading import load_recipe
from mta.training.teacher_cache.compact import (
    dequantize_states,
    id_bits,
    pack_ids,
    packed_bytes,
    quantize_states,
    unpack_ids,
)
from mta.training.teacher_cache.read import TeacherCache
from mta.training.teacher_cache.teacher import run_teacher_stage
from mta.training.trainer import Trainer, build_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("vocab", "bits"), [(131_072, 17), (151_936, 18), (49_152, 16), (512, 9)])
def test_ids_pack_into_the_fewest_bits_the_vocabulary_allows(vocab, bits):
    assert id_bits(vocab) == bits
    rng = np.random.default_rng(vocab)
    ids = np.concatenate([[0, vocab - 1, 2**16, 2**16 - 1], rng.integers(0, vocab, 997)]) % vocab
    packed = pack_ids(ids, bits)
    assert len(packed) == packed_bytes(ids.size, bits) == -(-ids.size * bits // 8)
    np.testing.assert_array_equal(unpack_ids(packed, bits, ids.size), ids)
    # An id beyond the bits is refused, never wrapped into another token.
    with pytest.raises(MtaError, match="does not fit"):
        pack_ids(np.array([2**bits]), bits)


def test_8_bit_states_round_trip_within_half_a_step_of_their_scale():
    states = torch.randn(2, 40, 24, generator=torch.Generator().manual_seed(0))
    states[:, :, 3] *= 60  # an outlier channel, as LLMs have
    states[1, 7] = 0  # an all-zero token: scale 0, stored exactly
    for mode, over in (("int8_token", 2), ("int8_channel", 1)):
        values, scales = quantize_states(states, mode)
        assert values.dtype == torch.int8
        back = dequantize_states(values, scales, mode)
        half_step = states.abs().amax(dim=over, keepdim=True) / 254
        assert ((back - states).abs() <= half_step * (1 + 1e-5) + 1e-7).all(), mode
        # The bound trips on a quantiser that truncates instead of rounding.
        truncated = (states / (scales.unsqueeze(over).clamp(min=1e-30))).trunc() * scales.unsqueeze(over)
        assert not ((truncated - states).abs() <= half_step * (1 + 1e-5) + 1e-7).all(), mode
    # Per channel keeps the ordinary channels precise beside the outlier; per token does not.
    errors = {
        mode: (dequantize_states(*quantize_states(states, mode), mode) - states)[..., :3].abs().mean().item()
        for mode in ("int8_token", "int8_channel")
    }
    assert errors["int8_channel"] < errors["int8_token"] / 10, errors


SAMPLED = {"logits": "sampled", "top_k": 32, "samples": 255, "storage": "fp32", "states": "storage", "seed": 5}


def sampled_batch(batch, logits, seed, spec, vocab) -> SampledTeacher:
    """What a sampled cache with ``seed`` gives for ``batch``: the stage's draws from the online
    teacher's ``logits``, laid out at the batch's positions (a second path to TeacherCache's)."""
    predicts = batch.teacher.labels[:, 1:] != -100
    rows, positions = predicts.nonzero(as_tuple=True)
    uniforms = keyed_uniforms(seed, "check", [0], [rows.numel()], spec["samples"])
    drawn = draw_tail_samples(logits[rows, positions], uniforms, top_k=spec["top_k"], temperature=1.0)
    entries = SampledTeacher.from_samples(drawn, vocab)
    shape = (*logits.shape[:2], entries.ids.shape[1])
    ids, log_probs, weights = torch.zeros(shape, dtype=torch.long), torch.full(shape, -1e4), torch.zeros(shape)
    ids[rows, positions], log_probs[rows, positions], weights[rows, positions] = (
        entries.ids,
        entries.log_probs,
        entries.weights,
    )
    rest, log_mean = torch.full((2, *shape[:2]), -1e4)
    rest[rows, positions], log_mean[rows, positions] = entries.rest, entries.rest_log_mean
    return SampledTeacher(ids, log_probs, weights, vocab, rest, log_mean)


def test_a_run_trains_from_a_sampled_cache_without_the_teachers_weights_like_the_online_run(
    tmp_path, tiny_run_recipe, teacher_dir
):
    cache = tmp_path / "cache"
    recipe_path = tiny_run_recipe(
        tmp_path / "online",
        teacher_cache={"dir": str(cache), **SAMPLED},
        loss={"base": "fkl"},
        data={"dev": None},
        train={"loss_reduction": "micro_batch"},  # a step's loss: the mean of its micro batches' (as `spread`)
    )
    run_teacher_stage(load_recipe(recipe_path))
    manifest = json.loads((cache / "train" / ".mta" / "manifest.json").read_text())
    on_disk = sum(path.stat().st_size for path in (cache / "train").glob("part-*.parquet"))
    assert manifest["teacher_cache_version"] == 3 and manifest["sampling"] == {"samples": 255, "seed": 5}
    assert sum(manifest["bytes"].values()) == on_disk and manifest["bytes"]["logits"] > 0
    # Every part in zstd: it stores 8-bit states in about 0.6 of their bytes, under half of fp16 states (the bench).
    metadata = pq.ParquetFile(next((cache / "train").glob("part-*.parquet"))).metadata
    assert {metadata.row_group(0).column(i).compression for i in range(metadata.num_columns)} == {"ZSTD"}
    assert manifest["tokens"]["teacher"] > manifest["tokens"]["responses"] > 0

    weightless = tmp_path / "teacher-without-weights"
    shutil.copytree(teacher_dir, weightless)
    (weightless / "model.safetensors").unlink()
    online = build_run(load_recipe(recipe_path, ["teacher_cache.dir=null"]), SilentReporter())
    cached = build_run(
        load_recipe(recipe_path, [f"output_dir={tmp_path / 'cached'}", f"teacher.path={weightless}"]), SilentReporter()
    )
    assert cached.teacher is None  # generation off: the cached run never loads the teacher
    trainers = {"online": Trainer(online, SilentReporter()), "cached": Trainer(cached, SilentReporter())}

    # At every step, the spread of the cached run's base loss over the cache's draws, measured:
    # 12 seeds' draws from the online teacher at the cached run's student, each micro batch's
    # loss, averaged as a step does; and the exact loss there, with the online teacher's logits.
    vocab = len(online.tokenizer)
    loss = build_base_loss("fkl", vocab_size=vocab)

    def spread(step: int) -> tuple[float, float]:
        exact, variances = [], []
        for batch in trainers["cached"].micro_batches(step):
            with torch.no_grad():
                # The teacher model's whole logits (the run's own teacher gives the fused loss its head).
                teacher = online.teacher.model(
                    input_ids=batch.teacher.input_ids, attention_mask=batch.teacher.attention_mask
                ).logits.float()
                student = cached.engine.module.student(
                    input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask
                ).logits.float()
                labels, shifted = batch.student.labels[:, 1:], teacher[:, :-1]
                exact.append(loss(student[:, :-1], shifted, labels).item())
                draws = [
                    loss(student[:, :-1], sampled_batch(batch, shifted, seed, SAMPLED, vocab), labels).item()
                    for seed in range(12)
                ]
            variances.append(statistics.variance(draws))
        return statistics.fmean(exact), sum(variances) ** 0.5 / len(variances)

    losses: dict[str, list[float]] = {"online": [], "cached": [], "exact": []}
    for step in range(4):
        exact, sigma = spread(step)
        assert sigma < 0.25 * exact, (step, sigma, exact)  # the draws resolve the loss
        for name, trainer in trainers.items():
            losses[name].append(trainer.step(step)["base"])
        losses["exact"].append(exact)
        assert abs(losses["cached"][-1] - exact) <= 4 * sigma, (step, losses, sigma)
    assert losses["online"][0] == pytest.approx(losses["exact"][0], rel=1e-4)  # the same initial student
    # (Forward KL reads the unbiased importance estimate; reverse-type losses read the rest rule,
    # biased, measured in test_teacher_sampled.py and bench/teacher_cache.py. The students then
    # drift apart: on these tiny random models both distributions are nearly flat, so 255 draws
    # beyond a head of 32 of 512 tokens resolve the loss but its gradient is mostly noise; with a
    # head of 500 the runs agree step by step. The bench measures the gradient on the demo's pair.)
    assert losses["cached"] != losses["online"]  # the draws, not the online teacher, gave them
    online.close()
    cached.close()


def as_version_1(directory) -> None:
    """Rewrite a version-2 top-k cache as version 1 wrote it: int32 id lists, no draws or
    scales, none of the new manifest keys (a second, plain writer of the old layout)."""
    meta = directory / ".mta" / "manifest.json"
    manifest = json.loads(meta.read_text())
    bits, k = manifest["id_bits"], manifest["top_k"]
    for part in manifest["parts"]:
        path = directory / part["file"]
        table = pq.read_table(path)
        rows = table.to_pylist()
        for row in rows:
            row["top_ids"] = unpack_ids(row["top_ids"], bits, len(row["positions"]) * k).astype(np.int32).tolist()
        value = table.schema.field("top_log_probs").type
        old = pa.schema(
            [
                ("id", pa.int64()),
                ("tokens", pa.int32()),
                ("positions", pa.list_(pa.int32())),
                ("top_ids", pa.list_(pa.int32())),
                ("top_log_probs", value),
                ("tail", pa.list_(pa.float32())),
                ("hidden", table.schema.field("hidden").type),
            ]
        )
        columns = {name: [row[name] for row in rows] for name in old.names}
        pq.write_table(pa.table(columns, schema=old), path, row_group_size=1, compression="none")
        part["sha256"] = file_sha256(path)
    for key in ("sampling", "states", "id_bits", "bytes", "tokens"):
        manifest.pop(key, None)
    manifest["teacher_cache_version"] = 1
    meta.write_text(json.dumps(manifest))


def test_a_version_1_cache_still_reads_as_it_did(tmp_path, tiny_run_recipe):
    recipe = load_recipe(
        tiny_run_recipe(
            tmp_path / "out",
            teacher_cache={"dir": str(tmp_path / "v2"), "top_k": 8, "states": "storage"},  # version 1's states
            data={"dev": None},
        )
    )
    run_teacher_stage(recipe)
    shutil.copytree(tmp_path / "v2", tmp_path / "v1")
    as_version_1(tmp_path / "v1" / "train")
    expected = json.loads((tmp_path / "v2" / "train" / ".mta" / "manifest.json").read_text())
    new, old = TeacherCache(tmp_path / "v2" / "train", expected), TeacherCache(tmp_path / "v1" / "train", expected)
    assert old.manifest["teacher_cache_version"] == 1 and old.states == "storage" and old.sampling is None
    row_ids = sorted(new.where)[:3]
    for row_id in row_ids:
        for name in ("tokens", "positions", "top_ids", "top_log_probs", "tail", "hidden"):
            np.testing.assert_array_equal(old.row(row_id)[name], new.row(row_id)[name], err_msg=name)
    width = max(int(new.row(i)["tokens"][0]) for i in row_ids)
    torch.testing.assert_close(
        old._logits([old.row(i) for i in row_ids], width), new._logits([new.row(i) for i in row_ids], width)
    )
    # A version this mta does not know is still refused with the fix.
    manifest = json.loads((tmp_path / "v1" / "train" / ".mta" / "manifest.json").read_text())
    (tmp_path / "v1" / "train" / ".mta" / "manifest.json").write_text(
        json.dumps(manifest | {"teacher_cache_version": 9})
    )
    with pytest.raises(MtaError, match=r"teacher_cache_version 9.*reads version 1 or 2 or 3"):
        TeacherCache(tmp_path / "v1" / "train", expected)


RECIPE = """name: t
output_dir: out
teacher: {path: gpt2}
student: {path: gpt2}
data: {train: a.jsonl}
train: {lr: 1.0e-4, max_steps: 2}
teacher_cache:
  logits: top_k
  top_k: 0
  samples: 300
"""


def test_the_sampling_keys_are_checked_naming_their_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    with pytest.raises(MtaError, match=r"line 10: teacher_cache\.samples: .*less than or equal to 255"):
        load_recipe(path)
    with pytest.raises(MtaError, match=r"line 9: teacher_cache\.top_k: top_k=0 keeps no token with logits=top_k"):
        load_recipe(path, ["teacher_cache.samples=8"])
    sampled = load_recipe(path, ["teacher_cache.samples=8", "teacher_cache.logits=sampled"]).teacher_cache
    assert sampled.head == 0 and sampled.samples == 8  # top_k 0: draws only
    sampled = load_recipe(path, ["teacher_cache.samples=8", "teacher_cache.logits=sampled", "teacher_cache.top_k=null"])
    assert sampled.teacher_cache.head == 32  # the sampled default head
    assert load_recipe(path, ["teacher_cache.samples=8", "teacher_cache.top_k=null"]).teacher_cache.head == 1024


@pytest.mark.parametrize("logits", ["top_k", "sampled"])
def test_the_stage_stores_the_same_rows_whatever_its_chunk_of_positions(tmp_path, tiny_run_recipe, monkeypatch, logits):
    """The stage applies the head and draws a chunk of positions at a time (``CHUNK_POSITIONS``):
    with 3-position chunks, boundaries inside every batch, it stores the same ids, positions,
    draws and states as with one chunk, and the same log-probabilities to fp32's rounding."""
    from mta.training.teacher_cache import teacher as stage

    spec = {"logits": logits, "top_k": 8, "samples": 16, "storage": "fp32", "states": "storage"}
    recipe = load_recipe(tiny_run_recipe(tmp_path / "out", teacher_cache=spec, data={"dev": None}))
    run_teacher_stage(recipe, out_dir=tmp_path / "whole", batch_size=4)
    monkeypatch.setattr(stage, "CHUNK_POSITIONS", 3)
    run_teacher_stage(recipe, out_dir=tmp_path / "chunked", batch_size=4)
    whole, chunked = (
        pq.read_table(sorted((tmp_path / name / "train").glob("part-*.parquet"))).sort_by("id")
        for name in ("whole", "chunked")
    )
    assert whole.num_rows > 1 and whole.column_names == chunked.column_names
    for name in whole.column_names:  # the head's matmul in other shapes moves a log-prob by an ulp
        if name in ("top_log_probs", "tail", "sample_log_probs", "rest_log_mean"):
            got, want = (
                np.concatenate([np.asarray(r, dtype=np.float64) for r in t[name].to_pylist()]) for t in (chunked, whole)
            )
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=name)
        else:
            assert chunked[name].equals(whole[name]), name
