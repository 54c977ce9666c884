"""Length limits applied to the *text*, so both tokenizers see the same string (docs/method.md §1).

- The prompt may hold at most ``max_prompt_length`` tokens on each side (prompt tokens are those
  starting before the end of the prompt). A longer prompt is skipped, or with ``truncate_prompt``
  keeps its head, as the published processing did (that loses the ``### Response:`` line).
- The whole sequence may hold at most ``max_length`` ids on each side, EOS included. A longer
  response is cut at the last character where both tokenizers stay within the limit, and then
  gets no EOS.

Cost is bounded by the limits, not by the row: every decision above depends only on the first
``max_length + 1`` tokens of each side, so a long text is encoded through a window of its head
(grown 4x until it holds that many tokens on every side) instead of whole. A token is final once
the window runs ``LOCALITY_CHARS`` past it (tokenizers split text into words before they merge
pieces, so a token cannot depend on text a word later); an ordinary row fits in the first window
and is encoded whole, exactly as before. What spaCy parses is bounded the same way
(:attr:`FittedText.parse_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mta.data.encoding import Encoding, TokenizerSide
from mta.data.token_ranges import prompt_token_count

# Characters after a token within which more text can still change it (one word, generously):
# a window's tokens that end this far before its end are those of the whole text.
LOCALITY_CHARS = 1000
# The first window holds this many characters per token of max_length, so every ordinary row
# (up to ~16 characters per token on average; English runs at ~4) is encoded whole.
WINDOW_CHARS_PER_TOKEN = 16
# spaCy parses this far past the cut, so a phrase the cut splits is recognised and dropped
# instead of being parsed as a shorter phrase that never was one. On the instruction sets in
# ../shared (2,072 cut rows at max_length 128, 256 and 512, GPT-2 tokenizer) the kept spans equal
# those of a whole-text parse from a margin of 400 characters on; this is five times that.
PARSE_MARGIN_CHARS = 2000
# How far past a candidate cut of the prompt its probe's window knows the text: a response token
# starting within it makes the probe's prompt count exact.
PROMPT_PROBE_CHARS = 256


@dataclass(frozen=True)
class FittedText:
    """A text within the limits, with its encoding on each side (EOS not included)."""

    text: str
    prompt_chars: int
    complete: bool  # the response is whole: EOS is appended to the ids
    prompt_cut: bool
    encodings: tuple[Encoding, ...]
    response: str  # the whole response, of which ``text`` keeps the head (not copied: the row's)

    @property
    def response_cut(self) -> bool:
        return not self.complete

    @property
    def parse_text(self) -> str:
        """What spaCy parses: ``text`` and up to ``PARSE_MARGIN_CHARS`` of what was cut after
        it, so a phrase the cut splits is seen whole (and dropped), while a multi-megabyte
        response costs no more than one at the limit."""
        kept = len(self.text) - self.prompt_chars
        return self.text[: self.prompt_chars] + self.response[: kept + PARSE_MARGIN_CHARS]


@dataclass(frozen=True)
class PromptTooLong:
    """The prompt is over the limit on at least one side, and cutting it was not asked for."""

    tokens: int
    side: str  # "teacher" or "student"
    limit: int
    at_least: bool = False  # a prompt longer than the encoding window: ``tokens`` is a lower bound

    @property
    def message(self) -> str:
        return (
            f"the prompt is {'at least ' if self.at_least else ''}{self.tokens} tokens for the "
            f"{self.side}, over --max-prompt-length {self.limit} "
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


@dataclass(frozen=True)
class _Window:
    """Each side's encoding of the head of a text; ``known[i]``: how many leading tokens of side
    ``i`` are certainly those of the whole text's encoding (all of them when ``whole``)."""

    encodings: list[Encoding]
    known: list[int]
    whole: bool = False

    def prompt_lengths(self, prompt_chars: int) -> tuple[list[int], bool]:
        """Each side's prompt tokens among the known ones, and whether every count is exact
        (a known token starts after the prompt, or the window is the whole text)."""
        counts = [
            (prompt_token_count(encoding.offsets[:known], prompt_chars), known)
            for encoding, known in zip(self.encodings, self.known, strict=True)
        ]
        exact = self.whole or all(length < known for length, known in counts)
        return [length for length, _ in counts], exact


def _encode_head(
    sides: Sequence[TokenizerSide], text: str, known_chars: int, enough: Callable[[_Window], bool]
) -> _Window:
    """The smallest window from ``known_chars`` up (x4 each time) that is ``enough``, or the
    whole text. A window encodes ``text[:known_chars + LOCALITY_CHARS]``; its tokens ending by
    ``known_chars`` are known."""
    while True:
        if known_chars + LOCALITY_CHARS >= len(text):
            encodings = encode_all(sides, text)
            return _Window(encodings, [len(encoding) for encoding in encodings], whole=True)
        encodings = encode_all(sides, text[: known_chars + LOCALITY_CHARS])
        known = []
        for encoding in encodings:
            beyond = encoding.offsets[:, 1] > known_chars
            known.append(int(np.argmax(beyond)) if beyond.any() else len(encoding))
        window = _Window(encodings, known)
        if enough(window):
            return window
        known_chars *= 4


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

    ``roles`` names the sides in messages. Only the head of a long text is encoded (module
    docstring); the result is the one a whole-text encoding gives.
    """
    text = prompt + response
    deciding = max_length + 1  # tokens per side that decide both limits and the cut estimate
    first_window = max_length * WINDOW_CHARS_PER_TOKEN

    def decides(window: _Window) -> bool:
        return all(known >= deciding for known in window.known)

    window = _encode_head(sides, text, first_window, decides)
    prompt_cut = False
    prompt_lengths, exact = window.prompt_lengths(len(prompt))
    if max(prompt_lengths) > max_prompt_length:
        worst = int(np.argmax(prompt_lengths))
        if not truncate_prompt:
            return PromptTooLong(prompt_lengths[worst], roles[worst], max_prompt_length, not exact)

        def prompt_fits(cut: int) -> bool:
            def decided(head: _Window) -> bool:
                lengths, exact = head.prompt_lengths(cut)
                return exact or max(lengths) > max_prompt_length

            head = _encode_head(sides, prompt[:cut] + response, cut + PROMPT_PROBE_CHARS, decided)
            return max(head.prompt_lengths(cut)[0]) <= max_prompt_length

        cut = last_fitting_cut(prompt, 0, _estimate(window.encodings, max_prompt_length, len(prompt)), prompt_fits)
        prompt, prompt_cut = prompt[:cut], True
        text = prompt + response
        window = _encode_head(sides, text, first_window, decides)

    encodings = window.encodings
    if window.whole and all(len(encoding) + 1 <= max_length for encoding in encodings):  # + 1: EOS
        return FittedText(text, len(prompt), True, prompt_cut, tuple(encodings), response)
    # A window that is not whole knows more than max_length tokens on every side: no fit.

    cache: dict[int, list[Encoding]] = {}

    def whole_fits(cut: int) -> bool:
        cache[cut] = encode_all(sides, text[:cut])
        return all(len(encoding) <= max_length for encoding in cache[cut])

    cut = last_fitting_cut(text, len(prompt), _estimate(encodings, max_length, len(text)), whole_fits)
    if cut not in cache:
        whole_fits(cut)
    return FittedText(text[:cut], len(prompt), False, prompt_cut, tuple(cache[cut]), response)
