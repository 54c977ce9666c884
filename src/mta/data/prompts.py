"""The Alpaca prompt template of the MiniLLM / DistiLLM data (docs/method.md §1)."""

from __future__ import annotations

PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


def alpaca_prompt(instruction: str, context: str | None = None) -> str:
    """The prompt the models see; the input section appears only when ``context`` is non-empty."""
    if context:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=context)
    return PROMPT_NO_INPUT.format(instruction=instruction)
