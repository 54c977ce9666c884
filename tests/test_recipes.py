"""Recipes: every shipped file validates, overrides behave like the file, bad recipes say why."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import MINIMAL_RECIPE
from fixtures.recipes import error_of, write
from mta.errors import MtaError
from mta.training.config.deepspeed_settings import deepspeed_setting_names
from mta.training.config.loading import load_recipe, recipe_to_yaml
from mta.training.config.model_checks import check_sequence_lengths, position_limit
from mta.training.config.schema import LayerPair

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

MINIMAL = MINIMAL_RECIPE.format(teacher="teacher-model", student="student-model")


def test_the_repository_ships_the_paper_recipes():
    names = {path.name for path in RECIPES}
    assert {"gpt2.yaml", "qwen.yaml", "opt.yaml", "cross-tokenizer.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_every_recipe_loads_validates_and_round_trips(path, tmp_path):
    recipe = load_recipe(path)
    assert recipe.source == str(path)
    assert recipe.train.batch_size % recipe.train.micro_batch_size == 0
    # The resolved recipe saved beside checkpoints loads back to the same recipe.
    saved = write(tmp_path, recipe_to_yaml(recipe), path.name)
    assert load_recipe(saved).model_dump(exclude={"source"}) == recipe.model_dump(exclude={"source"})


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_every_recipe_starts_with_a_header_comment(path):
    assert path.read_text(encoding="utf-8").startswith("# ")


PUBLISHED = {
    # file: (teacher, student, base, dsa, hra, (student, teacher, granularity) triples)
    "gpt2.yaml": (
        "MiniLLM/teacher-gpt2-1.5B",
        "gpt2",
        "srkl",
        2.0,
        0.2,
        [(6, 24, "word"), (9, 36, "phrase"), (12, 48, "phrase")],
    ),
    "qwen.yaml": (
        "VoCuc/Qwen1.5_1.8B_SFT",
        "Qwen/Qwen1.5-0.5B",
        "srkl",
        2.0,
        0.2,
        [(14, 14, "word")] + [(layer, layer, "phrase") for layer in (16, 18, 20, 22, 24)],
    ),
    "opt.yaml": (
        "MiniLLM/SFT-OPT-6.7B",
        "facebook/opt-1.3b",
        "srkl",
        3.0,
        0.3,
        [(16, 20, "word"), (18, 23, "phrase"), (20, 26, "phrase"), (22, 29, "phrase"), (24, 32, "phrase")],
    ),
    "cross-tokenizer.yaml": ("VoCuc/Qwen1.5_1.8B_SFT", "gpt2", "ce", 2.0, 0.2, "auto"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_paper_recipes_carry_the_published_setting(name):
    teacher, student, base, dsa, hra, layers = PUBLISHED[name]
    recipe = load_recipe(REPO / "recipes" / name)
    assert (recipe.teacher.path, recipe.student.path) == (teacher, student)
    assert (recipe.loss.base, recipe.loss.dsa_weight, recipe.loss.hra_weight) == (base, dsa, hra)
    expected = layers if layers == "auto" else [LayerPair(student=s, teacher=t, granularity=g) for s, t, g in layers]
    assert recipe.loss.layers == expected
    # DistiLLM-base hyper-parameters (docs/method.md §5).
    train = recipe.train
    # OPT trains a LoRA student, as the authors' scripts (--peft lora, r 16, alpha 64, dropout
    # 0.1, peft's OPT default q_proj / v_proj; lr 5e-4); the others fine-tune every weight.
    lora = recipe.student.lora
    if name.startswith("opt"):
        assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (16, 64, 0.1, ["q_proj", "v_proj"])
    else:
        assert lora is None
    lr = 5e-4 if lora is not None else 1e-4
    assert (train.epochs, train.lr, train.batch_size, train.schedule) == (5, lr, 16, "cosine")
    if base == "srkl":  # the published numbers' checkpoint choice: dev ROUGE-L at each epoch
        assert (train.select_by, train.select_rows) == ("rouge", 500)
    assert (train.weight_decay, train.grad_clip, train.projector_lr) == (0.01, 1.0, 5e-4)
    # The paper's rows keep the authors' per-micro-batch means; the added setting takes the default.
    assert train.loss_reduction == ("global" if name == "cross-tokenizer.yaml" else "micro_batch")
    assert (train.precision, train.zero_stage, recipe.seed) == ("bf16", 1, 42)
    assert (recipe.data.max_length, recipe.data.max_prompt_length) == (256, 128)
    assert "${MTA_DATA_DIR}" in recipe.data.train and recipe.data.dev.endswith("dev.jsonl")
    assert recipe.resolve(recipe.student.config).is_file()
    assert recipe.resolve(recipe.teacher.config).is_file()
    # DistiLLM's adaptive off-policy sampling, as the authors' span scripts run it; across
    # tokenizers there are no teacher logits to compare on generated text.
    off_policy = recipe.off_policy
    if base == "srkl":
        assert (off_policy.mode, off_policy.schedule, off_policy.init_threshold) == ("adaptive", "decreasing", 0.0)
        assert (off_policy.loss_eps, off_policy.threshold_step, off_policy.buffer_size) == (0.1, 0.1, 1000)
        assert off_policy.max_new_tokens is None and recipe.off_policy_max_new_tokens == 128
        assert off_policy.dev_rows is None  # the whole dev split: DistiLLM's --dev-num 1000
        # The threshold moves at dev evaluations: once per epoch of Dolly's 9,568 rows (598 steps
        # of 16), as the scripts' --eval-interval -1.
        assert train.eval_interval == 9568 // 16 == train.save_interval
    else:
        assert off_policy.mode == "off"


# --- overrides ---------------------------------------------------------------------------


def test_override_sets_a_value_parsed_as_yaml(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["train.lr=5e-5", "loss.base=rkl"])
    assert recipe.train.lr == 5e-5 and isinstance(recipe.train.lr, float)
    assert recipe.loss.base == "rkl"


def test_override_creates_nested_keys_and_indexes_lists(tmp_path):
    recipe = load_recipe(
        write(tmp_path, MINIMAL),
        [
            "deepspeed.zero_optimization.offload_optimizer.device=cpu",
            "loss.layers=[[2, 4, word], [4, 8, phrase]]",
            "loss.layers.1=[4, 7, phrase]",
        ],
    )
    assert recipe.deepspeed == {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert recipe.loss.layers == [
        LayerPair(student=2, teacher=4, granularity="word"),
        LayerPair(student=4, teacher=7, granularity="phrase"),
    ]


def test_override_indexes_into_the_layer_list_of_a_file():
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml", ["loss.layers.2.1=47"])
    assert recipe.loss.layers[2] == LayerPair(student=12, teacher=47, granularity="phrase")


def test_later_override_wins_and_null_removes_the_teacher(tmp_path):
    recipe = load_recipe(
        write(tmp_path, MINIMAL),
        ["train.lr=1e-3", "train.lr=2e-3", "teacher=null", "loss.base=ce", "loss.dsa_weight=0", "loss.hra_weight=0"],
    )
    assert recipe.train.lr == 2e-3 and recipe.teacher is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr", "not of the form key.path=value"),
        ("=5", "not of the form key.path=value"),
        ("train..lr=5", "not of the form key.path=value"),
        ("train.lr=[1,", "not valid YAML"),
        ("train.max_steps.value=1", "train.max_steps is a value, not a mapping"),
        ("loss.layers=[[1, 2, word]]", None),
    ],
)
def test_bad_override_syntax_is_an_error(tmp_path, override, message):
    if message is None:  # a list that exists, indexed past its end
        override, message = "loss.layers.3.0=1", "loss.layers.3 indexes a list of 3 items"
        assert message in error_of(REPO / "recipes" / "gpt2.yaml", (override,))
        return
    assert message in error_of(write(tmp_path, MINIMAL), (override,))


def test_override_of_an_unknown_key_is_named_as_coming_from_the_override(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ("train.lrr=1",))
    assert "train.lrr: unknown key" in message
    assert "from override 'train.lrr=1'" in message
    assert "lr, projector_lr" in message  # the allowed keys of train:


# --- bad recipes -------------------------------------------------------------------------


def test_unknown_key_names_the_line_the_key_and_the_allowed_keys(tmp_path):
    text = MINIMAL.replace("  base: fkl\n", "  base: fkl\n  dsa_wieght: 1.0\n")
    message = error_of(write(tmp_path, text))
    line = text.splitlines().index("  dsa_wieght: 1.0") + 1
    assert str(tmp_path / "recipe.yaml") in message
    assert f"line {line}: loss.dsa_wieght: unknown key" in message
    assert "dsa_weight" in message and "hra_weight" in message


def test_unknown_top_level_section_lists_the_sections(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "optimiser:\n  lr: 1\n"))
    assert "optimiser: unknown key" in message
    for section in ("teacher", "student", "data", "loss", "train", "deepspeed"):
        assert section in message


def test_wrong_literal_lists_the_allowed_values(tmp_path):
    message = error_of(write(tmp_path, MINIMAL.replace("base: fkl", "base: kl")))
    assert "loss.base: 'kl' is not allowed" in message
    for name in ("'ce'", "'fkl'", "'rkl'", "'skl'", "'srkl'", "'jsd'", "'tvd'"):
        assert name in message


def test_loss_reduction_is_global_or_micro_batch_and_reference_code_needs_micro_batch(tmp_path):
    assert load_recipe(write(tmp_path, MINIMAL)).train.loss_reduction == "global"
    text = MINIMAL.replace("  micro_batch_size: 2\n", "  micro_batch_size: 2\n  loss_reduction: tokens\n")
    message = error_of(write(tmp_path, text))
    line = text.splitlines().index("  loss_reduction: tokens") + 1
    assert f"line {line}: train.loss_reduction: 'tokens' is not allowed" in message
    assert "'global'" in message and "'micro_batch'" in message
    text = MINIMAL.replace("  base: fkl\n", "  base: fkl\n  reference_code: true\n")
    message = error_of(write(tmp_path, text))
    line = text.splitlines().index("  reference_code: true") + 1
    assert f"line {line}: loss.reference_code" in message and "train.loss_reduction=micro_batch" in message
    fixed = text.replace("  micro_batch_size: 2\n", "  micro_batch_size: 2\n  loss_reduction: micro_batch\n")
    assert load_recipe(write(tmp_path, fixed)).loss.reference_code


def test_bad_layer_triples_are_named_by_index(tmp_path):
    layers = "  layers:\n    - [6, 24, word]\n    - [9, 36, phrases]\n    - [12, 48]\n"
    text = MINIMAL.replace("  base: fkl\n", "  base: fkl\n" + layers)
    message = error_of(write(tmp_path, text))
    assert "loss.layers.1.granularity: 'phrases' is not allowed; use one of 'word' or 'phrase'" in message
    assert "loss.layers.2: write a layer pair as [student, teacher, word|phrase]" in message
    assert "'auto'" not in message  # the other branch of the union is not reported


def test_layers_other_than_auto_or_a_list(tmp_path):
    text = MINIMAL.replace("  base: fkl\n", "  base: fkl\n  layers: automatic\n")
    message = error_of(write(tmp_path, text))
    assert "loss.layers: 'automatic' is not allowed; use one of 'auto'" in message


def test_missing_training_length_names_both_keys(tmp_path):
    message = error_of(write(tmp_path, MINIMAL.replace("  max_steps: 10\n", "")))
    assert "train.epochs" in message and "train.max_steps" in message


def test_both_training_lengths_is_an_error(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ("train.epochs=2",))
    assert "exactly one of train.epochs and train.max_steps" in message


def test_batch_not_divisible_by_the_micro_batch(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ("train.micro_batch_size=3",))
    assert "batch_size 4 is not a multiple of micro_batch_size 3" in message


def test_global_batch_that_cannot_be_split_over_the_world(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert recipe.train.accumulation_steps(1) == 2
    assert recipe.train.accumulation_steps(2) == 1
    with pytest.raises(MtaError, match="micro_batch_size to a divisor of 1"):
        recipe.train.accumulation_steps(4)
    with pytest.raises(MtaError, match="train.batch_size that is a multiple of 3"):
        recipe.train.accumulation_steps(3)


def test_missing_required_key_and_wrong_type(tmp_path):
    message = error_of(write(tmp_path, MINIMAL.replace("  train: train.jsonl\n", "  dev: d\n")))
    assert "data.train: required key is missing" in message
    message = error_of(write(tmp_path, MINIMAL), ("train.lr=fast",))
    assert "train.lr:" in message and "'fast'" in message


def test_logit_loss_without_a_teacher(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ("teacher=null",))
    assert "loss.base=fkl needs a teacher" in message


def test_student_dtype_must_fit_the_training_precision(tmp_path):
    path = write(tmp_path, MINIMAL)
    message = error_of(path, ("student.dtype=bf16", "train.precision=fp32"))
    assert "student.dtype=bf16 cannot train with train.precision=fp32" in message
    assert load_recipe(path, ["student.dtype=fp32", "train.precision=bf16"]).student.dtype == "fp32"


def test_not_a_mapping_and_not_yaml(tmp_path):
    assert "a recipe is a YAML mapping" in error_of(write(tmp_path, "- just\n- a list\n"))
    assert "not valid YAML" in error_of(write(tmp_path, "name: [unclosed\n"))
    assert "recipe file not found" in error_of(tmp_path / "absent.yaml")


# --- deepspeed passthrough ---------------------------------------------------------------


def test_deepspeed_settings_the_schema_does_not_model_pass_through_verbatim(tmp_path):
    settings = {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
        "activation_checkpointing": {"partition_activations": True},
        "wall_clock_breakdown": False,
    }
    text = MINIMAL + yaml.safe_dump({"deepspeed": settings})
    assert load_recipe(write(tmp_path, text)).deepspeed == settings


@pytest.mark.parametrize(
    "override, recipe_key",
    [
        ("deepspeed.train_batch_size=32", "train.batch_size"),
        ("deepspeed.gradient_accumulation_steps=4", "train.batch_size"),
        ("deepspeed.zero_optimization.stage=3", "train.zero_stage"),
        ("deepspeed.bf16.enabled=true", "train.precision"),
        ("deepspeed.gradient_clipping=0.5", "train.grad_clip"),
    ],
)
def test_deepspeed_keys_the_recipe_owns_are_refused(tmp_path, override, recipe_key):
    message = error_of(write(tmp_path, MINIMAL), (override,))
    key = override.split("=")[0]
    assert key.removesuffix(".enabled") + ": set by the recipe from " in message
    assert recipe_key in message
    assert f"(from override {override!r})" in message


def test_deepspeed_setting_names_come_from_the_installed_deepspeed():
    names = deepspeed_setting_names()
    assert names is not None
    assert {
        "zero_optimization",
        "activation_checkpointing",
        "communication_data_type",
        "flops_profiler",
        "wall_clock_breakdown",
        "train_batch_size",
    } <= names
    assert "zero_optimisation" not in names and "stage" not in names


def test_a_misspelt_deepspeed_section_is_refused_naming_the_close_match(tmp_path):
    text = MINIMAL + "deepspeed:\n  zero_optimisation:\n    overlap_comm: true\n"
    message = error_of(write(tmp_path, text))
    line = text.splitlines().index("  zero_optimisation:") + 1
    assert f"line {line}: deepspeed.zero_optimisation: not a setting DeepSpeed" in message
    assert "did you mean deepspeed.zero_optimization?" in message
    recipe_key = error_of(write(tmp_path, MINIMAL), ("deepspeed.zero_stage=3",))
    assert "did you mean the recipe key train.zero_stage?" in recipe_key


@pytest.mark.parametrize("value", ["true", "false", "null", "3", "[stage, 3]"])
def test_a_section_the_recipe_owns_part_of_must_be_a_mapping(tmp_path, value):
    # `zero_optimization: true` with train.zero_stage=3 used to run ZeRO-1.
    message = error_of(write(tmp_path, MINIMAL), (f"deepspeed.zero_optimization={value}", "train.zero_stage=3"))
    assert "deepspeed.zero_optimization: must be a mapping of DeepSpeed zero_optimization settings" in message
    assert "train.zero_stage" in message
    assert f"(from override 'deepspeed.zero_optimization={value}')" in message


def test_an_owned_key_inside_a_section_in_the_file_is_named_with_its_line(tmp_path):
    text = MINIMAL + "deepspeed:\n  zero_optimization:\n    overlap_comm: true\n    stage: 3\n"
    message = error_of(write(tmp_path, text))
    assert (
        f"line {len(text.splitlines())}: deepspeed.zero_optimization.stage: set by the recipe from train.zero_stage"
    ) in message


def _deepspeed_still_has_elasticity() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed.elasticity") is not None


@pytest.mark.skipif(_deepspeed_still_has_elasticity(), reason="DeepSpeed < 0.19.8 still reads deepspeed.elasticity")
def test_deepspeed_keys_deepspeed_removed_are_refused_with_its_message(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ("deepspeed.elasticity.enabled=true",))
    assert "deepspeed.elasticity: removed from DeepSpeed" in message
    assert "Elastic training has been removed" in message


def test_the_old_bfloat16_name_is_owned_like_bf16(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ("deepspeed.bfloat16.enabled=true",))
    assert "deepspeed.bfloat16: set by the recipe from train.precision" in message


# --- sequence lengths against the models --------------------------------------------------


class Config:
    """The attributes a Hugging Face config carries, nothing else."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_position_limits_come_from_the_config_under_its_own_name():
    from transformers import AutoConfig

    gpt2 = AutoConfig.from_pretrained(str(REPO / "recipes/configs/gpt2.json"))
    opt = AutoConfig.from_pretrained(str(REPO / "recipes/configs/opt-1.3b.json"))
    assert position_limit(gpt2) == (1024, "n_positions")
    assert position_limit(opt) == (2048, "max_position_embeddings")
    assert position_limit(Config(model_type="rwkv")) is None


