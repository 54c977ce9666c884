"""What only the slow embedding-training tests reached in the TALAS wing, checked fast for mutation
testing (bench/mutation.py leaves tests/test_embedding_training.py out of its talas group): the
pooling record a run stores and the files an exported encoder gets."""

from __future__ import annotations

from types import SimpleNamespace

from mta.embedding import export
from mta.embedding.objective import EmbeddingDistillationModel
from mta.embedding.pooling import PoolingConfig


def test_the_pooling_record_holds_the_mode_the_normalisation_and_where_they_came_from():
    record = PoolingConfig("cls_attention", True, "option", max_seq_length=12).record()
    assert record == {"mode": "cls_attention", "normalize": True, "source": "option"}


def test_export_files_describe_the_students_pooling_width_and_length(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(export, "write_sentence_transformers_files", lambda *a, **k: calls.append((a, k)))
    model = SimpleNamespace(
        objective=SimpleNamespace(pooling="cls"),
        student=SimpleNamespace(config=SimpleNamespace(hidden_size=24.0)),
        max_seq_length=48,
    )
    EmbeddingDistillationModel.export_files(model, tmp_path)  # type: ignore[arg-type]
    assert calls == [((tmp_path,), {"pooling": "cls", "hidden": 24, "max_seq_length": 48})]
    assert type(calls[0][1]["hidden"]) is int
