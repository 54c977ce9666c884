"""Fixtures shared by every test: real tokenizers trained here, tiny random models, ../shared."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "recipes" / "examples" / "tiny.jsonl"
# `auto` precision as on a CPU without bf16 instructions (fp32), here and in every subprocess, so
# the suite computes the same on every machine; tests of bf16 ask for it (tests/test_cpu_precision.py).
os.environ["MTA_CPU_BF16"] = "0"

# What a launcher sets: a subprocess that inherits them would join this test process's
# rendezvous (its port is taken) instead of starting its own.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(*, drop: Sequence[str] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a command run as a subprocess: no launcher variables (nor
    ``drop``), one torch thread (two threads on oversubscribed cores run many times slower)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES and key not in drop}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    return env


def torchrun(argv: Sequence[str], *, processes: int = 2, timeout: float = 300) -> str:
    """Run ``python -m torch.distributed.run --nproc-per-node N argv...`` with one torch thread
    per process and no launcher variables inherited; kill the launcher and its workers on a
    hang. Asserts a zero exit; returns stderr (what a failing test shows)."""
    from mta.distributed import free_port

    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "cli"), str(REPO / "src"), env.get("PYTHONPATH", "")])
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(processes),
            "--master-port",
            str(free_port()),
            *map(str, argv),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:  # a hang: the launcher and every worker, not only the launcher
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    return stderr


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
        teacher=str(tiny_tokenizer_dir),
        student=str(other_tokenizer_dir),
        workers=1,
        max_length=256,
        max_prompt_length=160,
    )


def train_tokenizer_with_specials(out: Path, vocab_size: int, specials: list[str], eos: str, pad: str) -> Path:
    """A byte-level BPE trained on the example rows whose special tokens take ids 0, 1, ... in
    the order given, so EOS and PAD get the ids a test needs (mta's trainer makes EOS = PAD = 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from mta.models.tiny import corpus_texts

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus_texts(EXAMPLES), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=pad).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def eos_1_tokenizer_dir(tmp_path_factory) -> Path:
    """A BPE (vocab 400) with PAD ``<pad>`` = 0 and EOS ``<|endoftext|>`` = 1."""
    return train_tokenizer_with_specials(
        tmp_path_factory.mktemp("tok-eos1"), 400, ["<pad>", "<|endoftext|>"], "<|endoftext|>", "<pad>"
    )


@pytest.fixture(scope="session")
def eos_2_tokenizer_dir(tmp_path_factory) -> Path:
    """A BPE (vocab 300) with PAD ``<pad>`` = 0 and EOS ``</s>`` = 2: paired with
    ``eos_1_tokenizer_dir``, neither side's EOS is the other's, nor anybody's PAD."""
    return train_tokenizer_with_specials(
        tmp_path_factory.mktemp("tok-eos2"), 300, ["<pad>", "<unk>", "</s>"], "</s>", "<pad>"
    )


# Fixtures several test modules share; their plain helpers are in tests/fixtures/ (no test
# module imports another).


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the whole module that asks for it, with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from mta.distributed import torch_threads

    # Several test runs and engineers share two cores: OpenMP threads spinning against each
    # other make a tiny model's step 20x slower, and one thread is what a subprocess gets too.
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def teacher_dir(tiny_tokenizer_dir, tmp_path_factory):
    """A random Llama (d=48, seed 1) on the 512-token tokenizer: a teacher for ``tiny_model_dir``."""
    from mta.models.tiny import build_tiny_model

    return build_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("teacher"), hidden_size=48, seed=1)


@pytest.fixture(scope="module")
def same_data(tiny_tokenizer_dir, tmp_path_factory):
    """The example rows annotated for the 512-token tokenizer on both sides."""
    from fixtures.distill import annotate_examples

    return annotate_examples(tiny_tokenizer_dir, tiny_tokenizer_dir, tmp_path_factory.mktemp("ann-same") / "a")


@pytest.fixture
def tiny_run_recipe(tmp_path, teacher_dir, tiny_model_dir, same_data):
    """``tiny_run_recipe(out, **sections)``: ``tmp_path/r.yaml``, the tiny teacher -> student recipe on
    ``same_data`` into ``out``, with ``sections`` laid over (``fixtures.distill.write_recipe``)."""
    from fixtures.distill import write_recipe

    def recipe(output_dir: Path, **sections):
        return write_recipe(
            tmp_path / "r.yaml",
            teacher=teacher_dir,
            student=tiny_model_dir,
            annotations=same_data,
            output_dir=output_dir,
            **sections,
        )

    return recipe


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """Dolly rows built from the example file (prompt from instruction/input) after one whose
    reference is Chinese only, S-NI in its 11_ bucket with list references; no Vicuna, SelfInst or UnNI."""
    from fixtures.evaluate import write_jsonl

    rows = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    cjk = {"instruction": "说一句关于茶的话。", "input": "", "output": "茶是中国的传统饮品。"}
    write_jsonl(tmp_path / "data" / "dolly" / "valid.jsonl", [cjk] + rows[:4])
    write_jsonl(tmp_path / "data" / "dolly" / "dev.jsonl", rows[4:10])
    write_jsonl(
        tmp_path / "data" / "sinst" / "11_" / "valid.jsonl",
        [{"instruction": r["instruction"], "input": r["input"], "output": [r["output"], "yes"]} for r in rows[10:14]],
    )
    return tmp_path / "data"


@pytest.fixture
def new_engine(tiny_model_dir):
    """Builds DeepSpeed engines on the tiny student (``fixtures.checkpoints.Engines``) and
    destroys them when the test ends."""
    from fixtures.checkpoints import Engines

    built = Engines(tiny_model_dir)
    yield built
    built.destroy()
