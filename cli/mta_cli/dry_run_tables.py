"""``mta distill --dry-run``: a ``RunPlan`` (``mta.training.dry_run``) as rich tables."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mta.training.dry_run import GIB, RunPlan


def render_plan(plan: RunPlan) -> Group:
    """The plan as rich tables: models, aligned layers (MTA's, FDD's, SRA's), batch, the
    teacher's side and off-policy generation, memory per device, notes."""
    present = [model for model in (plan.teacher, plan.student) if model is not None]
    models = _table(("", *(model.role for model in present)), numeric=())
    for label, value in (
        ("model", lambda m: m.name),
        ("architecture", lambda m: m.architecture),
        ("layers", lambda m: str(m.num_layers)),
        ("hidden size", lambda m: str(m.hidden_size)),
        ("embedding rows", lambda m: f"{m.vocab_rows:,}"),
        ("parameters", lambda m: _count(m.parameters)),
        ("dtype", lambda m: m.dtype),
        ("config from", lambda m: m.config_source),
    ):
        models.add_row(label, *(value(model) for model in present))
    parts: list[Table | Text] = [_heading(f"{plan.name}: models (meta device, no weights)"), models]

    if plan.layers:
        layers = _table(("student", "teacher", "granularity"), numeric=("student", "teacher"))
        for pair in plan.layers:
            layers.add_row(str(pair.student), str(pair.teacher), pair.granularity)
        parts += [_heading("aligned layers (hidden_states indices, 0 = embeddings)"), layers]
    for term, pairs in (("FDD", plan.fdd_layers), ("SRA", plan.sra_layers)):
        if pairs:
            table = _table(("student", "teacher"), numeric=("student", "teacher"))
            for pair in pairs:
                table.add_row(str(pair.student), str(pair.teacher))
            parts += [_heading(f"{term} layer pairs (hidden_states indices)"), table]

    batch = _table(("setting", "value"), numeric=())
    batch.add_row(
        "global batch",
        f"{plan.global_batch} = {plan.micro_batch_size} per device × "
        f"{plan.accumulation_steps} accumulation × {_devices(plan.world_size)}",
    )
    batch.add_row("precision", plan.precision)
    teacher_sharding = " (teacher partitioned with ZeRO-3)" if plan.teacher_zero3 else ""
    batch.add_row("ZeRO stage", f"{plan.zero_stage}{teacher_sharding}")
    if plan.projector_parameters:
        batch.add_row(f"{plan.projectors} parameters", _count(plan.projector_parameters))
    if plan.teacher_source is not None:
        batch.add_row("teacher's side from", plan.teacher_source)
    if plan.off_policy != "off":
        batch.add_row("off-policy generation", f"{plan.off_policy}, up to {plan.off_policy_new_tokens} new tokens")
    parts += [_heading("batch and parallelism"), batch]

    memory = _table(("component", "size"), numeric=("size",))
    estimate = plan.memory
    for label, value in (
        ("student weights", estimate.student_weights),
        ("student gradients", estimate.student_gradients),
        ("optimizer states", estimate.optimizer_states),
        ("teacher weights", estimate.teacher_weights),
        ("activations (rough)", estimate.activations),
    ):
        memory.add_row(label, _bytes(value))
    if estimate.logits:
        whole = (
            "every position at once" if estimate.logit_chunk is None else f"chunks of {estimate.logit_chunk} positions"
        )
        memory.add_row(f"  of which logits ({whole})", _bytes(estimate.logits))
    memory.add_row("total", _bytes(estimate.total), style="bold")
    parts += [
        _heading(
            f"estimated memory per device (ZeRO-{plan.zero_stage}, {_devices(plan.world_size)}; "
            "without CUDA context and buffers)"
        ),
        memory,
    ]
    # Text, not markup: notes quote recipe keys such as loss.layers[0].
    parts.extend(Text.assemble(("note: ", "yellow"), note) for note in plan.notes)
    return Group(*parts)


def _heading(title: str) -> Text:
    return Text(title, style="bold")


def _table(columns: tuple[str, ...], numeric: tuple[str, ...]) -> Table:
    table = Table()
    for column in columns:
        table.add_column(column, justify="right" if column in numeric else "left")
    return table


def _count(count: int) -> str:
    return f"{count:,} ({count / 1e6:,.1f}M)" if count >= 10**6 else f"{count:,}"


def _bytes(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB // 10 else f"{count / 2**20:.1f} MiB"


def _devices(world_size: int) -> str:
    return f"{world_size} device" + ("s" if world_size > 1 else "")
