"""Length limits applied to the *text*, so both tokenizers see the same string (docs/method.md §1).

- The prompt may hold at most ``max_prompt_length`` tokens on each side (prompt tokens are those
  starting before the end of the prompt). A longer prompt is skipped, or with ``truncate_prompt``
  keeps its head, as the published processing did (that loses the ``### Response:`` line).
- The whole sequence may hold at most ``max_length`` ids on each side, EOS included. A longer
  response is cut at the last character where both tokenizers stay within the limit, and then
  gets no EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from mta.data.token_ranges import prompt_token_count
from mta.data.encoding import Encoding, TokenizerSide


@dataclass(frozen=True)
class FittedText:
    """A text within the limits, with its encoding on each side (EOS not included)."""

    text: str
    prompt_chars: int
    complete: bool  # the response is whole: EOS is appended to the ids
    prompt_cut: bool
    encodings: tuple[Encoding, ...]
    uncut_text: str  # prompt + whole response: what spaCy parses, so cut phrases are seen whole

    @property
    def response_cut(self) -> bool:
        return not self.complete


@dataclass(frozen=True)
class PromptTooLong:
    """The prompt is over the limit on at least one side, and cutting it was not asked for."""

    tokens: int
    side: str  # "teacher" or "student"
    limit: int

    @property
    def message(self) -> str:
        return (
            f"the prompt is {self.tokens} tokens for the {self.side}, over --max-prompt-length {self.limit} "
            "(pass --truncate-prompt to keep its head instead of skipping the row)"
        )


def last_fitting_cut(text: str, lowest: int, estimate: int, fits: Callable[[int], bool]) -> int:
    """The cut ``c`` in ``[lowest, len(text)]`` where ``text[:c]`` fits and ``text[:c + 1]`` does not.

    ``fits(lowest)`` must hold. Token counts grow with the prefix almost always, so the search
    starts at ``estimate`` (taken from the offsets of the full encoding), gallops to bracket the
    boundary, then bisects: a handful of encodes per row instead of one per character.
    """
    low, high = lowest, None  # invariant: fits(low); high is None or not fits(high)
    probe, step = min(max(estimate, lowest), len(text)), 1
    while high is None:
        if fits(probe):
            low = probe
            if probe == len(text):
                return probe
            probe, step = min(probe + step, len(text)), step * 2
        else:
            high = probe
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def encode_all(sides: Sequence[TokenizerSide], text: str) -> list[Encoding]:
    """Each side's encoding of ``text``; a tokenizer that stands on both sides encodes once."""
    done: dict[int, Encoding] = {}
    for side in sides:
        if id(side) not in done:
            done[id(side)] = side.encode(text)
    return [done[id(side)] for side in sides]


def _estimate(encodings: Sequence[Encoding], limit: int, default: int) -> int:
    """Where the ``limit``-th token ends on the side that reaches it first."""
    ends = [int(encoding.offsets[limit - 1, 1]) for encoding in encodings if len(encoding) > limit]
    return min(ends) if ends else default


def fit_to_limits(
    prompt: str,
    response: str,
    sides: Sequence[TokenizerSide],
    *,
    max_length: int,
    max_prompt_length: int,
    truncate_prompt: bool = False,
    roles: Sequence[str] = ("teacher", "student"),
) -> FittedText | PromptTooLong:
    """Apply the prompt and total limits to ``prompt + response`` for every side at once.

    ``roles`` names the sides in messages.
    """
    text = prompt + response
    encodings = encode_all(sides, text)
    prompt_cut = False
    prompt_lengths = [prompt_token_count(encoding.offsets, len(prompt)) for encoding in encodings]
    if max(prompt_lengths) > max_prompt_length:
        worst = int(np.argmax(prompt_lengths))
        if not truncate_prompt:
            return PromptTooLong(prompt_lengths[worst], roles[worst], max_prompt_length)

        def prompt_fits(cut: int) -> bool:
            return all(
                prompt_token_count(encoding.offsets, cut) <= max_prompt_length
                for encoding in encode_all(sides, prompt[:cut] + response)
            )

        cut = last_fitting_cut(
            prompt, 0, _estimate(encodings, max_prompt_length, len(prompt)), prompt_fits
        )
        prompt, prompt_cut = prompt[:cut], True
        text = prompt + response
        encodings = encode_all(sides, text)

    if all(len(encoding) + 1 <= max_length for encoding in encodings):  # + 1: EOS
        return FittedText(text, len(prompt), True, prompt_cut, tuple(encodings), text)

    cache: dict[int, list[Encoding]] = {}

    def whole_fits(cut: int) -> bool:
        cache[cut] = encode_all(sides, text[:cut])
        return all(len(encoding) <= max_length for encoding in cache[cut])

    cut = last_fitting_cut(text, len(prompt), _estimate(encodings, max_length, len(text)), whole_fits)
    if cut not in cache:
        whole_fits(cut)
    return FittedText(text[:cut], len(prompt), False, prompt_cut, tuple(cache[cut]), text)
