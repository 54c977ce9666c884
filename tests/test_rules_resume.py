"""The resume rules key by key: every recipe key (LLM and embedding) either may change on
``--resume`` or is refused, as restated here (README, "Resume rules"; ``resume_rules``'s docstring).

The tables below are written out by hand, not read from ``mta.training.config.resume_rules``; the
last tests fail when the schema or ``MUTABLE_KEYS`` gains a key these tables do not name.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any, get_args

import pytest
import torch
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from mta.embedding.recipe import EmbeddingRecipe
from mta.errors import MtaError
from mta.training.config.resume_rules import ABSENT, MUTABLE_KEYS, TRAINED_BEFORE_THE_KEY, ResumeChanges, resume_changes
from mta.training.config.schema import Recipe, models_in
from mta.training.engine import restart_schedule

CHANGE, FIXED = "may change", "fixed"

# Every key of a fully populated LLM recipe: (the rule, another valid-looking value for it).
LLM_RULES: dict[str, tuple[str, Any]] = {
    "name": (CHANGE, "renamed"),
    "seed": (FIXED, 7),
    "output_dir": (CHANGE, "runs/moved"),
    "task": (FIXED, "embedding"),
    "source": (CHANGE, "elsewhere/recipe.yaml"),
    "teacher.path": (FIXED, "other-teacher"),
    "teacher.tokenizer": (FIXED, "other-tokenizer"),
    "teacher.dtype": (FIXED, "bf16"),
    "teacher.config": (CHANGE, "configs/teacher.json"),
    "teacher.tiny.model_type": (FIXED, "gpt2"),
    "teacher.tiny.num_layers": (FIXED, 2),
    "teacher.tiny.hidden_size": (FIXED, 64),
    "teacher.tiny.num_heads": (FIXED, 2),
    "teacher.tiny.tokenizer_corpus": (FIXED, "other.jsonl"),
    "teacher.tiny.vocab_size": (FIXED, 600),
    "teacher.tiny.seed": (FIXED, 1),
    "teacher.lora": (FIXED, {"r": 8}),
    "teacher.license": (FIXED, "mit"),
    "student.license": (CHANGE, "mit"),
    "student.path": (FIXED, "other-student"),
    "student.tokenizer": (FIXED, "other-tokenizer"),
    "student.dtype": (FIXED, "bf16"),
    "student.config": (CHANGE, "configs/student.json"),
    "student.tiny.model_type": (FIXED, "gpt2"),
    "student.tiny.num_layers": (FIXED, 2),
    "student.tiny.hidden_size": (FIXED, 64),
    "student.tiny.num_heads": (FIXED, 2),
    "student.tiny.tokenizer_corpus": (FIXED, "other.jsonl"),
    "student.tiny.vocab_size": (FIXED, 600),
    "student.tiny.seed": (FIXED, 1),
    "student.lora.r": (FIXED, 8),
    "student.lora.alpha": (FIXED, 32.0),
    "student.lora.dropout": (FIXED, 0.0),
    "student.lora.target_modules": (FIXED, ["q_proj"]),
    "data.train": (CHANGE, "/elsewhere/train.jsonl"),
    "data.dev": (CHANGE, "/elsewhere/dev.jsonl"),
    "data.train_split": (CHANGE, "train_sft"),
    "data.dev_split": (CHANGE, "test"),
    "data.subset": (CHANGE, "en"),
    "data.revision": (CHANGE, "v1.0"),
    "data.max_length": (FIXED, 512),
    "data.max_prompt_length": (FIXED, 64),
    "data.word_spans": (FIXED, "all"),
    "data.span_rule": (FIXED, "reference"),
    "data.spacy_model": (FIXED, "en_core_web_md"),
    "data.truncate_prompt": (FIXED, True),
    "data.template": (FIXED, "none"),
    "data.fields": (FIXED, {"prompt": "question"}),
    "loss.base": (FIXED, "fkl"),
    "loss.base_weight": (FIXED, 0.5),
    "loss.temperature": (FIXED, 2.0),
    "loss.skew_alpha": (FIXED, 0.2),
    "loss.jsd_beta": (FIXED, 0.3),
    "loss.dsa_weight": (FIXED, 1.0),
    "loss.hra_weight": (FIXED, 0.1),
    "loss.layers": (FIXED, [[2, 4, "word"]]),
    "loss.importance": (FIXED, "uniform"),
    "loss.reference_code": (FIXED, True),
    "loss.chunk_size": (CHANGE, 16),
    "loss.fused_head": (CHANGE, False),
    "loss.distillm2_beta": (FIXED, 1.5),
    "loss.fdd_weight": (FIXED, 1.0),
    "loss.fdd_layers": (FIXED, [[1, 2]]),
    "loss.fdd_temperature": (FIXED, 5.0),
    "loss.fdd_final_norm": (FIXED, True),
    "loss.fdd_tokens": (FIXED, "response"),
    "loss.sra_weight": (FIXED, 1.0),
    "loss.sra_layers": (FIXED, [[1, 2]]),
    "loss.sra_centre": (FIXED, "importance"),
    "loss.sra_scope": (FIXED, "all"),
    "loss.sra_geometry_weight": (FIXED, 10.0),
    "loss.sra_logit_weight": (FIXED, 0.5),
    "loss.uld_weight": (FIXED, 1.0),
    "loss.uld_ce_weight": (FIXED, 0.5),
    "loss.shared_kl_weight": (FIXED, 0.5),
    "loss.shared_divergence": (FIXED, "srkl"),
    "train.optimizer": (FIXED, "sgd"),
    "train.lr": (CHANGE, 5e-5),
    "train.projector_lr": (CHANGE, 1e-4),
    "train.weight_decay": (FIXED, 0.0),
    "train.betas": (FIXED, [0.8, 0.99]),
    "train.schedule": (FIXED, "linear"),
    "train.warmup_steps": (FIXED, 3),
    "train.batch_size": (FIXED, 8),
    "train.micro_batch_size": (FIXED, 4),
    "train.epochs": (CHANGE, 2.0),
    "train.max_steps": (CHANGE, 40),
    "train.grad_clip": (FIXED, 0.5),
    "train.loss_reduction": (FIXED, "micro_batch"),
    "train.precision": (FIXED, "bf16"),
    "train.zero_stage": (FIXED, 2),
    "train.teacher_zero3": (CHANGE, True),
    "train.log_interval": (CHANGE, 1),
    "train.eval_interval": (CHANGE, 5),
    "train.save_interval": (CHANGE, 5),
    "train.keep_checkpoints": (CHANGE, 4),
    "train.checkpoint_at_end": (CHANGE, False),
    "train.num_sample_generations": (CHANGE, 0),
    "train.sample_max_new_tokens": (CHANGE, 16),
    "train.select_by": (FIXED, "rouge"),
    "train.select_rows": (FIXED, 50),
    "train.save_generated": (CHANGE, True),
    "train.asam.rho": (FIXED, 0.5),
    "train.asam.eta": (FIXED, 0.01),
    "train.asam.scope": (FIXED, "weights"),
    "train.push_to_hub": (CHANGE, "me/student"),
    "train.report_to": (CHANGE, ["tensorboard"]),
    "off_policy.mode": (FIXED, "always"),
    "off_policy.init_threshold": (FIXED, 0.5),
    "off_policy.threshold_step": (CHANGE, 0.05),
    "off_policy.loss_eps": (CHANGE, 0.2),
    "off_policy.schedule": (FIXED, "constant"),
    "off_policy.buffer_size": (FIXED, 10),
    "off_policy.max_new_tokens": (FIXED, 16),
    "off_policy.dev_rows": (FIXED, 100),
    "teacher_cache.dir": (CHANGE, "runs/teacher-cache"),
    "teacher_cache.logits": (FIXED, "sampled"),
    "teacher_cache.top_k": (FIXED, 32),
    "teacher_cache.samples": (FIXED, 16),
    "teacher_cache.seed": (FIXED, 1),
    "teacher_cache.states": (CHANGE, "storage"),
    "teacher_cache.storage": (FIXED, "fp32"),
    "deepspeed": (FIXED, {"wall_clock_breakdown": True}),
}

# The keys only a task: embedding recipe has (its shared train: keys follow LLM_RULES): all fixed.
EMBEDDING_ONLY_RULES: dict[str, tuple[str, Any]] = {
    "teacher.pooling": (FIXED, "cls"),
    "student.pooling": (FIXED, "mean"),
    "data.text_field": (FIXED, "sentence"),
    "loss.simcse_weight": (FIXED, 0.01),
    "loss.tamd_weight": (FIXED, 0.5),
    "loss.lasd_weight": (FIXED, 0.5),
    "loss.tamd_layers": (FIXED, 1),
    "loss.lasd_detach": (FIXED, True),
    "loss.lasd_reduction": (FIXED, "sum"),
    "loss.simcse_temperature": (FIXED, 0.05),
}

# Optional sections switched on or off as a whole: fixed.
SECTION_RULES: dict[str, str] = {
    "teacher": FIXED,
    "teacher.tiny": FIXED,
    "student.tiny": FIXED,
    "student.lora": FIXED,
    "train.asam": FIXED,
}

LLM_BASE: dict[str, Any] = {
    "name": "base",
    "output_dir": "runs/base",
    "teacher": {"path": "teacher-model", "tiny": {"tokenizer_corpus": "corpus.jsonl"}},
    "student": {"path": "student-model", "tiny": {"tokenizer_corpus": "corpus.jsonl"}, "lora": {}},
    "data": {"train": "train.jsonl", "dev": "dev.jsonl"},
    "train": {"max_steps": 10, "batch_size": 4, "micro_batch_size": 2, "asam": {}},
    "off_policy": {"mode": "adaptive"},
}

EMBEDDING_BASE: dict[str, Any] = {
    "name": "base",
    "output_dir": "runs/base",
    "task": "embedding",
    "teacher": {"path": "teacher-encoder", "tiny": {"tokenizer_corpus": "corpus.jsonl"}},
    "student": {"path": "student-encoder", "tiny": {"tokenizer_corpus": "corpus.jsonl"}},
    "data": {"train": "train.jsonl", "dev": "dev.jsonl"},
    "train": {"max_steps": 10, "batch_size": 4, "micro_batch_size": 2, "asam": {}},
}

SCHEMAS = {"llm": (Recipe, LLM_BASE), "embedding": (EmbeddingRecipe, EMBEDDING_BASE)}
EMBEDDING_DUMP = EmbeddingRecipe.model_validate(EMBEDDING_BASE).model_dump(mode="json")


def leaf_keys(mapping: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys of every value that is not a non-empty mapping (what a resume compares)."""
    keys = set()
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        keys |= leaf_keys(value, dotted + ".") if isinstance(value, dict) and value else {dotted}
    return keys