def test_a_length_within_the_positions_passes_and_none_means_no_limit(tmp_path):
    data = load_recipe(write(tmp_path, MINIMAL), ["data.max_length=1024"]).data
    check_sequence_lengths(data, Config(n_positions=1024), "student")
    check_sequence_lengths(data, Config(model_type="rwkv"), "teacher")


def test_a_length_past_the_positions_names_the_key_the_model_and_its_limit(tmp_path):
    data = load_recipe(write(tmp_path, MINIMAL), ["data.max_length=100000"]).data
    with pytest.raises(MtaError) as caught:
        check_sequence_lengths(data, Config(max_position_embeddings=2048), "teacher", model="facebook/opt-1.3b")
    assert str(caught.value) == (
        "data.max_length=100,000 is longer than the teacher (facebook/opt-1.3b) has 2,048 positions "
        "(max_position_embeddings in its config); set data.max_length to at most 2,048 (and "
        "data.max_prompt_length below it)"
    )


def test_dev_samples_must_fit_the_student_positions_too(tmp_path):
    data = load_recipe(write(tmp_path, MINIMAL), ["data.max_length=1024", "data.max_prompt_length=1000"]).data
    check_sequence_lengths(data, Config(n_positions=1024), "student", sample_new_tokens=24)
    with pytest.raises(MtaError, match=r"1,000 \+ 48 = 1,048 positions.*at most 24"):
        check_sequence_lengths(data, Config(n_positions=1024), "student", sample_new_tokens=48)


