"""The recipe's ``deepspeed:`` passthrough: what it may set, checked against the installed DeepSpeed.

The recipe owns batch sizes, precision, clipping, the optimizer, the schedule and the ZeRO stage
(``DEEPSPEED_KEYS_OWNED_BY_RECIPE``: a passthrough value would silently disagree with what the run
prints); everything else passes verbatim, but only keys the installed DeepSpeed reads
(``deepspeed_setting_names``, asked of DeepSpeed itself), with a close match named for a typo,
and only finite numbers.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

from mta.errors import close_match
from mta.training.config.yaml_reader import yaml_text

log = logging.getLogger(__name__)


# DeepSpeed keys the schema sets itself, with the recipe key to use instead: a passthrough value
# would silently disagree with the printed global batch, precision or ZeRO stage.
DEEPSPEED_KEYS_OWNED_BY_RECIPE = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.batch_size and train.micro_batch_size",
    "gradient_clipping": "train.grad_clip",
    "bf16": "train.precision",
    "bfloat16": "train.precision",  # DeepSpeed's older name for bf16
    "fp16": "train.precision",
    "optimizer": "train.optimizer, train.lr, train.betas and train.weight_decay",
    "scheduler": "train.schedule and train.warmup_steps",
    "zero_optimization.stage": "train.zero_stage",
}

# Sections the recipe owns part of: they must stay mappings, since the passthrough is merged into
# mta's own section key by key. DeepSpeed reads `zero_optimization: true` as ZeRO stage 1, so a
# non-mapping value would replace train.zero_stage without a word.
DEEPSPEED_SECTIONS_OWNED_IN_PART = tuple(
    sorted({key.rpartition(".")[0] for key in DEEPSPEED_KEYS_OWNED_BY_RECIPE if "." in key})
)

# Top-level keys `deepspeed.initialize` itself reads from the config, outside DeepSpeedConfig
# (the device mesh for sequence parallelism), which the probe below cannot see.
_DEEPSPEED_KEYS_READ_BY_INITIALIZE = frozenset({"sequence_parallel_size", "data_parallel_size"})

DEEPSPEED_CONFIG_DOCS = "https://www.deepspeed.ai/docs/config-json/"


class _KeysLookedUp(dict):
    """A dict that notes every key looked up in it (``[]``, ``get``, ``in``, ``.keys()``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # In __dict__, so the shallow copy DeepSpeedConfig takes shares the record.
        self.looked_up: set[Any] = set()

    def __getitem__(self, key: Any) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, *default: Any) -> Any:
        self.looked_up.add(key)
        return super().get(key, *default)

    def __contains__(self, key: Any) -> bool:
        self.looked_up.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:
        outer = self

        class Keys:
            def __contains__(self, key: Any) -> bool:
                return outer.__contains__(key)

            def __iter__(self) -> Iterator[Any]:
                return iter(dict.keys(outer))

            def __len__(self) -> int:
                return dict.__len__(outer)

        return Keys()


class _OneDataParallelRank:
    """The ``mpu`` argument that makes DeepSpeedConfig assume a world of one process."""

    @staticmethod
    def get_data_parallel_world_size() -> int:
        return 1


@functools.cache
def deepspeed_setting_names() -> frozenset[str] | None:
    """The top-level config keys the installed DeepSpeed reads, or None if it cannot be asked.

    Asked, not listed: a ``DeepSpeedConfig`` is built over a minimal config that records every
    key DeepSpeed looks up in it (each section reader probes its key), plus the few keys
    ``deepspeed.initialize`` reads itself. Keys DeepSpeed has removed are in the result (it looks
    them up to refuse them); ``deepspeed_removed_settings`` has its message for each. Imports
    DeepSpeed (about a second), once per process, and only for recipes with a ``deepspeed:`` mapping.
    """
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        probe = _KeysLookedUp(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
        DeepSpeedConfig(probe, mpu=_OneDataParallelRank())
    except Exception as error:  # not installed, or its config reader changed shape
        log.warning("cannot list DeepSpeed's config keys (%s); deepspeed: keys are not checked", error)
        return None
    names = {key for key in probe.looked_up if isinstance(key, str)}
    return frozenset(names | _DEEPSPEED_KEYS_READ_BY_INITIALIZE)


@functools.cache
def deepspeed_removed_settings() -> dict[str, str]:
    """DeepSpeed's own message for each top-level key it has removed (it refuses them at start)."""
    try:
        from deepspeed.runtime import config

        return dict(getattr(config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    except Exception:
        return {}


def _deepspeed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "?"


def deepspeed_problem(settings: dict[str, Any], recipe_keys: Iterable[str] = ()) -> tuple[tuple[Any, ...], str] | None:
    """The first problem in the ``deepspeed:`` mapping as ``(path inside it, message)``;
    ``recipe_keys`` (the ``train:`` keys) are suggested for a misplaced recipe setting."""
    known = deepspeed_setting_names() if settings else None
    removed = deepspeed_removed_settings() if settings else {}
    for key, value in settings.items():
        if key in DEEPSPEED_KEYS_OWNED_BY_RECIPE:
            return (key,), _owned_message(key)
        if key in removed:
            return (key,), f"removed from DeepSpeed {_deepspeed_version()}: {removed[key].strip()}"
        if known is not None and key not in known:
            return (key,), _unknown_deepspeed_key(key, known, recipe_keys)
        if key in DEEPSPEED_SECTIONS_OWNED_IN_PART:
            if not isinstance(value, dict):
                return (key,), (
                    f"must be a mapping of DeepSpeed {key} settings, got {yaml_text(value)}; mta merges it "
                    f"into its own {key} section key by key (a non-mapping would replace "
                    f"{_owned_keys_in(key)}). Set those with their recipe keys and write the rest "
                    f"as deepspeed.{key}.<setting>"
                )
            for leaf in value:
                if f"{key}.{leaf}" in DEEPSPEED_KEYS_OWNED_BY_RECIPE:
                    return (key, leaf), _owned_message(f"{key}.{leaf}")
    for path, value in _numbers_in(settings, ()):
        if not math.isfinite(value):
            return path, f"must be a finite number (got {value!r})"
    return None


def _owned_message(key: str) -> str:
    return (
        f"set by the recipe from {DEEPSPEED_KEYS_OWNED_BY_RECIPE[key]}; set it there and remove "
        "it from the deepspeed: mapping"
    )


def _owned_keys_in(section: str) -> str:
    return ", ".join(
        recipe_key for key, recipe_key in DEEPSPEED_KEYS_OWNED_BY_RECIPE.items() if key.startswith(section + ".")
    )


def _unknown_deepspeed_key(key: str, known: frozenset[str], recipe_keys: Iterable[str]) -> str:
    message = (
        f"not a setting DeepSpeed {_deepspeed_version()} reads (it ignores unknown keys, so this would have no effect)"
    )
    match = close_match(key, sorted(known))
    recipe_key = close_match(key, recipe_keys)
    if match:
        message += f"; did you mean deepspeed.{match}?"
    elif recipe_key:
        message += f"; did you mean the recipe key train.{recipe_key}?"
    return message + f" (DeepSpeed's settings: {DEEPSPEED_CONFIG_DOCS})"


def _numbers_in(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], float]]:
    """``(path, value)`` of every float inside nested mappings and lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers_in(value, path + (key,))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _numbers_in(value, path + (index,))
    elif isinstance(node, float):
        yield path, node
