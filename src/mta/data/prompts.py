"""How a row's prompt is built, in one place (:func:`build_prompt`, called by annotate and evaluate
through a :class:`PromptStyle`): ``alpaca`` (the default: the row's ``prompt``, else the Alpaca
prompt of docs/method.md §1), ``chat`` (the tokenizer's ``apply_chat_template`` on the row's turns,
or one user turn of instruction and input, exactly as transformers renders it) or ``none`` (the
row's ``prompt`` as given). A prompt that cannot be built raises :class:`PromptProblem`. Chat
templates are rendered in the process that loaded the tokenizers; annotate's workers get finished
strings, so transformers is imported only in :meth:`ChatTemplate.load`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from mta.errors import MtaError
from mta.hashing import json_sha256

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

Template = Literal["alpaca", "chat", "none"]
TEMPLATES: tuple[str, ...] = get_args(Template)
DEFAULT_TEMPLATE: Template = "alpaca"
ROLES = ("system", "user", "assistant")  # the roles a conversation's turns may have

# Why a prompt could not be built (also the keys of annotate's ``skipped`` counts).
INVALID_CONVERSATION = "invalid_conversation"  # not a list of {role, content}, bad role, ...
NO_PROMPT = "no_prompt"  # the row has nothing this template builds a prompt from

CHOOSE_CHAT = "use template chat (`--template chat`, recipe `data.template: chat`)"


def alpaca_prompt(instruction: str, context: str | None = None) -> str:
    """The prompt the models see; the input section appears only when ``context`` is non-empty."""
    if context:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=context)
    return PROMPT_NO_INPUT.format(instruction=instruction)


class PromptProblem(ValueError):
    """A row this template cannot build a prompt for; ``reason`` is one of the constants above
    (or ``wrong_type``), ``message`` says what is wrong and what to do."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


Turn = dict[str, str]  # {"role": ..., "content": ...}


def conversation(value: Any, key: str) -> tuple[Turn, ...]:
    """The turns of a row's field ``key`` (a JSON array of ``{role, content}`` objects, roles in
    :data:`ROLES`, contents strings), reduced to those two keys; :class:`PromptProblem` naming
    the turn otherwise. Extra keys of a turn (``name``, ...) are not passed on."""
    if not isinstance(value, list):
        raise PromptProblem(
            INVALID_CONVERSATION,
            f'field \'{key}\' must be an array of {{"role", "content"}} objects, got {_kind(value)}',
        )
    turns = []
    for index, turn in enumerate(value):
        where = f"{key}[{index}]"
        if not isinstance(turn, dict):
            raise PromptProblem(
                INVALID_CONVERSATION, f"{where} must be an object with 'role' and 'content', got {_kind(turn)}"
            )
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise PromptProblem(
                INVALID_CONVERSATION,
                f"{where} has role {_shown(role)}; a turn's role is one of {', '.join(ROLES)}",
            )
        if not isinstance(content, str):
            raise PromptProblem(
                INVALID_CONVERSATION, f"{where} ({role}) must have a string 'content', got {_kind(content)}"
            )
        turns.append({"role": role, "content": content})
    return tuple(turns)