def test_the_dry_run_refuses_a_length_past_either_model(monkeypatch):
    from mta.training.dry_run import plan_run

    monkeypatch.delenv("MTA_DATA_DIR", raising=False)
    gpt2 = REPO / "recipes" / "gpt2.yaml"
    with pytest.raises(MtaError) as caught:
        plan_run(load_recipe(gpt2, ["data.max_length=100000"]))
    assert str(caught.value).startswith(
        f"{gpt2}: data.max_length=100,000 is longer than the student (gpt2) has 1,024 positions "
        "(n_positions in its config)"
    )
    assert plan_run(load_recipe(gpt2)).student.max_positions == 1024


# --- paths -------------------------------------------------------------------------------


def test_environment_variables_in_paths_are_expanded(tmp_path, monkeypatch):
    data = tmp_path / "instruct"
    (data / "dolly").mkdir(parents=True)
    (data / "dolly" / "train.jsonl").write_text("{}\n")
    monkeypatch.setenv("MTA_DATA_DIR", str(data))
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml")
    assert recipe.resolve(recipe.data.train) == data / "dolly" / "train.jsonl"


def test_unset_environment_variable_is_named(monkeypatch):
    monkeypatch.delenv("MTA_DATA_DIR", raising=False)
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml")
    with pytest.raises(MtaError) as caught:
        recipe.resolve(recipe.data.train, key="data.train")
    assert "data.train" in str(caught.value) and "export MTA_DATA_DIR=" in str(caught.value)


