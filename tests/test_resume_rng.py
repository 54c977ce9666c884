"""A resume gives the torch CPU generator back exactly as the checkpoint found it, so dropout
after the resume draws what an uninterrupted run would have drawn (``TrainerState.rng``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from fixtures.checkpoints import student_recipe, train_step
from mta.training.lifecycle.checkpointing import TrainerState, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def test_load_checkpoint_restores_the_torch_rng_state(tmp_path, tiny_model_dir, new_engine):
    recipe = student_recipe(tmp_path, tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    original = new_engine(recipe)
    train_step(original, 1)
    torch.manual_seed(1234)
    torch.rand(7)  # a generator state no seed call gives
    path = save_checkpoint(original, tokenizer, recipe, tmp_path / "out", TrainerState(1, 8, run_id="r"))
    saved = torch.get_rng_state()
    expected_draw = torch.rand(16)  # what the run draws next (its dropout masks)

    torch.manual_seed(99)  # the resumed process starts from another state, and builds an engine
    resumed = new_engine(recipe)
    assert not torch.equal(torch.get_rng_state(), saved)
    load_checkpoint(resumed, path)
    assert torch.equal(torch.get_rng_state(), saved)
    assert torch.equal(torch.rand(16), expected_draw)
