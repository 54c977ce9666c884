"""The teacher's hidden states for a batch: from the teacher model, or from an ``mta teacher`` cache
built from the same annotations (the layers it holds only)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mta.data.annotations import Annotations
from mta.errors import MtaError


class TeacherSide:
    """Hidden states of the teacher for a batch: ``layers`` and ``hidden(batch)`` -> {layer: [B, T, d]}."""

    layers: list[int]
    hidden_size: int
    description: dict[str, Any]

    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_ids: Sequence[str]
    ) -> dict[int, torch.Tensor]:
        raise NotImplementedError


class ModelTeacher(TeacherSide):
    def __init__(self, model: Any, description: dict[str, Any]):
        self.model = model
        self.layers = list(range(model.config.num_hidden_layers + 1))
        self.hidden_size = int(model.config.hidden_size)
        self.description = description

    @torch.no_grad()
    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_ids: Sequence[str]
    ) -> dict[int, torch.Tensor]:
        states = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        return {layer: state.float() for layer, state in enumerate(states)}


class CachedTeacherSide(TeacherSide):
    """The teacher layers an ``mta teacher`` cache holds, for the annotations it was built from."""

    def __init__(self, directory: Path, annotations: Annotations):
        from mta.training.teacher_cache.content import CONTENT_KEYS, teacher_tokens_fingerprint
        from mta.training.teacher_cache.read import TeacherCache, read_cache_manifest

        manifest = read_cache_manifest(directory, "--teacher-cache: ")
        # Everything as stored, but the teacher tokens of these annotations and no logits:
        # a cache of other annotations is refused naming data.train / data.dev.
        expected = {key: manifest.get(key) for key in CONTENT_KEYS}
        expected.update(
            teacher_weights=None, logits=False, teacher_tokens=teacher_tokens_fingerprint(annotations.table)
        )
        try:
            self.cache = TeacherCache(directory, expected)
        except MtaError as error:
            raise MtaError(
                f"--teacher-cache {directory} was not built from {annotations.directory} (give the split "
                f"directory of the cache built from these annotations, e.g. DIR/dev): {error}"
            ) from error
        self.layers = list(self.cache.stored_layers)
        self.cache.layers = self.layers
        self.hidden_size = self.cache.hidden_size
        self.description = {"teacher_cache": str(directory), "layers": self.layers, "teacher": manifest.get("teacher")}

    @torch.no_grad()
    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_ids: Sequence[str]
    ) -> dict[int, torch.Tensor]:
        from mta.training.batching import TokenBatch, TrainBatch

        side = TokenBatch(input_ids, attention_mask, input_ids)
        output = self.cache.outputs(TrainBatch(list(row_ids), side, side, {}))
        return dict(output.hidden_states)


__all__ = ["CachedTeacherSide", "ModelTeacher", "TeacherSide"]