def test_relative_paths_resolve_beside_the_recipe_when_they_exist_there(tmp_path, monkeypatch):
    (tmp_path / "recipes" / "configs").mkdir(parents=True)
    (tmp_path / "recipes" / "configs" / "m.json").write_text("{}")
    recipe = load_recipe(write(tmp_path / "recipes", MINIMAL))
    monkeypatch.chdir(tmp_path)
    assert recipe.resolve("configs/m.json") == tmp_path / "recipes" / "configs" / "m.json"
    # Not beside the recipe either (an output directory to create): kept as written.
    assert recipe.resolve("runs/new") == Path("runs/new")
    assert recipe.resolve("~/x") == Path.home() / "x"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_paper_data_paths_match_the_shared_instruct_layout(name, shared, monkeypatch):
    monkeypatch.setenv("MTA_DATA_DIR", str(shared / "data" / "instruct"))
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.resolve(recipe.data.train, "data.train").is_file()
    assert recipe.resolve(recipe.data.dev, "data.dev").is_file()


# --- off-policy sampling (off_policy:) --------------------------------------------------------

GENERATING = MINIMAL.replace("  train: train.jsonl\n", "  train: train.jsonl\n  dev: dev.jsonl\n") + (
    "off_policy:\n  mode: adaptive\n"
)


