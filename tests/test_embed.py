"""`mta embed`: the teacher-embedding stage on tiny random encoders.

The stored vectors equal a plain ``model(**batch)`` loop with hand-written pooling; the text
rule; reuse and the key; a run killed by SIGKILL resumes without computing or writing any row
twice; the pooling modes against a loop; sentence-transformers configs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fixtures.processes import sigkill_when_it_says, stalling_journal
from mta.embedding import embed as stage
from mta.embedding import encoder as encoder_module
from mta.embedding.embed import (
    build_teacher_embeddings,
    embedding_text,
    read_teacher_embeddings,
    run_embed,
)
from mta.embedding.export import read_sentence_transformers_config
from mta.embedding.pooling import pool
from mta.errors import MtaError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "recipes" / "examples"


@pytest.fixture(autouse=True)
def fp32_on_the_cpu(monkeypatch):
    """``auto`` precision is fp32 on every CPU here (mta.dtypes: bf16 where the CPU has it)."""
    monkeypatch.setenv("MTA_CPU_BF16", "0")


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, Path]:
    """A sentence-transformers teacher (mean + Normalize) and a plain HF encoder (no modules)."""
    from mta.embedding.tiny_encoders import build_tiny_encoder

    root = tmp_path_factory.mktemp("encoders")
    return {
        "st": build_tiny_encoder(
            root / "teacher", layers=2, hidden=32, heads=4, seed=1, pooling="mean", normalize=True, max_position=64
        ),
        "plain": build_tiny_encoder(root / "plain", layers=1, hidden=16, heads=2, seed=2, max_position=64),
    }


def texts_of(path: Path) -> list[str]:
    return [embedding_text(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def plain_loop(model_dir: Path, texts: list[str], *, mode: str, normalize: bool, max_length: int, batch: int = 7):
    """Input order, fixed batches, pooling written out per row: the reference."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), batch):
            encoded = tokenizer(
                texts[start : start + batch], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
            hidden = model(**encoded).last_hidden_state
            for row, mask in zip(hidden, encoded["attention_mask"], strict=True):
                real = row[mask.bool()]
                vector = real.mean(0) if mode == "mean" else row[0]
                out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(out)


def test_stored_vectors_are_a_plain_model_loop_with_pooling(encoders, tmp_path):
    data = EXAMPLES / "tiny.jsonl"
    out = build_teacher_embeddings(encoders["st"], data, tmp_path / "emb", batch_size=5)
    stored = read_teacher_embeddings(out)
    texts = texts_of(data)
    assert stored.ids.tolist() == list(range(len(texts))) and stored.texts == texts
    expected = plain_loop(encoders["st"], texts, mode="mean", normalize=True, max_length=64)
    torch.testing.assert_close(stored.embeddings, expected, atol=2e-6, rtol=1e-5)
    manifest = stored.manifest
    assert manifest["pooling"] == {"mode": "mean", "normalize": True, "source": "sentence-transformers"}
    assert manifest["max_length"] == 64 and manifest["precision"] == "fp32" and manifest["dimension"] == 32
    assert manifest["input"]["sha256"] and manifest["rows"]["written"] == len(texts)
    # Pandas-style readers see exactly the rows: the directory holds nothing but the parts.
    table = pq.read_table(str(out))
    assert sorted(table.column("id").to_pylist()) == stored.ids.tolist()

    # An explicit mode overrides the config (the config's Normalize stays unless overridden).
    cls = read_teacher_embeddings(
        build_teacher_embeddings(encoders["st"], data, tmp_path / "cls", pooling="cls", normalize=False, max_length=16)
    )
    torch.testing.assert_close(
        cls.embeddings,
        plain_loop(encoders["st"], texts, mode="cls", normalize=False, max_length=16),
        atol=2e-6,
        rtol=1e-5,
    )
    assert cls.manifest["rows"]["truncated"] > 0  # 16 tokens cut most texts
    assert cls.manifest["run_key"] != manifest["run_key"]


def test_a_plain_encoder_pools_with_mean_and_is_not_normalised(encoders, tmp_path):
    data = EXAMPLES / "tiny-teacher-corpus.jsonl"
    stored = read_teacher_embeddings(build_teacher_embeddings(encoders["plain"], data, tmp_path / "e", batch_size=16))
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    assert stored.texts == texts
    torch.testing.assert_close(
        stored.embeddings,
        plain_loop(encoders["plain"], texts, mode="mean", normalize=False, max_length=64),
        atol=2e-6,
        rtol=1e-5,
    )
    assert stored.manifest["pooling"]["source"] == "default"


def test_the_text_of_each_row_format():
    assert embedding_text({"text": "plain"}) == "plain"
    assert (
        embedding_text({"instruction": "Do it.", "input": "", "output": "Done.", "prompt": "Below is..."})
        == "Do it.\n\nDone."
    )
    assert embedding_text({"instruction": "Sum", "context": "2 and 3", "response": "5"}) == "Sum\n\n2 and 3\n\n5"
    assert embedding_text({"prompt": "Q?", "response": "A."}) == "Q?\n\nA."
    assert embedding_text({"body": "x", "text": "y"}, text_field="body") == "x"
    for bad in ({"title": "no text"}, {"text": "   "}, {"text": 3}):
        with pytest.raises(ValueError):
            embedding_text(bad)


def test_rows_without_text_fail_naming_the_line_or_are_counted(encoders, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "one"}\n{"title": "none"}\n\n{"text": "three"}\nnot json\n')
    with pytest.raises(MtaError, match=r"rows\.jsonl:2: no text"):
        build_teacher_embeddings(encoders["plain"], data, tmp_path / "fail")
    assert not (tmp_path / "fail").exists()  # nothing left behind
    stored = read_teacher_embeddings(
        build_teacher_embeddings(encoders["plain"], data, tmp_path / "skip", on_error="skip")
    )
    assert stored.ids.tolist() == [0, 2] and stored.texts == ["one", "three"]
    assert stored.manifest["rows"] == {"read": 4, "written": 2, "skipped": 2, "truncated": 0}
    assert stored.manifest["skipped"] == {"missing_field": 1, "invalid_json": 1}


def test_a_matching_artefact_is_reused_without_loading_the_teacher(encoders, tmp_path, monkeypatch):
    data = EXAMPLES / "tiny.jsonl"
    first = run_embed(encoders["plain"], data, tmp_path / "e", batch_size=8)
    assert not first.reused and first.rows == 36

    def refuse(*args, **kwargs):
        raise AssertionError("the teacher was loaded for a reuse")

    with monkeypatch.context() as patched:
        patched.setattr(stage, "load_encoder", refuse)
        assert run_embed(encoders["plain"], data, tmp_path / "e", batch_size=32).reused  # batching is not in the key
    again = run_embed(encoders["plain"], data, tmp_path / "e", max_length=8)  # another key: recomputed
    assert not again.reused and read_teacher_embeddings(tmp_path / "e").manifest["max_length"] == 8
    assert len(list((tmp_path / "e").glob("*.parquet"))) == 1  # the superseded part is gone


KILLED_RUN = (
    stalling_journal(3)
    + """
from pathlib import Path
from mta.embedding import embed as stage

stage.CHUNK_ROWS = 4
stage.build_teacher_embeddings(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), batch_size=2, device="cpu")
"""
)


def test_a_run_killed_by_sigkill_resumes_without_duplicates(encoders, tmp_path, monkeypatch):
    data, out = EXAMPLES / "tiny.jsonl", tmp_path / "e"
    assert sigkill_when_it_says(KILLED_RUN, [encoders["st"], data, out], "journalled") == -signal.SIGKILL
    assert not (out / ".mta" / "manifest.json").exists() and not list(out.glob("*.parquet"))
    work = out / ".mta" / "work" / "shard-00000-of-00001"
    assert len(list(work.glob("chunk-*.parquet"))) == 3

    embedded = []
    original = encoder_module.SentenceEncoder.embed_batch
    with monkeypatch.context() as patched:
        patched.setattr(stage, "CHUNK_ROWS", 4)
        patched.setattr(
            encoder_module.SentenceEncoder,
            "embed_batch",
            lambda self, batch: embedded.append(len(batch["input_ids"])) or original(self, batch),
        )
        outcome = run_embed(encoders["st"], data, out, batch_size=2, device="cpu")
    assert outcome.resumed_rows == 12 and outcome.rows == 36 - 12 == sum(embedded)  # nothing computed twice
    resumed = read_teacher_embeddings(out)
    assert resumed.ids.tolist() == list(range(36))  # every row once
    assert not work.exists()
    whole = read_teacher_embeddings(build_teacher_embeddings(encoders["st"], data, tmp_path / "whole", batch_size=2))
    torch.testing.assert_close(resumed.embeddings, whole.embeddings, atol=0, rtol=0)
    assert resumed.texts == whole.texts


def test_shards_write_one_artefact(encoders, tmp_path):
    data = EXAMPLES / "tiny.jsonl"
    first = run_embed(encoders["plain"], data, tmp_path / "e", shard=(1, 2))
    assert first.manifest is None
    with pytest.raises(MtaError, match="no .mta/manifest.json"):
        read_teacher_embeddings(tmp_path / "e")
    second = run_embed(encoders["plain"], data, tmp_path / "e", shard=(0, 2))
    assert second.manifest["num_shards"] == 2 and second.manifest["rows"]["written"] == 36
    sharded = read_teacher_embeddings(tmp_path / "e")
    whole = read_teacher_embeddings(build_teacher_embeddings(encoders["plain"], data, tmp_path / "w"))
    assert sharded.ids.tolist() == list(range(36))
    torch.testing.assert_close(sharded.embeddings, whole.embeddings, atol=2e-6, rtol=1e-5)


def test_a_changed_part_is_refused(encoders, tmp_path):
    out = build_teacher_embeddings(encoders["plain"], EXAMPLES / "tiny.jsonl", tmp_path / "e")
    part = next(out.glob("*.parquet"))
    part.write_bytes(part.read_bytes()[:-7] + b"changed")
    with pytest.raises(MtaError, match="does not match the manifest's sha256"):
        read_teacher_embeddings(out)


@pytest.mark.parametrize("side", ["right", "left"])
def test_pooling_modes_against_a_loop(side):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=generator)
    lengths = [5, 2, 3]
    mask = torch.zeros(3, 5, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, 5 - n :] = 1
    for mode in ("mean", "cls", "max", "last"):
        got = pool(hidden, mask, mode)
        for row in range(3):
            real = [t for t in range(5) if mask[row, t]]
            expected = {
                "mean": sum(hidden[row, t] for t in real) / len(real),
                "cls": hidden[row, 0],
                "max": torch.stack([hidden[row, t] for t in real]).max(0).values,
                "last": hidden[row, real[-1]],
            }[mode]
            torch.testing.assert_close(got[row], expected, msg=f"{mode} row {row}")


