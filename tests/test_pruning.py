"""Layer-pruned students: block choice, weights copied block for block, reload, errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from mta.errors import MtaError
from mta.models.pruning import (
    INIT_RECORD,
    decoder_blocks,
    evenly_spaced,
    first_and_last,
    init_student,
    prune_layers,
)
from mta.models.tiny import build_tiny_model
from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
IN_MEMORY_CONFIGS = {
    "llama": dict(num_hidden_layers=5, **SIZES),
    "mistral": dict(num_hidden_layers=5, **SIZES),
    "qwen2": dict(num_hidden_layers=5, **SIZES),
    "gpt2": dict(n_layer=5, n_embd=32, n_head=4),
    "opt": dict(num_hidden_layers=5, hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32),
}


def random_model(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=97, **IN_MEMORY_CONFIGS[model_type])
    return AutoModelForCausalLM.from_config(config).eval()


def block_state(model: nn.Module, index: int) -> dict[str, torch.Tensor]:
    return decoder_blocks(model)[1][index].state_dict()


def outside_blocks(model: nn.Module) -> dict[str, torch.Tensor]:
    prefix, _ = decoder_blocks(model)
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefix + ".")}


def assert_same_tensors(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


@pytest.mark.parametrize("n", range(1, 40))
def test_evenly_spaced_keeps_ends_and_follows_the_ideal_grid(n):
    for k in range(2, n + 1):
        picked = evenly_spaced(n, k)
        assert picked[0] == 0 and picked[-1] == n - 1
        assert all(a < b for a, b in zip(picked, picked[1:], strict=False))  # consecutive pairs
        # Each index is the ideal fractional position rounded to the nearest block.
        for i, index in enumerate(picked):
            assert abs(index - i * (n - 1) / (k - 1)) <= 0.5


def test_block_choices_for_the_demo_teacher():
    assert evenly_spaced(30, 10) == [0, 3, 6, 10, 13, 16, 19, 23, 26, 29]
    assert first_and_last(30, 5) == [0, 1, 2, 28, 29]
    assert first_and_last(4, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("k", [0, 31, -2])
def test_layer_count_out_of_range_names_the_valid_range(k):
    with pytest.raises(MtaError, match="between 1 and 30"):
        evenly_spaced(30, k)


@pytest.mark.parametrize("model_type", sorted(IN_MEMORY_CONFIGS))
def test_pruned_blocks_are_the_kept_source_blocks(model_type):
    teacher = random_model(model_type)
    keep = [0, 2, 4]
    student = prune_layers(teacher, keep)
    assert student.config.num_hidden_layers == 3
    assert len(decoder_blocks(student)[1]) == 3
    for position, index in enumerate(keep):
        assert_same_tensors(block_state(student, position), block_state(teacher, index))
    assert_same_tensors(outside_blocks(student), outside_blocks(teacher))


@pytest.mark.parametrize("model_type", sorted(IN_MEMORY_CONFIGS))
def test_keeping_every_layer_reproduces_the_teacher_logits_exactly(model_type):
    teacher = random_model(model_type)
    student = prune_layers(teacher, list(range(5))).eval()
    input_ids = torch.randint(1, 97, (2, 11))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding exercises the attention mask path too
    with torch.no_grad():
        expected = teacher(input_ids, attention_mask=mask).logits
        assert torch.equal(student(input_ids, attention_mask=mask).logits, expected)


def test_per_layer_config_lists_follow_the_kept_blocks():
    types = ["full_attention", "sliding_attention"] * 2 + ["full_attention"]
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=97,
        num_hidden_layers=5,
        layer_types=types,
        use_sliding_window=True,
        sliding_window=4,
        **SIZES,
    )
    teacher = AutoModelForCausalLM.from_config(config)
    student = prune_layers(teacher, [1, 2, 4])
    assert student.config.layer_types == ["sliding_attention", "full_attention", "full_attention"]
    kept_types = [block.self_attn.layer_type for block in decoder_blocks(student)[1]]
    assert kept_types == student.config.layer_types


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2"])
def test_init_student_writes_a_plain_reloadable_checkpoint(model_type, tiny_tokenizer_dir, tmp_path):
    source = build_tiny_model(tiny_tokenizer_dir, tmp_path / "teacher", model_type=model_type, num_layers=4)
    record = init_student(source, tmp_path / "student", num_layers=2)

    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    teacher = AutoModelForCausalLM.from_pretrained(source)
    assert student.config.num_hidden_layers == 2 and record["kept_layers"] == [0, 3]
    for position, index in enumerate(record["kept_layers"]):
        assert_same_tensors(block_state(student, position), block_state(teacher, index))
    assert_same_tensors(outside_blocks(student), outside_blocks(teacher))

    saved = json.loads((tmp_path / "student" / INIT_RECORD).read_text())
    assert saved == record
    assert saved["source"] == str(source.resolve()) and saved["source_num_layers"] == 4
    assert tokenizer_fingerprint(load_tokenizer(tmp_path / "student")) == tokenizer_fingerprint(load_tokenizer(source))


def test_init_student_refuses_to_overwrite_without_force(tiny_model_dir, tmp_path):
    out = tmp_path / "student"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(MtaError, match="--force"):
        init_student(tiny_model_dir, out, num_layers=2)
    assert (out / "notes.txt").read_text() == "keep me"

    init_student(tiny_model_dir, out, num_layers=3, force=True)
    assert not (out / "notes.txt").exists()
    assert json.loads((out / INIT_RECORD).read_text())["kept_layers"] == [0, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["student"]  # no staging left behind


def test_bad_keep_lists_are_refused():
    teacher = random_model("llama")
    for keep in ([], [2, 1], [0, 0], [0, 5], [-1, 2]):
        with pytest.raises(MtaError, match="distinct, ascending indices in 0..4"):
            prune_layers(teacher, keep)


def test_position_dependent_gpt2_scaling_is_refused():
    config = AutoConfig.for_model("gpt2", vocab_size=97, n_layer=3, n_embd=32, n_head=4)
    config.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(MtaError, match="scale_attn_by_inverse_layer_idx"):
        prune_layers(AutoModelForCausalLM.from_config(config), [0, 2])


def test_unsupported_architectures_are_named():
    t5 = AutoConfig.for_model("t5", vocab_size=97, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
    from transformers import T5ForConditionalGeneration

    with pytest.raises(MtaError, match="encoder-decoder"):
        prune_layers(T5ForConditionalGeneration(t5), [0])

    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = AutoConfig.for_model("llama", num_hidden_layers=2)
            self.left = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.right = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    with pytest.raises(MtaError, match="candidates: left, right"):
        decoder_blocks(TwoStacks())


def test_init_student_on_a_non_causal_checkpoint_says_so(tmp_path):
    AutoConfig.for_model("t5", d_model=32, num_layers=2).save_pretrained(tmp_path)
    with pytest.raises(MtaError, match="cannot load .* as a causal LM"):
        init_student(tmp_path, tmp_path / "student", num_layers=1)


def test_cli_init_student(tiny_model_dir, tmp_path):
    from mta_cli.main import app

    def init(*options: str):
        return CliRunner().invoke(app, ["init-student", "--from", str(tiny_model_dir), *options])

    result = init("--layers", "2", "--pick", "first-last", "-o", str(tmp_path / "a"))
    assert result.exit_code == 0, result.output
    assert "[0, 3]" in result.output
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "a").config.num_hidden_layers == 2

    explicit = init("--keep", "1,2", "-o", str(tmp_path / "b"))
    assert explicit.exit_code == 0, explicit.output
    record = json.loads((tmp_path / "b" / INIT_RECORD).read_text())
    assert (record["kept_layers"], record["pick"]) == ([1, 2], "explicit")

    for options, message in [
        (("--layers", "9"), "between 1 and 4"),
        (("--layers", "2", "--keep", "0,1"), "not both"),
        (("--layers", "2", "--pick", "middle"), "evenly, first-last"),
        (("--keep", "0,x"), "block indices such as"),
    ]:
        failed = init(*options, "-o", str(tmp_path / "c"))
        assert isinstance(failed.exception, MtaError), options
        assert message in str(failed.exception)
        assert not (tmp_path / "c").exists()
