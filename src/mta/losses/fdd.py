"""FDD (feature dynamics distillation) through the logit lens: a trajectory and a dynamics term.

For K layer pairs in depth order, logits ``zS_k = student_lens(hS_k)``, ``zT_k = teacher_lens(hT_k)``
over ``[0, V)`` (the caller composes each lens), T the temperature::

    trajectory = 1/K · Σ_k mean_tokens KL(softmax(zT_k / T) ‖ softmax(zS_k / T))    (no T²)
    dynamics   = 1/(K−1) · Σ_{k≥2} mean_tokens [1 − cos(ΔS_k, ΔT_k)],
                 Δ_k = log_softmax(z_k) − log_softmax(z_{k−1}) at temperature 1, torch's ε = 1e-5
    fdd        = trajectory_weight · trajectory + dynamics_weight · dynamics

``mean_tokens`` pools the masked positions over the batch; K = 1 gives dynamics 0. Visited
``chunk_size`` positions at a time under ``torch.utils.checkpoint``, so peak extra memory is a few
fp32 ``[chunk_size, V]`` buffers per pair. Against the authors' code: docs/method.md §5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mta.errors import MtaError

# hidden [n, d] -> logits [n, V'] (the caller composes final norm + LM head)
Lens = Callable[[torch.Tensor], torch.Tensor]

# The authors' ``F.cosine_similarity(..., eps=1e-5)``: each norm is clamped to at least this.
COSINE_EPS = 1e-5


class FeatureDynamicsLoss(nn.Module):
    """FDD's logit-lens trajectory KL and log-probability dynamics cosine over K layer pairs.

    temperature: T of the trajectory KL (the dynamics term always uses temperature 1, as the
    authors do). vocab_size: compare logits on ``[0, vocab_size)``, the tokenizer's real
    vocabulary (default: the smaller of the two lens widths). chunk_size: masked positions per
    fp32 chunk. trajectory_weight, dynamics_weight: the weights of the two terms in ``"fdd"``.
    """

    def __init__(
        self,
        *,
        temperature: float = 2.0,
        vocab_size: int | None = None,
        chunk_size: int = 128,
        trajectory_weight: float = 1.0,
        dynamics_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise MtaError(f"fdd temperature must be positive, got {temperature}")
        if vocab_size is not None and vocab_size < 1:
            raise MtaError(f"vocab_size must be at least 1, got {vocab_size}")
        if chunk_size < 1:
            raise MtaError(f"chunk_size must be at least 1, got {chunk_size}")
        for name, weight in (("trajectory_weight", trajectory_weight), ("dynamics_weight", dynamics_weight)):
            if not weight >= 0:
                raise MtaError(f"fdd {name} must be non-negative, got {weight}")
        self.temperature = float(temperature)
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size
        self.trajectory_weight = float(trajectory_weight)
        self.dynamics_weight = float(dynamics_weight)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, vocab_size={self.vocab_size}, chunk_size={self.chunk_size}, "
            f"trajectory_weight={self.trajectory_weight}, dynamics_weight={self.dynamics_weight}"
        )

    def forward(
        self,
        student_states: Sequence[torch.Tensor],
        teacher_states: Sequence[torch.Tensor],
        student_lens: Lens,
        teacher_lens: Lens,
        mask: torch.Tensor,
        num_positions: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """student_states: K tensors ``[batch, seq, d_s]``, the student's hidden states at the K
        pair layers in order of depth; teacher_states: K tensors ``[batch, seq, d_t]``, the same
        order. student_lens / teacher_lens: hidden ``[n, d]`` -> logits ``[n, V']``; each gets its
        side's hidden states in their own dtype, and its logits are cast to fp32 per chunk. The
        teacher lens always runs under ``no_grad``; gradients reach the student's states and the
        parameters inside ``student_lens``, never the teacher. mask: ``[batch, seq]`` bool (or 0/1
        integers), the positions that count. num_positions (optional, > 0): divide the sums over
        the positions by this (the masked positions of the whole global batch) instead of by this
        batch's, so micro batches add up to the global batch's mean.

        Returns fp32 scalars ``{"fdd_trajectory", "fdd_dynamics", "fdd"}`` (all 0, with zero
        gradients, when the mask selects no position; ``fdd_dynamics`` is 0 when K = 1).
        """
        student_states, teacher_states = list(student_states), list(teacher_states)
        mask = self._check(student_states, teacher_states, mask)
        if num_positions is not None and not num_positions > 0:
            raise MtaError(f"num_positions must be positive (the global batch's positions), got {num_positions}")
        pairs = len(student_states)

        rows, columns = mask.nonzero(as_tuple=True)
        num_tokens = rows.numel()
        # One gather per pair, then views of it: split's backward concatenates the chunk
        # gradients once instead of writing a full-size zero tensor per chunk.
        student_chunks = [state[rows, columns].split(self.chunk_size) for state in student_states]
        with torch.no_grad():
            teacher_chunks = [state.detach()[rows, columns].split(self.chunk_size) for state in teacher_states]

        terms = partial(self._chunk_terms, student_lens, teacher_lens, pairs)
        device = student_states[0].device
        trajectory = torch.zeros((), dtype=torch.float32, device=device)
        dynamics = torch.zeros((), dtype=torch.float32, device=device)
        # An empty mask still visits one empty chunk, so every student input gets a zero gradient.
        for chunk in zip(*student_chunks, *teacher_chunks, strict=True):
            if torch.is_grad_enabled():
                chunk_trajectory, chunk_dynamics = checkpoint(terms, *chunk, use_reentrant=False)
            else:
                chunk_trajectory, chunk_dynamics = terms(*chunk)
            trajectory = trajectory + chunk_trajectory
            dynamics = dynamics + chunk_dynamics

        tokens = max(num_tokens, 1) if num_positions is None else num_positions
        trajectory = trajectory / (tokens * pairs)
        dynamics = dynamics / (tokens * (pairs - 1)) if pairs > 1 else dynamics
        return {
            "fdd_trajectory": trajectory,
            "fdd_dynamics": dynamics,
            "fdd": self.trajectory_weight * trajectory + self.dynamics_weight * dynamics,
        }

    def _chunk_terms(
        self, student_lens: Lens, teacher_lens: Lens, pairs: int, *hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk, all pairs: ``hidden`` is K student ``[c, d_s]`` then K teacher ``[c, d_t]``
        rows. Returns the chunk's sums (over positions and pairs) of the two terms, fp32."""
        trajectory_sums: list[torch.Tensor] = []  # one per pair
        dynamics_sums: list[torch.Tensor] = []  # one per pair after the first
        previous: tuple[torch.Tensor, torch.Tensor] | None = None
        for student_hidden, teacher_hidden in zip(hidden[:pairs], hidden[pairs:], strict=True):
            student_logits = student_lens(student_hidden)
            with torch.no_grad():
                teacher_logits = teacher_lens(teacher_hidden)
            vocab = self._vocab(student_logits, teacher_logits)
            # [c, vocab] fp32: dim 1 is the vocabulary.
            student = student_logits[:, :vocab].float()
            log_q = (student / self.temperature).log_softmax(dim=1)
            student_log = student.log_softmax(dim=1)
            with torch.no_grad():
                teacher = teacher_logits[:, :vocab].float()
                log_p = (teacher / self.temperature).log_softmax(dim=1)
                teacher_log = teacher.log_softmax(dim=1)
            trajectory_sums.append((log_p.exp() * (log_p - log_q)).sum())
            if previous is not None:
                student_change = student_log - previous[0]
                teacher_change = teacher_log - previous[1]
                cosine = F.cosine_similarity(student_change, teacher_change, dim=1, eps=COSINE_EPS)
                dynamics_sums.append((1.0 - cosine).sum())
            previous = (student_log, teacher_log)
        trajectory = torch.stack(trajectory_sums).sum()
        dynamics = torch.stack(dynamics_sums).sum() if dynamics_sums else torch.zeros_like(trajectory)
        return trajectory, dynamics

    def _vocab(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> int:
        for side, logits in (("student", student_logits), ("teacher", teacher_logits)):
            if logits.dim() != 2:
                raise MtaError(f"the {side} lens must return [n, vocab] logits, got {tuple(logits.shape)}")
        width = min(student_logits.shape[1], teacher_logits.shape[1])
        vocab = self.vocab_size or width
        if vocab > width:
            raise MtaError(
                f"vocab_size {vocab} exceeds the lens logits width {width}; pass the tokenizer's real vocabulary size"
            )
        return vocab

    @staticmethod
    def _check(
        student_states: list[torch.Tensor], teacher_states: list[torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        if not student_states:
            raise MtaError("fdd needs at least one (student layer, teacher layer) pair; got none")
        if len(student_states) != len(teacher_states):
            raise MtaError(
                f"fdd got {len(student_states)} student and {len(teacher_states)} teacher hidden "
                f"states; give one of each per layer pair"
            )
        if mask.dim() != 2:
            raise MtaError(f"fdd mask must be [batch, seq], got {tuple(mask.shape)}")
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise MtaError(f"fdd mask must be bool (or 0/1 integers), got {mask.dtype}")
        for side, states in (("student", student_states), ("teacher", teacher_states)):
            for index, state in enumerate(states):
                if state.dim() != 3 or tuple(state.shape[:2]) != tuple(mask.shape):
                    raise MtaError(
                        f"fdd {side} hidden state {index} is {tuple(state.shape)}; expected "
                        f"[batch, seq, dim] over the mask's {tuple(mask.shape)} positions"
                    )
        return mask != 0


__all__ = ["COSINE_EPS", "FeatureDynamicsLoss"]