def with_value(mapping: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``mapping`` with ``dotted`` set to ``value``."""
    result = copy.deepcopy(mapping)
    *parents, last = dotted.split(".")
    node = result
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = copy.deepcopy(value)
    return result


def compare(task: str, dotted: str, value: Any) -> ResumeChanges:
    """A resume of the base recipe with ``dotted`` changed to ``value``: in the new recipe when
    that still validates, else in the checkpoint's saved mapping (an older mta's recipe)."""
    schema, raw = SCHEMAS[task]
    base = schema.model_validate(raw)
    saved = base.model_dump(mode="json")
    try:
        changed = schema.model_validate(with_value(saved, dotted, value))
    except ValidationError:
        return resume_changes(with_value(saved, dotted, value), base)
    return resume_changes(saved, changed)


def check_rule(changes: ResumeChanges, dotted: str, rule: str) -> None:
    applied, refused = changes.applied, changes.refused
    if dotted == "task":  # read as the other task's recipe: its own keys count as dropped (applied)
        applied = [change for change in applied if change.new is not ABSENT]
    touched = [change.key for change in applied + refused]
    assert touched and all(key == dotted or key.startswith(dotted + ".") for key in touched), touched
    if rule == CHANGE:
        assert refused == [] and applied
        assert all(line.startswith(f"resume changes {dotted}") for line in changes.log_lines())
    else:
        assert applied == [] and refused
        with pytest.raises(MtaError) as caught:
            changes.raise_if_refused("runs/base/checkpoints/step-5")
        assert f"\n  {refused[0].key}: " in str(caught.value) and " → " in str(caught.value)


@pytest.mark.parametrize("dotted", sorted(LLM_RULES))
def test_each_llm_recipe_key_changes_or_is_refused_as_restated(dotted):
    rule, value = LLM_RULES[dotted]
    check_rule(compare("llm", dotted, value), dotted, rule)


@pytest.mark.parametrize("dotted", sorted(leaf_keys(EMBEDDING_DUMP)))
def test_each_embedding_recipe_key_changes_or_is_refused_as_restated(dotted):
    if dotted not in EMBEDDING_ONLY_RULES and dotted not in LLM_RULES:
        pytest.fail(f"{dotted} is in neither table: add it to EMBEDDING_ONLY_RULES with its rule")
    rule, value = EMBEDDING_ONLY_RULES.get(dotted) or LLM_RULES[dotted]
    value = "llm" if dotted == "task" else value
    check_rule(compare("embedding", dotted, value), dotted, rule)


@pytest.mark.parametrize(
    "task, section",
    [("llm", section) for section in sorted(SECTION_RULES)]
    + [("embedding", section) for section in sorted(SECTION_RULES) if section != "student.lora"],
)
def test_switching_an_optional_section_on_or_off_is_refused(task, section):
    check_rule(compare(task, section, None), section, SECTION_RULES[section])


def schema_default(schema: type[BaseModel], dotted: str) -> tuple[bool, Any]:
    """Whether the key has a default in the schema, and that default as a saved recipe holds it."""
    model: type[BaseModel] | None = schema
    *parents, last = dotted.split(".")
    for part in parents:
        nested = models_in(model.model_fields[part].annotation) if model and part in model.model_fields else []
        model = nested[0] if nested else None
    info = model.model_fields.get(last) if model else None
    if info is None or info.is_required():
        return False, None
    default = info.get_default(call_default_factory=True)
    return True, default.model_dump(mode="json") if isinstance(default, BaseModel) else to_jsonable_python(default)


@pytest.mark.parametrize("task", sorted(SCHEMAS))
def test_a_key_an_older_checkpoint_lacks_counts_as_its_default(task):
    schema, raw = SCHEMAS[task]
    base = schema.model_validate(raw)
    saved = base.model_dump(mode="json")
    lacking = 0
    for dotted in sorted(leaf_keys(saved)):
        *parents, last = dotted.split(".")
        has_default, default = schema_default(schema, dotted)
        older = copy.deepcopy(saved)
        node = older
        for part in parents:
            node = node[part]
        if not has_default or node[last] != default:
            continue
        if task == "llm" and parents == ["train"] and last in TRAINED_BEFORE_THE_KEY:
            continue  # counts as what it trained with (the test below)
        del node[last]  # written by an mta from before the key existed
        changes = resume_changes(older, base)
        assert changes.applied == changes.refused == [], dotted
        lacking += 1
    assert lacking > 50  # most keys are at their default in the base recipe


def test_a_checkpoint_from_before_loss_reduction_counts_as_micro_batch():
    """0.2.0 averaged each micro batch's own means: resuming such a run under the new default
    (global) would change its objective, so it is refused until the recipe says micro_batch."""
    base = Recipe.model_validate(LLM_BASE)
    older = base.model_dump(mode="json")
    del older["train"]["loss_reduction"]
    refused = resume_changes(older, base).refused
    assert [(c.key, c.old, c.new) for c in refused] == [("train.loss_reduction", "micro_batch", "global")]
    kept = base.model_copy(update={"train": base.train.model_copy(update={"loss_reduction": "micro_batch"})})
    assert resume_changes(older, kept).refused == []


# --- the tables above name every key -------------------------------------------------------


def test_the_llm_table_names_every_key_of_the_recipe_schema():
    live = leaf_keys(Recipe.model_validate(LLM_BASE).model_dump(mode="json"))
    assert set(LLM_RULES) == live, "add the key to LLM_RULES with its resume rule (and a value)"


def test_the_embedding_tables_name_every_key_of_the_embedding_schema():
    live = leaf_keys(EMBEDDING_DUMP)
    assert live - set(LLM_RULES) == set(EMBEDDING_ONLY_RULES), "add the key to EMBEDDING_ONLY_RULES"


def optional_sections(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of the fields that hold a schema section or null."""
    found = set()
    for name, info in model.model_fields.items():
        nested = models_in(info.annotation)
        if nested and type(None) in get_args(info.annotation):
            found.add(prefix + name)
        if nested:
            found |= optional_sections(nested[0], f"{prefix}{name}.")
    return found