def test_generation_is_off_by_default_and_its_defaults_are_distillms(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert recipe.off_policy.mode == "off" and recipe.train.save_generated is False
    adaptive = load_recipe(write(tmp_path, GENERATING)).off_policy
    assert (adaptive.init_threshold, adaptive.threshold_step, adaptive.loss_eps) == (0.0, 0.1, 0.1)
    assert (adaptive.schedule, adaptive.buffer_size, adaptive.max_new_tokens) == ("decreasing", 1000, None)


def test_a_bare_yaml_off_is_the_mode_off_and_round_trips(tmp_path):
    recipe = load_recipe(write(tmp_path, GENERATING.replace("mode: adaptive", "mode: off")))
    assert recipe.off_policy.mode == "off"
    saved = write(tmp_path, recipe_to_yaml(recipe), "saved.yaml")
    assert load_recipe(saved).off_policy == recipe.off_policy
    message = error_of(write(tmp_path, GENERATING.replace("mode: adaptive", "mode: on")))
    assert "off_policy.mode: YAML reads on / yes / true as true, which is not a mode" in message


def test_generation_max_new_tokens_defaults_to_the_response_budget(tmp_path):
    path = write(tmp_path, GENERATING)
    assert load_recipe(path).off_policy_max_new_tokens == 256 - 128
    assert load_recipe(path, ["off_policy.max_new_tokens=64"]).off_policy_max_new_tokens == 64
    message = error_of(path, ("off_policy.max_new_tokens=129",))
    assert "off_policy.max_new_tokens: 129 new tokens after a prompt of up to data.max_prompt_length=128" in message
    assert "use at most 128" in message


def test_generation_without_a_teacher_logit_loss_is_refused_saying_why(tmp_path):
    path = write(tmp_path, GENERATING)
    line = GENERATING.splitlines().index("  mode: adaptive") + 1
    message = error_of(path, ("loss.base=ce",))
    assert f"line {line}: off_policy.mode: 'adaptive' needs a logit loss" in message
    assert "no teacher signal on generated text" in message and "off_policy.mode=off" in message
    message = error_of(path, ("teacher=null", "loss.base=ce", "loss.dsa_weight=0", "loss.hra_weight=0"))
    assert "off_policy.mode: 'adaptive' needs a teacher" in message
    message = error_of(path, ("loss.base=ce", "off_policy.mode=always"))
    assert "off_policy.mode: 'always' needs a logit loss" in message
    assert "(from override 'off_policy.mode=always')" in message
    assert load_recipe(path, ["loss.base=ce", "off_policy.mode=off"]).off_policy.mode == "off"


def test_adaptive_generation_needs_a_buffer_a_micro_batch_can_be_drawn_from(tmp_path):
    message = error_of(write(tmp_path, GENERATING), ("off_policy.buffer_size=1",))
    assert "off_policy.buffer_size: 1 rows cannot fill a micro batch" in message
    assert "at least train.micro_batch_size=2" in message


def test_adaptive_generation_without_dev_data_must_start_above_zero(tmp_path):
    path = write(tmp_path, GENERATING)
    message = error_of(path, ("data.dev=null",))
    assert "off_policy.mode: 'adaptive' raises the threshold only when the dev loss rises" in message
    assert load_recipe(path, ["data.dev=null", "off_policy.init_threshold=0.5"]).off_policy.init_threshold == 0.5
    assert load_recipe(path, ["data.dev=null", "off_policy.mode=always"]).data.dev is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("off_policy.init_threshold=1.5", "less than or equal to 1"),
        ("off_policy.threshold_step=0", "greater than 0"),
        ("off_policy.loss_eps=-0.1", "greater than or equal to 0"),
        ("off_policy.loss_eps=.inf", "must be a finite number"),
        ("off_policy.buffer_size=0", "greater than or equal to 1"),
        ("off_policy.schedule=cyclic", "'cyclic' is not allowed; use one of 'decreasing', 'constant' or 'increasing'"),
        ("off_policy.mode=sometimes", "'sometimes' is not allowed; use one of 'off', 'adaptive' or 'always'"),
        ("off_policy.buffer_sise=10", "unknown key: did you mean buffer_size?"),
    ],
)
def test_bad_off_policy_values_name_the_key(tmp_path, override, message):
    key = override.partition("=")[0]
    text = error_of(write(tmp_path, GENERATING), (override,))
    assert f"{key}: " in text and message in text


def test_generation_that_needs_one_tokenizer_is_refused_across_tokenizers(tmp_path):
    from mta.training.config.model_checks import check_off_policy_fits

    recipe = load_recipe(write(tmp_path, GENERATING))
    check_off_policy_fits(recipe, same_tokenizer=True)
    check_off_policy_fits(load_recipe(write(tmp_path, MINIMAL)), same_tokenizer=False)  # off: no check
    with pytest.raises(MtaError) as caught:
        check_off_policy_fits(recipe, same_tokenizer=False)
    message = str(caught.value)
    assert message.startswith(
        f"{tmp_path / 'recipe.yaml'}: off_policy.mode=adaptive needs the teacher and the student to share a tokenizer"
    )
    assert "(teacher-model vs student-model)" in message and "no teacher signal on generated text" in message
