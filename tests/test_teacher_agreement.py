"""Teacher agreement (issue 47) against a plain per-row, per-position loop written here."""

from __future__ import annotations

import math

import pytest
import torch

from mta.errors import MtaError
from mta.evaluation.datasets import EvalRow
from mta.evaluation.perplexity import encode_for_scoring
from mta.evaluation.teacher_agreement import AgreementRows, position_agreement, teacher_agreement

ROWS = [
    EvalRow(0, 1, "### Instruction:\nName a fruit.\n\n### Response:\n", ("A ripe banana is sweet.",)),
    EvalRow(1, 2, "### Instruction:\nSay hi.\n\n### Response:\n", ("Hi there, how are you today?", "Hello")),
    EvalRow(2, 3, "### Instruction:\nCount to three.\n\n### Response:\n", ("One, two, three.",)),
]


def _naive(teacher, student, tokenizer, row: EvalRow, alpha: float) -> tuple[float, float, float]:
    """fkl, srkl and top-1 of one row, one position at a time, from probabilities (no log space)."""
    seq = encode_for_scoring(tokenizer, row.prompt, row.references[0], max_prompt_length=256, max_response_length=16)
    ids = torch.tensor([seq.input_ids])
    with torch.no_grad():
        t_logits, s_logits = teacher(input_ids=ids).logits[0].double(), student(input_ids=ids).logits[0].double()
    fkl, srkl, top1, n = 0.0, 0.0, 0.0, 0
    for position in range(len(seq.labels) - 1):
        if seq.labels[position + 1] == -100:
            continue
        p, q = torch.softmax(t_logits[position], -1), torch.softmax(s_logits[position], -1)
        fkl += float((p * (p / q).log()).sum())
        mixture = alpha * q + (1 - alpha) * p
        srkl += float((q * (q / mixture).log()).sum())
        top1 += float(p.argmax() == q.argmax())
        n += 1
    return fkl / n, srkl / n, top1 / n


def test_teacher_agreement_matches_a_plain_loop_per_row(tiny_model_dir, tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM

    from mta.models.tokenizers import load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    found = teacher_agreement(
        (teacher, tokenizer),
        {"same": (teacher, tokenizer), "other": (other, tokenizer)},
        ROWS,
        max_response_length=16,
        batch_size=2,  # rows of different lengths share a padded batch
    )
    for index, row in enumerate(ROWS):
        fkl, srkl, top1 = _naive(teacher, other, tokenizer, row, 0.1)
        assert found["other"].fkl[index] == pytest.approx(fkl, rel=1e-4, abs=1e-6)
        assert found["other"].srkl[index] == pytest.approx(srkl, rel=1e-4, abs=1e-6)
        assert found["other"].top1[index] == pytest.approx(top1)
        # The teacher against itself: no divergence, full agreement.
        assert abs(found["same"].fkl[index]) < 1e-5 and abs(found["same"].srkl[index]) < 1e-5
        assert found["same"].top1[index] == 1.0
    assert min(found["other"].fkl) > 1e-4  # the planted perturbation is seen
    again = AgreementRows.from_dict(found["other"].to_dict())
    assert again.fkl.tolist() == found["other"].fkl.tolist() and again.tokens.tolist() == found["other"].tokens.tolist()


def test_chunks_do_not_change_the_positions_values():
    torch.manual_seed(1)
    teacher, student = torch.randn(37, 50), torch.randn(37, 50)
    whole = position_agreement(teacher, student, chunk_size=1000)
    assert torch.allclose(position_agreement(teacher, student, chunk_size=5), whole)
    assert whole.shape == (3, 37) and not math.isnan(float(whole.sum()))


def test_a_student_of_another_tokenizer_is_refused(tiny_model_dir, tiny_tokenizer_dir, other_tokenizer_dir):
    from transformers import AutoModelForCausalLM

    from mta.models.tokenizers import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    teacher = (model, load_tokenizer(str(tiny_tokenizer_dir)))
    with pytest.raises(MtaError, match="another tokenizer"):
        teacher_agreement(teacher, {"odd": (model, load_tokenizer(str(other_tokenizer_dir)))}, ROWS)