def test_sentence_transformers_pipelines_other_than_pooling_are_refused(tmp_path):
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(MtaError, match="Dense"):
        read_sentence_transformers_config(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(json.loads((tmp_path / "modules.json").read_text())[:2]))
    assert read_sentence_transformers_config(tmp_path).mode == "cls"


def test_the_cli_embeds_and_reports(encoders, tmp_path, monkeypatch, capsys):
    from mta_cli.main import app

    monkeypatch.setenv("MTA_PROGRESS", "plain")
    out = tmp_path / "e"
    try:
        app(
            [
                "embed",
                str(EXAMPLES / "tiny.jsonl"),
                "--teacher",
                str(encoders["plain"]),
                "-o",
                str(out),
                "--batch-size",
                "9",
            ],
            standalone_mode=False,
        )
    except SystemExit as error:  # pragma: no cover - typer exits 0 on success in some versions
        assert error.code in (0, None)
    out_text = capsys.readouterr().out  # the summary and the final line: stdout
    assert "texts embedded" in out_text and f"wrote {out}" in out_text
    assert np.array_equal(read_teacher_embeddings(out).ids, np.arange(36))


@pytest.mark.slow
def test_under_torchrun_each_rank_embeds_its_share_into_one_artefact(encoders, tmp_path):
    from conftest import torchrun

    data = EXAMPLES / "tiny.jsonl"
    torchrun(
        ["-m", "mta_cli.main", "embed", data, "--teacher", encoders["plain"], "-o", tmp_path / "two", "--device", "cpu"]
    )
    sharded = read_teacher_embeddings(tmp_path / "two")
    assert sharded.manifest["num_shards"] == 2 and sharded.ids.tolist() == list(range(36))
    whole = read_teacher_embeddings(build_teacher_embeddings(encoders["plain"], data, tmp_path / "one"))
    torch.testing.assert_close(sharded.embeddings, whole.embeddings, atol=2e-6, rtol=1e-5)