def split_conversation(turns: Sequence[Turn], key: str) -> tuple[tuple[Turn, ...], str]:
    """(the turns before the last one, the last one's content): the prompt and the response of
    a conversation that ends with an assistant turn and has at least one turn before it."""
    if not turns or turns[-1]["role"] != "assistant":
        last = f"its last turn is a {turns[-1]['role']} turn" if turns else "it is empty"
        raise PromptProblem(
            INVALID_CONVERSATION,
            f"the conversation in '{key}' must end with the assistant turn to learn, but {last}",
        )
    if len(turns) == 1:
        raise PromptProblem(
            INVALID_CONVERSATION,
            f"the conversation in '{key}' is only the assistant turn: there is no prompt before it",
        )
    return tuple(turns[:-1]), turns[-1]["content"]


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template, rendered by transformers' ``apply_chat_template``.

    name: the tokenizer it comes from (a hub name or directory); sha256: ``sha256:`` of the
    template (a string, or the tokenizer's dict of named templates), which the tokenizer's
    vocabulary fingerprint does not cover.
    """

    name: str
    sha256: str
    tokenizer: Any = field(repr=False, compare=False)

    @classmethod
    def of(cls, tokenizer: Any, name: str | Path) -> ChatTemplate:
        """The chat template of a loaded tokenizer; ``MtaError`` when it has none."""
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise MtaError(
                f"the tokenizer '{name}' has no chat template (no 'chat_template' in its "
                "tokenizer_config.json, no chat_template.jinja), so template chat cannot render "
                "prompts with it. Use --template alpaca (data.template: alpaca, the Alpaca "
                "prompt) or none (the rows' own 'prompt'), or a tokenizer that has a chat template"
            )
        return cls(name=str(name), sha256="sha256:" + json_sha256(template), tokenizer=tokenizer)

    @classmethod
    def load(cls, name_or_path: str | Path) -> ChatTemplate:
        from mta.models.tokenizers import load_tokenizer

        return cls.of(load_tokenizer(name_or_path), name_or_path)

    def render(self, turns: Sequence[Turn]) -> str:
        """``apply_chat_template(turns, tokenize=False, add_generation_prompt=True)``; a
        template that refuses the turns (``raise_exception``, e.g. roles that must
        alternate) raises :class:`PromptProblem`."""
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                [dict(turn) for turn in turns], tokenize=False, add_generation_prompt=True
            )
        except TemplateError as error:
            raise PromptProblem(
                INVALID_CONVERSATION, f"the chat template of '{self.name}' refuses this conversation: {error}"
            ) from None
        if not isinstance(text, str):  # a transformers that ignores tokenize=False
            raise MtaError(f"apply_chat_template of '{self.name}' returned {type(text).__name__}, not text")
        return text


def check_template(template: str) -> None:
    if template not in TEMPLATES:
        raise MtaError(f"template must be one of {', '.join(TEMPLATES)}, got '{template}'")


@dataclass(frozen=True)
class PromptStyle:
    """A template and, for ``chat``, the chat template that renders it (and which side of the
    artefact it comes from: ``rendered_by``, e.g. "student")."""

    template: Template = DEFAULT_TEMPLATE
    chat: ChatTemplate | None = None
    rendered_by: str | None = None

    def __post_init__(self) -> None:
        check_template(self.template)
        if (self.template == "chat") != (self.chat is not None):
            raise ValueError("a chat ChatTemplate is given exactly when the template is 'chat'")

    def build(
        self,
        *,
        prompt: str | None = None,
        instruction: str | None = None,
        context: str | None = None,
        turns: Sequence[Turn] | None = None,
    ) -> str:
        return build_prompt(
            self.template, self.chat, prompt=prompt, instruction=instruction, context=context, turns=turns
        )

    def record(self) -> dict[str, Any]:
        """What a manifest records: ``{"name": template}``, for chat also the chat template's
        sha256, the tokenizer that rendered it and which side that is."""
        if self.chat is None:
            return {"name": self.template}
        return {
            "name": self.template,
            "rendered_by": self.rendered_by,
            "tokenizer": self.chat.name,
            "chat_template_sha256": self.chat.sha256,
        }


ALPACA = PromptStyle()


def prompt_style(template: str, tokenizer: str | Path | None = None, *, rendered_by: str | None = None) -> PromptStyle:
    """The style of ``template``; ``chat`` loads ``tokenizer``'s chat template (refused when it
    has none), the others need no tokenizer."""
    check_template(template)
    if template != "chat":
        return PromptStyle(template)  # type: ignore[arg-type]
    if tokenizer is None:
        raise MtaError("template chat needs a tokenizer whose chat template renders the prompts")
    return PromptStyle("chat", ChatTemplate.load(tokenizer), rendered_by)


def recorded_template(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The template an annotate manifest records; a manifest without one (every artefact made
    before templates were recorded) was built with ``alpaca``."""
    recorded = manifest.get("template")
    return dict(recorded) if isinstance(recorded, dict) else {"name": DEFAULT_TEMPLATE}


def build_prompt(
    template: str,
    chat: ChatTemplate | None = None,
    *,
    prompt: str | None = None,
    instruction: str | None = None,
    context: str | None = None,
    turns: Sequence[Turn] | None = None,
) -> str:
    """The prompt of one row under ``template`` (rules in the module docstring).

    A row gives ``turns`` (a conversation's prompt turns, see :func:`split_conversation`), or
    some of ``prompt`` (its prompt string), ``instruction`` and ``context`` (its input).
    ``chat`` is the chat template (``template == "chat"`` only).
    """
    if template == "chat":
        if chat is None:
            raise ValueError("template chat needs a ChatTemplate")
        if turns is None:
            if instruction is not None:
                turns = [{"role": "user", "content": f"{instruction}\n\n{context}" if context else instruction}]
            elif prompt is not None:
                turns = [{"role": "user", "content": prompt}]
            else:
                raise ValueError("build_prompt needs a prompt, an instruction or turns")
        return chat.render(turns)
    if turns is not None:
        if template == "alpaca" and len(turns) == 1 and turns[0]["role"] == "user":
            return alpaca_prompt(turns[0]["content"])
        shape = " + ".join(turn["role"] for turn in turns)
        why = (
            f"a conversation whose prompt is {shape} has no Alpaca form (only a single user turn has)"
            if template == "alpaca"
            else "template none uses a row's 'prompt' string as given, and a conversation has none"
        )
        raise PromptProblem(NO_PROMPT, f"{why}; {CHOOSE_CHAT}")
    if prompt is not None:
        return prompt
    if template == "none":
        raise PromptProblem(
            NO_PROMPT,
            "template none uses the row's 'prompt' as given, and this row has none; add a "
            "'prompt', or use template alpaca (the Alpaca prompt of its instruction) or chat",
        )
    if instruction is None:
        raise ValueError("build_prompt needs a prompt, an instruction or turns")
    return alpaca_prompt(instruction, context)


def _kind(value: Any) -> str:
    kinds = {
        list: "an array",
        dict: "an object",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
    }
    text = json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= 40 else text[:39] + "…"
    return "null" if value is None else f"{kinds.get(type(value), type(value).__name__)}: {text}"


def _shown(value: Any) -> str:
    return "null (missing)" if value is None else repr(value) if isinstance(value, str) else _kind(value)