def test_the_section_table_names_every_optional_section():
    live = optional_sections(Recipe) | optional_sections(EmbeddingRecipe)
    # teacher.lora is always null (the schema refuses one): a key of LLM_RULES, not a section.
    assert live - {"teacher.lora"} == set(SECTION_RULES)


def test_the_keys_that_may_change_are_exactly_mutable_keys():
    restated = {key for key, (rule, _) in LLM_RULES.items() if rule == CHANGE}
    restated |= {key for key, (rule, _) in EMBEDDING_ONLY_RULES.items() if rule == CHANGE}
    assert restated == set(MUTABLE_KEYS)


# --- the learning-rate rule ----------------------------------------------------------------


def restated_multiplier(step: int, total: int, warmup: int, schedule: str) -> float:
    """docs: warmup (s + 1) / (w + 1), then constant 1, linear 1 − p, cosine (1 + cos πp) / 2."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": (1 + math.cos(math.pi * progress)) / 2}[schedule]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_a_resume_takes_the_new_base_rates_under_the_schedule_planned_for_the_new_total(schedule):
    train = {**LLM_BASE["train"], "schedule": schedule, "warmup_steps": 2, "lr": 5e-5, "projector_lr": 2e-4}
    recipe = Recipe.model_validate({**LLM_BASE, "train": train})
    student, projector = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW(
        [
            {"params": [student], "lr": 1e-4, "name": "student"},
            {"params": [projector], "lr": 5e-4, "name": "projectors"},
        ]
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for step, total in ((1, 10), (6, 10), (6, 40), (12, 20)):
        restart_schedule(SimpleNamespace(optimizer=optimizer, lr_scheduler=scheduler), recipe.train, step, total)
        multiplier = restated_multiplier(step, total, 2, schedule)
        got = [group["lr"] for group in optimizer.param_groups]
        assert got == pytest.approx([5e-5 * multiplier, 2e-4 * multiplier], rel=1e-12)
        assert scheduler.base_lrs == [5e-5, 2e-4]
