"""MTA inside a Hugging Face ``Trainer`` (docs/python-api.md, "Inside a Hugging Face Trainer").

Runs as it is on a CPU in seconds: tiny random models stand in for the Hub names a real run
gives, e.g. STUDENT = "Qwen/Qwen2.5-0.5B-Instruct", TEACHER = "Qwen/Qwen2.5-1.5B-Instruct" (one
tokenizer). Two things make the Trainer carry mta's batch: ``remove_unused_columns=False`` (else
it drops the annotated columns its model's forward does not take) and a ``compute_loss`` that
reads the ``mta.TrainBatch`` the collator returns; the HRA projectors train with the student
(``optimizers=``).

    python examples/hf_trainer_mta.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import mta
from mta.models.tiny import build_tiny_model, build_tiny_tokenizer


class MTATrainer(Trainer):
    """A ``Trainer`` whose loss is ``mta.MTALoss``: each batch is the collator's ``TrainBatch``;
    the frozen teacher runs inside ``compute_loss``."""

    def __init__(self, *args, teacher, mta_loss, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.mta_loss = teacher, mta_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = inputs.to(model.device)  # a mta.TrainBatch, passed through the Trainer whole
        student_out = model(
            input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask, output_hidden_states=True
        )
        with torch.no_grad():
            teacher_out = self.teacher(
                input_ids=batch.teacher.input_ids,
                attention_mask=batch.teacher.attention_mask,
                output_hidden_states=True,
            )
        losses = self.mta_loss(student_out, teacher_out, batch)
        self.last_losses = {name: value.item() for name, value in losses.items()}
        return (losses["total"], student_out) if return_outputs else losses["total"]


def main(out: Path) -> dict:
    examples = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "tiny.jsonl"
    build_tiny_tokenizer(examples, out / "tokenizer", vocab_size=512)
    STUDENT = str(build_tiny_model(out / "tokenizer", out / "student"))  # noqa: N806 (the Hub names' place)
    TEACHER = str(build_tiny_model(out / "tokenizer", out / "teacher", hidden_size=48, seed=1))  # noqa: N806

    student = AutoModelForCausalLM.from_pretrained(STUDENT)
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(STUDENT)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # Annotate once (here in memory; `mta annotate` + datasets.load_dataset("parquet", ...) for a file).
    raw = [json.loads(line) for line in examples.read_text(encoding="utf-8").splitlines()]
    annotator = mta.Annotator(mta.AnnotateSettings(teacher=TEACHER, student=STUDENT, workers=1))
    train = Dataset.from_list(annotator.annotate(raw))

    loss_fn = mta.MTALoss.for_models(student, teacher, vocab_size=len(tokenizer), same_tokenizer=True, base="srkl")
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        remove_unused_columns=False,  # keep the annotated columns for mta.Collator
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = MTATrainer(
        model=student,
        args=args,
        train_dataset=train,
        data_collator=mta.Collator(student_pad_id=pad_id, teacher_pad_id=pad_id, granularities=loss_fn.granularities),
        optimizers=(torch.optim.AdamW([*student.parameters(), *loss_fn.parameters()], lr=1e-3), None),
        teacher=teacher,
        mta_loss=loss_fn,
    )
    trainer.train()
    trainer.save_model(str(out / "final"))  # a plain transformers checkpoint
    return trainer.last_losses


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/hf-trainer-mta")))
