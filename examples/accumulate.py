"""Gradient accumulation with mta's losses in your own loop: the same gradient however the
global batch is split into micro batches (docs/python-api.md, "Accumulating").

Runs as it is on a CPU: tiny random models stand in for the Hub names a real run gives.

    python examples/accumulate.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import mta
from mta.models.tiny import build_tiny_model, build_tiny_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/accumulate")
examples = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "tiny.jsonl"
build_tiny_tokenizer(examples, out / "tokenizer", vocab_size=512)
student_dir = build_tiny_model(out / "tokenizer", out / "student")
teacher_dir = build_tiny_model(out / "tokenizer", out / "teacher", hidden_size=48, seed=1)
student = AutoModelForCausalLM.from_pretrained(student_dir)
teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval().requires_grad_(False)
tokenizer = AutoTokenizer.from_pretrained(student_dir)

rows = mta.Annotator(mta.AnnotateSettings(teacher=str(teacher_dir), student=str(student_dir))).annotate(
    [json.loads(line) for line in examples.read_text().splitlines()[:6]]
)
loss_fn = mta.MTALoss.for_models(student, teacher, vocab_size=len(tokenizer), same_tokenizer=True, base="fkl")
collate = mta.Collator(student_pad_id=tokenizer.pad_token_id, teacher_pad_id=tokenizer.pad_token_id)
parameters = [*student.parameters(), *loss_fn.parameters()]


def losses_of(batch, global_counts=None):
    hidden = dict(output_hidden_states=True)
    student_out = student(input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask, **hidden)
    with torch.no_grad():
        teacher_out = teacher(input_ids=batch.teacher.input_ids, attention_mask=batch.teacher.attention_mask, **hidden)
    return loss_fn(student_out, teacher_out, batch, global_counts=global_counts)


def gradient() -> torch.Tensor:
    flat = torch.cat([p.grad.flatten() for p in parameters if p.grad is not None])
    for p in parameters:
        p.grad = None
    return flat


# The global batch as one micro batch: every term its own mean.
losses_of(collate(rows))["total"].backward()
whole = gradient()

# The same rows in micro batches of 1, 3 and 2 rows: counted first (labels and rows, no forward),
# then each micro batch's sums over the global counts, backpropagated one after another.
micro_batches = [collate(rows[:1]), collate(rows[1:4]), collate(rows[4:])]
global_counts: dict[str, float] = {}
for micro in micro_batches:
    for name, count in loss_fn.counts(micro).items():
        global_counts[name] = global_counts.get(name, 0.0) + count
for micro in micro_batches:
    losses_of(micro, global_counts)["total"].backward()
accumulated = gradient()

# Each micro batch its own mean, averaged (what an accumulating loop does without the counts).
for micro in micro_batches:
    (losses_of(micro)["total"] / len(micro_batches)).backward()
averaged = gradient()

print(
    json.dumps(
        {
            "counts": global_counts,
            "accumulated_vs_whole": float((accumulated - whole).norm() / whole.norm()),
            "means_averaged_vs_whole": float((averaged - whole).norm() / whole.norm()),
        }
    )
)
assert torch.allclose(accumulated, whole, rtol=1e-4, atol=1e-6)
