"""MTA inside TRL's on-policy DistillationTrainer (pip install 'mta-distill[trl]'; docs/trl.md).

Runs as it is on a CPU: tiny random models stand in for the Hub names a real run gives, e.g.
model="Qwen/Qwen2.5-0.5B-Instruct", teacher_model="Qwen/Qwen2.5-1.5B-Instruct" (one tokenizer).

    python examples/trl_mta.py [OUT_DIR]

The same script shards on GPUs as TRL's does (the HRA projectors go with the student):
    accelerate launch --config_file examples/accelerate/zero3.yaml examples/trl_mta.py  (or zero2, fsdp2)
(use_cpu=True below is for this CPU run: drop it there.)
"""

import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer

from mta.integrations.trl import MTADistillationConfig, MTADistillationTrainer
from mta.models.tiny import build_tiny_model, build_tiny_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/trl-mta")
rows = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "tiny.jsonl"
build_tiny_tokenizer(rows, out / "tokenizer", vocab_size=512)
student = build_tiny_model(out / "tokenizer", out / "student")
teacher = build_tiny_model(out / "tokenizer", out / "teacher", hidden_size=48, seed=1)
prompts = Dataset.from_list([{"prompt": json.loads(line)["instruction"]} for line in rows.read_text().splitlines()])

args = MTADistillationConfig(
    output_dir=str(out / "trainer"),
    per_device_train_batch_size=4,
    max_steps=4,
    max_completion_length=16,
    logging_steps=2,
    report_to=[],  # or "tensorboard", "wandb": the mta/* terms go there with TRL's metrics
    use_cpu=True,
    mta={"dsa_weight": 2.0, "hra_weight": 0.2, "layers": "auto", "span_workers": 1},
)
trainer = MTADistillationTrainer(
    model=str(student),
    teacher_model=str(teacher),
    args=args,
    train_dataset=prompts,
    processing_class=AutoTokenizer.from_pretrained(student),
)
trainer.train()
trainer.save_model(str(out / "final"))  # a plain transformers checkpoint
print({key: value for key, value in trainer.state.log_history[-2].items() if key.startswith(("loss", "mta/"))})
