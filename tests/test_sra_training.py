"""SRA end to end on the tiny cross-tokenizer recipe (two tiny models whose tokenizers differ):
alone, with MTA, and an interrupted run that resumes to the uninterrupted weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from fixtures.distill import weights
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.metrics import read_metrics
from mta.training.trainer import Trainer, run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_CROSS = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cross.yaml"


def _recipe(out: Path, *overrides: str):
    return load_recipe(
        TINY_CROSS,
        [
            f"output_dir={out}",
            "data.dev=null",
            "train.max_steps=4",
            "train.save_interval=2",
            "train.log_interval=1",
            *overrides,
        ],
    )


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_sra_alone_and_with_mta_train_and_an_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    alone = run_distillation(_recipe(tmp_path / "alone", "loss.dsa_weight=0", "loss.hra_weight=0"))
    records = [r for r in read_metrics(tmp_path / "alone" / "metrics.jsonl") if r["split"] == "train"]
    assert all(r["loss/sra"] > 0 and "loss/dsa" not in r for r in records)
    AutoModelForCausalLM.from_pretrained(alone)

    both = run_distillation(_recipe(tmp_path / "both"))
    records = [r for r in read_metrics(tmp_path / "both" / "metrics.jsonl") if r["split"] == "train"]
    assert all(r["loss/sra"] > 0 and r["loss/dsa"] > 0 for r in records)

    real_step = Trainer.step

    def interrupted(self, step):
        if step == 2:  # after checkpoint step-2 was written
            raise _Interrupted
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", interrupted)
    with pytest.raises(_Interrupted):
        run_distillation(_recipe(tmp_path / "again"))
    monkeypatch.setattr(Trainer, "step", real_step)
    resumed = run_distillation(_recipe(tmp_path / "again"), resume="auto")
    expected, got = weights(both), weights(resumed)
    for name in expected:
        assert np.array_equal(expected[name].numpy(), got[name].numpy()), name


def test_gpt2_and_qwen_share_their_byte_level_words_and_not_their_specials(tmp_path, gpt2_tokenizer_dir):
    from mta.losses.sra import tokenizers_shared_vocabulary
    from mta.models.qwen_tokenizer import build_qwen_tokenizer
    from mta.models.tokenizers import load_tokenizer

    gpt2 = load_tokenizer(gpt2_tokenizer_dir)
    qwen = load_tokenizer(build_qwen_tokenizer(tmp_path / "qwen"))
    student_ids, teacher_ids = tokenizers_shared_vocabulary(gpt2, qwen)
    pairs = dict(zip(student_ids.tolist(), teacher_ids.tolist(), strict=True))
    # Both are byte-level BPEs: a shared token is the same string on both sides, in order of GPT-2 id.
    gpt2_tokens, qwen_tokens = gpt2.convert_ids_to_tokens(list(pairs)), qwen.convert_ids_to_tokens(list(pairs.values()))
    assert gpt2_tokens == qwen_tokens and student_ids.tolist() == sorted(student_ids.tolist())
    assert 30_000 < len(pairs) < len(gpt2)
    assert pairs[gpt2.convert_tokens_to_ids("Ġthe")] == qwen.convert_tokens_to_ids("Ġthe")
    # A special token is shared only with the identical special string: both call EOS <|endoftext|>.
    assert pairs[gpt2.eos_token_id] == qwen.convert_tokens_to_ids("<|endoftext|>")
    assert all(token not in qwen.all_special_tokens or token in gpt2.all_special_tokens for token in qwen_tokens)


def test_the_dry_run_counts_the_shared_vocabulary_when_the_tokenizers_are_at_hand(
    tmp_path, tiny_tokenizer_dir, other_tokenizer_dir
):
    from mta.models.tiny import build_tiny_model
    from mta.models.tokenizers import load_tokenizer
    from mta.training.dry_run import plan_run

    teacher = build_tiny_model(other_tokenizer_dir, tmp_path / "teacher", hidden_size=48, seed=1)
    student = build_tiny_model(tiny_tokenizer_dir, tmp_path / "student")
    recipe = _recipe(
        tmp_path / "run", f"teacher.path={teacher}", f"student.path={student}", "teacher.tiny=null", "student.tiny=null"
    )
    notes = [note for note in plan_run(recipe).notes if note.startswith("SRA: ")]
    assert len(notes) == 1 and notes[0].endswith("tokens shared by the two vocabularies (its span logit term)")
    count = int(notes[0].split()[1].replace(",", ""))
    # Trained on the same rows, the 300-token BPE's merges are the 512-token one's first ones.
    assert count == len(
        set(load_tokenizer(other_tokenizer_dir).get_vocab()) & set(load_tokenizer(tiny_tokenizer_dir).get_vocab())
    )
