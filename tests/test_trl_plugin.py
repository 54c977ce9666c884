"""The TRL plug-in (mta.integrations.trl, issue 30): MTA's terms inside ``trl.DistillationTrainer``.

- every TRL method the plug-in overrides has, in the pinned TRL, the parameters the plug-in was
  written against, and the plug-in overrides nothing else;
- on one fixed batch (prompts of different lengths, so TRL left-pads them) the plug-in's DSA and
  HRA equal ``mta distill``'s objective on the same rows laid out as mta lays them out, and TRL's
  own loss is unchanged under them;
- the spans of on-policy completions are ``mta annotate``'s spans of the decoded rows;
- a few steps train, log ``mta/*`` beside TRL's metrics and save a checkpoint that loads with
  transformers alone (the projectors beside it, loaded again on resume); a LoRA student trains;
- a teacher with another tokenizer and a bad ``mta`` key are refused.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="the TRL plug-in's tests need trl (pip install 'mta-distill[trl]')")

from conftest import EXAMPLES, REPO, subprocess_env  # noqa: E402
from mta.errors import MtaError  # noqa: E402
from mta.integrations.trl import (  # noqa: E402
    OVERRIDDEN,
    PROJECTORS,
    TESTED_TRL,
    MTADistillationConfig,
    MTADistillationTrainer,
    MTASection,
)

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]


def settings_of(out: Path, **options) -> dict:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        max_completion_length=6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        mta={"span_workers": 0},
    )
    settings.update(options)
    return settings


def config(out: Path, **options) -> MTADistillationConfig:
    return MTADistillationConfig(**settings_of(out, **options))


def prompts(count: int = 8):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": row["instruction"]} for row in ROWS[:count]])


def trainer_of(out: Path, student, teacher, tokenizer, **options) -> MTADistillationTrainer:
    return MTADistillationTrainer(
        model=str(student) if isinstance(student, Path) else student,
        teacher_model=str(teacher),
        args=config(out, **options),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --------------------------------------------------------------------------- TRL's surface


def test_every_overridden_method_has_the_pinned_trls_parameters_and_nothing_else_is_overridden():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    from trl import DistillationTrainer

    assert Version(trl.__version__) in SpecifierSet(TESTED_TRL)
    pinned = next(line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("trl=="))
    assert Version(pinned.split("==")[1]) in SpecifierSet(TESTED_TRL)
    # The range's upper bound is the minor after the pinned (last tested) version.
    upper = next(s.version for s in SpecifierSet(TESTED_TRL) if s.operator == "<")
    pinned_version = Version(pinned.split("==")[1])
    assert upper == f"{pinned_version.major}.{pinned_version.minor + 1}"
    assert f'"trl{TESTED_TRL}; ' in (REPO / "pyproject.toml").read_text()
    for name, parameters in OVERRIDDEN.items():
        for owner in (DistillationTrainer, MTADistillationTrainer):
            assert tuple(inspect.signature(getattr(owner, name)).parameters) == parameters, (owner.__name__, name)
    inherited = {name for klass in DistillationTrainer.__mro__ for name in vars(klass)}
    mine = {name for name, value in vars(MTADistillationTrainer).items() if callable(value)}
    assert mine & inherited == set(OVERRIDDEN)


def test_the_mta_section_takes_a_recipes_values_and_names_a_bad_key(tmp_path):
    section = MTASection.of({"recipe": str(REPO / "recipes" / "tiny.yaml"), "dsa_weight": 1.5})
    from mta.training.config.loading import load_recipe

    recipe = load_recipe(REPO / "recipes" / "tiny.yaml")
    assert (section.dsa_weight, section.hra_weight) == (1.5, recipe.loss.hra_weight)
    assert section.importance == recipe.loss.importance
    assert MTASection.of('{"hra_weight": 0.5}').hra_weight == 0.5
    with pytest.raises(MtaError, match="mta.dsa_wieght: Extra inputs are not permitted"):
        MTASection.of({"dsa_wieght": 1.0})
    with pytest.raises(MtaError, match="mta.hra_weight: Input should be greater than or equal to 0"):
        MTASection.of({"hra_weight": -1})


# --------------------------------------------------------------------------- one fixed batch


def fixed_inputs(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """A micro batch as TRL's generation leaves it: prompts left-padded, completions (the rows'
    responses + EOS) right-padded, with their masks."""
    from mta.data.prompts import alpaca_prompt

    pad = tokenizer.pad_token_id
    prompt_ids = [tokenizer(alpaca_prompt(r["instruction"], r.get("input")))["input_ids"] for r in rows]
    completion_ids = [tokenizer(r["output"])["input_ids"][:12] + [tokenizer.eos_token_id] for r in rows]
    width_p, width_c = max(map(len, prompt_ids)), max(map(len, completion_ids))
    return {
        "prompt_ids": torch.tensor([[pad] * (width_p - len(p)) + p for p in prompt_ids]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompt_ids]),
        "completion_ids": torch.tensor([c + [pad] * (width_c - len(c)) for c in completion_ids]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completion_ids]),
    }


def test_on_a_fixed_batch_the_terms_are_mta_distills_and_trls_loss_is_unchanged(
    tmp_path, tiny_model_dir, teacher_dir, tokenizer
):
    from trl import DistillationConfig, DistillationTrainer

    import mta
    from mta.training.config.schema import LossSpec
    from mta.training.objective import DistillationModel, DistillationObjective
    from mta.training.teacher import FrozenTeacher

    inputs = fixed_inputs(tokenizer, [ROWS[0], ROWS[3], ROWS[5]])
    assert inputs["prompt_mask"].sum(dim=1).unique().numel() == 3  # three prompt lengths: left padding
    trainer = trainer_of(tmp_path / "mta", tiny_model_dir, teacher_dir, tokenizer)
    trainer.model.eval()  # no accumulation scaling: the terms are added whole
    with torch.no_grad():
        plugin_loss = trainer.compute_loss(trainer.model, dict(inputs))
    logged = {name: trainer._metrics["eval"][f"mta/{name}"][-1] for name in ("dsa", "hra", "total")}

    # mta distill's objective on the same rows as mta lays them out (right-padded, its own spans).
    rows = trainer.span_parser.parse(trainer.generated_rows(inputs)).batch.to_pylist()
    batch = mta.Collator(
        student_pad_id=tokenizer.pad_token_id,
        teacher_pad_id=tokenizer.pad_token_id,
        granularities=trainer.mta_loss.granularities,
    )(rows)
    assert torch.equal(
        batch.student.input_ids[0, : inputs["prompt_mask"][0].sum()],
        inputs["prompt_ids"][0][-inputs["prompt_mask"][0].sum() :],
    )
    objective = DistillationObjective(
        LossSpec(base="ce", base_weight=0.0),
        mta.layer_map(4, 4, "auto"),
        student_hidden_size=32,
        teacher_hidden_size=48,
        same_tokenizer=True,
        vocab_size=len(tokenizer),
    )
    objective.load_state_dict(trainer.mta_loss.objective.state_dict())  # the same projectors
    student = trainer.accelerator.unwrap_model(trainer.model)
    teacher = FrozenTeacher(trainer.teacher_model, objective.teacher_layers, False)
    with torch.no_grad():
        expected = DistillationModel(student, objective)(
            batch, teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
        )
    for name in ("dsa", "hra"):
        assert logged[name] == pytest.approx(expected[name].item(), rel=1e-4), name
    assert logged["total"] == pytest.approx(2.0 * logged["dsa"] + 0.2 * logged["hra"], rel=1e-6)

    plain = DistillationTrainer(
        model=str(tiny_model_dir),
        teacher_model=str(teacher_dir),
        args=DistillationConfig(**{k: v for k, v in settings_of(tmp_path / "plain").items() if k != "mta"}),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    plain.model.eval()
    with torch.no_grad():
        plain_loss = plain.compute_loss(plain.model, dict(inputs))
    assert plugin_loss.item() == pytest.approx(plain_loss.item() + logged["total"], rel=1e-5)


def test_the_spans_of_completions_are_mta_annotates_of_the_decoded_rows(
    tmp_path, tiny_model_dir, teacher_dir, tokenizer
):
    from mta.data.annotate import AnnotateSettings, run_annotate
    from mta.data.annotations import read_annotations

    trainer = trainer_of(tmp_path / "t", tiny_model_dir, teacher_dir, tokenizer)
    inputs = fixed_inputs(tokenizer, ROWS[:4])
    parsed = trainer.span_parser.parse(trainer.generated_rows(inputs)).batch.to_pylist()
    decoded = tmp_path / "decoded.jsonl"
    with open(decoded, "w", encoding="utf-8") as handle:
        for row in parsed:
            handle.write(
                json.dumps(
                    {"prompt": row["text"][: row["prompt_chars"]], "response": row["text"][row["prompt_chars"] :]}
                )
                + "\n"
            )
    settings = AnnotateSettings(
        teacher=str(tiny_model_dir),
        student=str(tiny_model_dir),
        max_length=512,
        max_prompt_length=400,
        template="none",
        workers=1,
    )
    annotated = read_annotations(run_annotate(decoded, tmp_path / "annotated", settings).directory).table.to_pylist()
    assert len(annotated) == len(parsed) == 4
    for online, offline in zip(parsed, sorted(annotated, key=lambda r: r["id"]), strict=True):
        assert online["text"] == offline["text"]
        assert online["student_input_ids"] == offline["student_input_ids"]  # the decoded text re-encodes alike here
        for kind in ("phrase_spans", "word_spans"):
            assert online[kind] == offline[kind], kind
        assert online["phrase_spans"], "no phrase in a real response"

    # In TRL's layout the spans are shifted by each row's prompt padding: the same tokens.
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    padding = (inputs["prompt_mask"].shape[1] - inputs["prompt_mask"].sum(dim=1)).tolist()
    for name, spans in trainer.spans_of(inputs).items():
        for row, online in enumerate(parsed):
            for index, span in enumerate(online[f"{name}_spans"]):
                assert spans.mask[row, index]
                start, end = spans.student_start[row, index].item(), spans.student_end[row, index].item()
                assert (start, end) == (span["student_start"] + padding[row], span["student_end"] + padding[row])
                assert (
                    ids[row, start:end].tolist()
                    == online["student_input_ids"][span["student_start"] : span["student_end"]]
                )


# --------------------------------------------------------------------------- training


def test_a_few_steps_train_log_and_save_a_checkpoint_that_loads_with_transformers_alone(
    tmp_path, tiny_model_dir, teacher_dir, tokenizer
):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    trainer = trainer_of(
        out, tiny_model_dir, teacher_dir, tokenizer, save_strategy="steps", save_steps=2, mta={"span_workers": 1}
    )
    before = {name: p.detach().clone() for name, p in trainer.mta_loss.named_parameters()}
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "mta/dsa" in entry]
    assert len(logged) == 2 and all(entry["mta/total"] > 0 and "loss" in entry for entry in logged)
    assert trainer._span_parser is None  # closed when training ended
    checkpoint = out / "checkpoint-2"
    saved = load_file(str(checkpoint / PROJECTORS))
    assert set(saved) == set(trainer.mta_loss.state_dict())
    assert any(not torch.equal(before[name], saved[name]) for name in before), "the projectors did not train"

    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert set(reloaded.state_dict()) == set(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    student = trainer.accelerator.unwrap_model(trainer.model)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, student.state_dict()[name]), name

    # Resume: the projectors come back from the checkpoint.
    resumed = trainer_of(out, tiny_model_dir, teacher_dir, tokenizer, max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    (checkpoint / PROJECTORS).unlink()
    again = trainer_of(out, tiny_model_dir, teacher_dir, tokenizer, max_steps=3, save_strategy="no")
    with pytest.raises(MtaError, match=f"has no {PROJECTORS}"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_a_lora_student_trains(tmp_path, tiny_model_dir, teacher_dir, tokenizer):
    from peft import LoraConfig

    trainer = MTADistillationTrainer(
        model=str(tiny_model_dir),
        teacher_model=str(teacher_dir),
        args=config(tmp_path / "lora", max_steps=1),
        train_dataset=prompts(),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    lora = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_B" in name}
    trainer.train()
    assert any("mta/hra" in entry for entry in trainer.state.log_history)
    changed = [
        name for name, p in trainer.model.named_parameters() if "lora_B" in name and not torch.equal(p, lora[name])
    ]
    assert changed, "the LoRA weights did not train"


def test_the_span_parser_closes_when_training_raises(tmp_path, tiny_model_dir, teacher_dir, tokenizer):
    import os

    trainer = trainer_of(tmp_path / "raises", tiny_model_dir, teacher_dir, tokenizer, mta={"span_workers": 1})
    workers: list[int] = []

    def fails(inputs, *args):
        workers.extend(trainer._span_parser._executor._processes)  # started by the generation batch
        raise RuntimeError("planted")

    trainer.mta_terms = fails
    with pytest.raises(RuntimeError, match="planted"):
        trainer.train()
    assert workers and trainer._span_parser is None
    for pid in workers:  # joined by close(): gone, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_projectors_are_a_submodule_of_the_student_in_a_group_of_their_own(
    tmp_path, tiny_model_dir, teacher_dir, tokenizer
):
    from mta.integrations.trl import PROJECTORS_MODULE

    trainer = trainer_of(tmp_path / "group", tiny_model_dir, teacher_dir, tokenizer, mta={"projector_lr": 0.5})
    assert getattr(trainer.model, PROJECTORS_MODULE) is trainer.mta_loss
    optimizer = trainer.create_optimizer()
    projectors = {id(p) for p in trainer.mta_loss.parameters()}
    mine = [g for g in optimizer.param_groups if any(id(p) in projectors for p in g["params"])]
    assert len(mine) == 1 and {id(p) for p in mine[0]["params"]} == projectors
    assert (mine[0]["lr"], mine[0]["weight_decay"]) == (0.5, 0.0)
    student = [p for g in optimizer.param_groups if g is not mine[0] for p in g["params"]]
    assert len(student) == len([p for p in trainer.model.parameters() if p.requires_grad]) - len(projectors)


def test_a_launch_the_engine_would_not_run_is_refused(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from mta.integrations.trl import check_engine, check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")

    def args(world_size, kind):
        return SimpleNamespace(world_size=world_size, distributed_state=SimpleNamespace(distributed_type=kind))

    check_launch(args(2, DistributedType.DEEPSPEED))
    with pytest.raises(MtaError, match="launched 2 DeepSpeed processes and this one counts 1.*join_cpu_launch"):
        check_launch(args(1, DistributedType.DEEPSPEED))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    check_launch(args(2, DistributedType.FSDP))
    for kind in (DistributedType.NO, DistributedType.MULTI_CPU):
        with pytest.raises(MtaError, match="attaches FSDP to GPU groups only"):
            check_launch(args(2, kind))

    def trainer(fsdp_version=2, ds_config=None):
        state = SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(deepspeed_config=ds_config) if ds_config is not None else None,
            fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version),
        )
        return SimpleNamespace(
            accelerator=SimpleNamespace(state=state), is_deepspeed_enabled=ds_config is not None, is_fsdp_enabled=True
        )

    check_engine(trainer(), MTASection())
    with pytest.raises(MtaError, match="not FSDP1, which flattens the HRA projectors"):
        check_engine(trainer(fsdp_version=1), MTASection())
    check_engine(trainer(ds_config={"optimizer": {}}), MTASection())  # the projectors at the student's rate
    with pytest.raises(MtaError, match="mta.projector_lr cannot apply"):
        check_engine(trainer(ds_config={"optimizer": {}}), MTASection(projector_lr=1e-3))


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tiny_model_dir, other_tokenizer_dir, tokenizer):
    from mta.models.tiny import build_tiny_model

    other = build_tiny_model(other_tokenizer_dir, tmp_path / "other", seed=3)
    with pytest.raises(MtaError, match="another tokenizer than the student.*`mta distill`"):
        trainer_of(tmp_path / "x", tiny_model_dir, other, tokenizer)


def test_the_example_runs_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "trl_mta.py"), str(tmp_path / "example")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mta/dsa" in done.stdout and (tmp_path / "example" / "final" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- issue 48's edge cases


def test_the_mta_term_is_the_generation_batchs_per_sequence_mean_however_it_is_split(
    tmp_path, tiny_model_dir, teacher_dir, tokenizer
):
    """Training mode, one generation batch of four rows: as one micro batch, or as micro batches
    of 1 and 3 rows accumulated, the loss and the gradient (student and projectors) are the same."""
    trainer = trainer_of(tmp_path / "t", tiny_model_dir, teacher_dir, tokenizer)
    whole = fixed_inputs(tokenizer, ROWS[:4])
    tokens = whole["completion_mask"].sum()

    def split(rows):
        part = {name: value[rows] for name, value in whole.items()}
        return part | {"num_items_in_batch": tokens}

    params = [p for p in trainer.model.parameters() if p.requires_grad] + list(trainer.mta_loss.parameters())

    def accumulated(micro_batches):
        trainer.model.train()
        trainer._buffered_inputs, trainer._mta_sequences = micro_batches, 4.0
        total, grads = 0.0, [torch.zeros_like(p) for p in params]
        for inputs in micro_batches:
            loss = trainer.compute_loss(trainer.model, dict(inputs))
            for grad, part in zip(grads, torch.autograd.grad(loss, params, allow_unused=True), strict=True):
                if part is not None:
                    grad += part
            total += loss.item()
        return total, grads

    one, one_grads = accumulated([split([0, 1, 2, 3])])
    two, two_grads = accumulated([split([0]), split([1, 2, 3])])
    assert two == pytest.approx(one, rel=1e-5)
    for a, b in zip(two_grads, one_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert trainer._metrics["train"]["mta/total"][-1] > 0
    # Each micro batch's own mean (0.2.0: halved for two accumulation steps) is another term.
    trainer.model.eval()
    with torch.no_grad():
        for rows in ([0], [1, 2, 3], [0, 1, 2, 3]):
            trainer.compute_loss(trainer.model, dict(split(rows)))
    first, rest, every = trainer._metrics["eval"]["mta/total"][-3:]
    assert every == pytest.approx((first + 3 * rest) / 4, rel=1e-4)  # the per-sequence mean
    assert abs((first + rest) / 2 - every) > 1e-3 * every


def test_both_weights_0_is_trls_trainer_step_by_step(tmp_path, tiny_model_dir, teacher_dir, tokenizer):
    from safetensors.torch import load_file
    from trl import DistillationConfig, DistillationTrainer

    options = dict(max_steps=2, save_strategy="steps", save_steps=2)
    off = trainer_of(
        tmp_path / "off", tiny_model_dir, teacher_dir, tokenizer, mta={"dsa_weight": 0, "hra_weight": 0}, **options
    )
    assert off.mta_loss is None
    off.train()
    plain = DistillationTrainer(
        model=str(tiny_model_dir),
        teacher_model=str(teacher_dir),
        args=DistillationConfig(**{k: v for k, v in settings_of(tmp_path / "plain", **options).items() if k != "mta"}),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    plain.train()

    def steps(trainer):
        timing = ("time", "runtime", "per_second", "step_time")
        return [
            {k: v for k, v in entry.items() if not any(word in k for word in timing)}
            for entry in trainer.state.log_history
        ]

    assert steps(off) == steps(plain)
    assert not any(key.startswith("mta/") for entry in steps(off) for key in entry)
    ours, theirs = tmp_path / "off" / "checkpoint-2", tmp_path / "plain" / "checkpoint-2"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    mine, trls = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert set(mine) == set(trls)
    for name, tensor in mine.items():
        assert torch.equal(tensor, trls[name]), name


def test_a_tool_calling_completion_with_end_of_turn_tokens_inside_is_parsed_into_spans(
    tmp_path, tiny_model_dir, teacher_dir, tokenizer
):
    """The completion holds the EOS (end of turn) before a tool's reply and the next turn: its
    spans are parsed (special tokens are boundaries, no span holds one) instead of refused."""
    from mta.api import GeneratedRow
    from mta.data.online_spans import online_annotator

    trainer = trainer_of(tmp_path / "t", tiny_model_dir, teacher_dir, tokenizer)
    eos = tokenizer.eos_token_id
    turn = tokenizer("The weather in Paris is sunny today.")["input_ids"]
    reply = tokenizer("The tool says the sky is clear and the wind is calm.")["input_ids"]
    inputs = fixed_inputs(tokenizer, ROWS[:1])
    completion = turn + [eos] + reply + [eos]
    inputs["completion_ids"] = torch.tensor([completion])
    inputs["completion_mask"] = torch.ones(1, len(completion), dtype=torch.long)
    spans = trainer.spans_of(inputs)  # parsed, not refused
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)[0]
    eos_at = (ids == eos).nonzero().flatten().tolist()
    width = inputs["prompt_ids"].shape[1]
    after = 0
    for batch in spans.values():
        for start, end, real in zip(batch.student_start[0], batch.student_end[0], batch.mask[0], strict=True):
            if not real:
                continue
            assert not any(start <= at < end for at in eos_at), (int(start), int(end))
            after += int(start) > width + len(turn)  # a span in the tool's reply, after the first EOS
    assert after > 0
    # Without `turns` the guard stays: an EOS before the end is a padding mistake in mta distill.
    annotator = online_annotator(trainer.span_settings)
    row = trainer.generated_rows(inputs)[0]
    with pytest.raises(ValueError, match="EOS .* before its end"):
        annotator.annotate([GeneratedRow(row.prompt, row.prompt_ids, row.generated_ids, id=0)])
