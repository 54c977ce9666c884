"""Fixtures shared by every test: real tokenizers trained here, tiny random models, ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "src" / "mta" / "recipes" / "examples" / "tiny.jsonl"

# The smallest valid recipe; tests fill in the model paths and add or break keys.
MINIMAL_RECIPE = """\
name: minimal
output_dir: runs/minimal
teacher:
  path: {teacher}
student:
  path: {student}
data:
  train: train.jsonl
loss:
  base: fkl
train:
  max_steps: 10
  batch_size: 4
  micro_batch_size: 2
"""


def shared_dir() -> Path:
    return Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared() -> Path:
    """../shared (read-only); tests that need it skip with a reason where it is absent."""
    path = shared_dir()
    if not (path / "README.md").exists():
        pytest.skip(f"../shared is absent here (looked in {path}); set MTA_SHARED_DIR")
    return path


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(shared: Path) -> Path:
    path = shared / "tokenizers" / "gpt2"
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"the real GPT-2 tokenizer is absent ({path})")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 512) trained on the repo's example rows."""
    from mta.models.tiny import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tok512")
    build_tiny_tokenizer(EXAMPLES, out, vocab_size=512)
    return out


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    """A second, different BPE (vocab 300): the different-tokenizers case."""
    from mta.models.tiny import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tok300")
    build_tiny_tokenizer(EXAMPLES, out, vocab_size=300)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """A random 4-layer Llama (d=32) with the 512-token tokenizer saved beside it."""
    from mta.models.tiny import build_tiny_model

    return build_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def two_tokenizer_settings(tiny_tokenizer_dir, other_tokenizer_dir):
    """Annotate settings for two different tokenizers (512 and 300 tokens), one worker."""
    from mta.data.annotate import AnnotateSettings

    return AnnotateSettings(
        teacher=str(tiny_tokenizer_dir), student=str(other_tokenizer_dir), workers=1,
        max_length=256, max_prompt_length=160,
    )
