"""Teacher agreement: how closely each student's next-token distributions follow its teacher's
on reference responses, teacher-forced, per row (issue 47's outcome beside ROUGE-L).

Each row is tokenised as :mod:`mta.evaluation.perplexity` scores it (``encode_for_scoring``: the
prompt's first ``max_prompt_length`` tokens, the first reference, EOS when it fits). At every
response position both models see the same prefix; with teacher ``p`` and student ``q``:

- ``fkl``: ``KL(p ‖ q)`` (:class:`mta.losses.kd.ForwardKL`'s divergence);
- ``srkl``: ``KL(q ‖ α q + (1 − α) p)`` (:class:`mta.losses.kd.SkewReverseKL`'s, α = ``skew_alpha``);
- ``top1``: 1 where the two argmaxes agree.

A row's value is the mean over its response positions (a row, not a token, is the unit the
bootstrap resamples). The teacher runs once per batch for every student (all of them in memory:
the models this measures are small); teacher and students must share one tokenizer (the KLs
compare the same vocabulary). Positions are processed ``chunk_size`` at a time, so the
``[positions, vocab]`` log-probabilities of a long batch never sit in memory whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mta.errors import MtaError
from mta.evaluation.datasets import EvalRow
from mta.evaluation.perplexity import IGNORE, ScoredSequence, right_pad, scoring_sequences
from mta.losses.kd import ForwardKL, SkewReverseKL
from mta.reporting import Reporter, SilentReporter

MEASURES = ("fkl", "srkl", "top1")


@dataclass(frozen=True)
class AgreementRows:
    """Per row, in the rows' order: each measure's mean over the row's response positions, and
    the number of positions (``tokens``)."""

    fkl: np.ndarray
    srkl: np.ndarray
    top1: np.ndarray
    tokens: np.ndarray

    def to_dict(self) -> dict[str, list[float]]:
        return {name: [float(v) for v in getattr(self, name)] for name in (*MEASURES, "tokens")}

    @classmethod
    def from_dict(cls, record: Mapping[str, Sequence[float]]) -> AgreementRows:
        return cls(**{name: np.asarray(record[name], dtype=np.float64) for name in (*MEASURES, "tokens")})


def position_agreement(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, *, skew_alpha: float = 0.1, chunk_size: int = 256
) -> torch.Tensor:
    """``[n, vocab]`` teacher and student logits (the same n positions) -> ``[3, n]`` float64:
    fkl, srkl and top-1 agreement at each position, a chunk of positions at a time."""
    forward, skew_reverse = ForwardKL(), SkewReverseKL(skew_alpha=skew_alpha)
    parts = []
    for start in range(0, teacher_logits.shape[0], chunk_size):
        t = teacher_logits[start : start + chunk_size].float()
        s = student_logits[start : start + chunk_size].float()
        log_p, log_q = F.log_softmax(t, dim=-1), F.log_softmax(s, dim=-1)
        same = (t.argmax(dim=-1) == s.argmax(dim=-1)).float()
        parts.append(torch.stack([forward.divergence(log_p, log_q), skew_reverse.divergence(log_p, log_q), same]))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.float64)
    return torch.cat(parts, dim=1).double()


@torch.inference_mode()
def agreement_of_sequences(
    teacher: PreTrainedModel,
    students: Sequence[PreTrainedModel],
    sequences: Sequence[ScoredSequence],
    pad_id: int,
    *,
    batch_size: int = 8,
    skew_alpha: float = 0.1,
    chunk_size: int = 256,
    reporter: Reporter | None = None,
) -> list[AgreementRows]:
    """One :class:`AgreementRows` per student over ``sequences`` (rows in their given order)."""
    reporter = reporter or SilentReporter()
    sums = torch.zeros(len(students), 3, len(sequences), dtype=torch.float64)
    counts = torch.zeros(len(sequences), dtype=torch.float64)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].input_ids))
    for start in range(0, len(order), batch_size):
        picked = order[start : start + batch_size]
        input_ids, attention_mask, labels = right_pad([sequences[i] for i in picked], pad_id, teacher.device)
        scored = labels[:, 1:] != IGNORE  # position t predicts token t + 1
        rows = torch.tensor(picked, dtype=torch.long).unsqueeze(1).expand_as(scored)[scored.cpu()]
        counts.index_add_(0, rows, torch.ones(rows.shape[0], dtype=torch.float64))
        teacher_logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1][scored]
        for index, student in enumerate(students):
            student_logits = student(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1][scored]
            values = position_agreement(teacher_logits, student_logits, skew_alpha=skew_alpha, chunk_size=chunk_size)
            sums[index].index_add_(1, rows, values.cpu())
        reporter.advance(len(picked), tokens=int(attention_mask.sum()) * (1 + len(students)))
    means = (sums / counts.clamp(min=1)).numpy()
    tokens = counts.numpy()
    return [
        AgreementRows(fkl=means[i, 0], srkl=means[i, 1], top1=means[i, 2], tokens=tokens.copy())
        for i in range(len(students))
    ]


def teacher_agreement(
    teacher: tuple[PreTrainedModel, PreTrainedTokenizerBase],
    students: Mapping[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]],
    rows: Sequence[EvalRow],
    *,
    max_prompt_length: int = 256,
    max_response_length: int = 256,
    batch_size: int = 8,
    skew_alpha: float = 0.1,
    reporter: Reporter | None = None,
    description: str = "teacher agreement",
) -> dict[str, AgreementRows]:
    """``{student label: AgreementRows}`` on ``rows``' first references; ``teacher`` and each
    student as ``(model, tokenizer)``, all sharing one tokenizer (else an error naming them)."""
    from mta.models.tokenizers import tokenizer_fingerprint

    teacher_model, tokenizer = teacher
    wanted = tokenizer_fingerprint(tokenizer)
    other = [label for label, (_, t) in students.items() if tokenizer_fingerprint(t) != wanted]
    if other:
        raise MtaError(
            f"teacher agreement compares next-token distributions over one vocabulary; {', '.join(other)} "
            "use(s) another tokenizer than the teacher: measure students of the teacher's tokenizer only"
        )
    sequences, pad_id = scoring_sequences(tokenizer, rows, max_prompt_length, max_response_length)
    reporter = reporter or SilentReporter()
    reporter.start(description, len(sequences), unit="rows")
    try:
        found = agreement_of_sequences(
            teacher_model,
            [model for model, _ in students.values()],
            sequences,
            pad_id,
            batch_size=batch_size,
            skew_alpha=skew_alpha,
            reporter=reporter,
        )
    finally:
        reporter.stop()
    return dict(zip(students, found, strict=True))


__all__ = [
    "MEASURES",
    "AgreementRows",
    "agreement_of_sequences",
    "position_agreement",
    "teacher_agreement",
]
