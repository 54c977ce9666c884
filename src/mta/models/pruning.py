"""Layer-pruned students: keep K of a teacher's decoder blocks, copy everything else.

A pruned copy of the teacher is the usual student initialisation when no smaller pretrained
model of the same family exists. The kept blocks are copied weight for weight into a *fresh*
model built from the pruned config, so every per-layer attribute (attention ``layer_idx``, cache
slots, sliding-window flags) is derived anew and consistent, and the result reloads with plain
``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import copy
from enum import Enum
from pathlib import Path

from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from mta.errors import MtaError
from mta.files import atomic_directory, atomic_write_json
from mta.models.hub import load_pretrained
from mta.models.tokenizers import load_tokenizer

INIT_RECORD = "mta_init.json"


class LayerPick(str, Enum):
    """How to choose the kept blocks when the user gives only their number."""

    evenly = "evenly"
    first_last = "first-last"


def evenly_spaced(n: int, k: int) -> list[int]:
    """``k`` of ``range(n)``, evenly spaced, including the first and the last (k = 1: the first).

    Position i sits at i·(n−1)/(k−1) rounded half up (integer arithmetic, so no float or
    banker's-rounding surprises): ``evenly_spaced(30, 10) == [0, 3, 6, 10, 13, 16, 19, 23, 26, 29]``.
    """
    _check_count(n, k)
    if k == 1:
        return [0]
    return [(2 * i * (n - 1) + (k - 1)) // (2 * (k - 1)) for i in range(k)]


def first_and_last(n: int, k: int) -> list[int]:
    """The first ⌈k/2⌉ and the last ⌊k/2⌋ of ``range(n)``: the bottom and top of the stack."""
    _check_count(n, k)
    head = (k + 1) // 2
    return list(range(head)) + list(range(n - (k - head), n))


def pick_layers(n: int, k: int, pick: LayerPick | str = LayerPick.evenly) -> list[int]:
    """The block indices (0-based) to keep from a stack of ``n``."""
    return evenly_spaced(n, k) if _layer_pick(pick) is LayerPick.evenly else first_and_last(n, k)


def _layer_pick(pick: LayerPick | str) -> LayerPick:
    try:
        return LayerPick(pick)
    except ValueError:
        choices = ", ".join(choice.value for choice in LayerPick)
        raise MtaError(f"--pick must be one of {choices}; got '{pick}'") from None


def _check_count(n: int, k: int) -> None:
    if not 1 <= k <= n:
        raise MtaError(f"cannot keep {k} of {n} layers: choose --layers between 1 and {n}")


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The (qualified name, module) of the model's one stack of ``num_hidden_layers`` blocks.

    Found by shape rather than by name so any decoder-only family works (``model.layers`` for
    Llama/Qwen2/Mistral, ``transformer.h`` for GPT-2, ``model.decoder.layers`` for OPT).
    """
    config = getattr(model, "config", None)
    num_layers = getattr(config, "num_hidden_layers", None)
    name = type(model).__name__
    if config is None or not isinstance(num_layers, int):
        raise MtaError(f"{name} has no config.num_hidden_layers: only Hugging Face causal LMs can be pruned")
    if getattr(config, "is_encoder_decoder", False):
        raise MtaError(
            f"{name} is an encoder-decoder model; init-student prunes decoder-only causal LMs "
            "(Llama, Qwen2, Mistral, GPT-2, OPT, ...)"
        )
    stacks = [
        (qualified, module)
        for qualified, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers
    ]
    if len(stacks) != 1:
        found = ", ".join(qualified for qualified, _ in stacks) or "none"
        raise MtaError(
            f"cannot tell which block list of {name} holds its {num_layers} layers "
            f"(candidates: {found}); init-student supports decoder-only causal LMs with one "
            "stack of blocks (Llama, Qwen2, Mistral, GPT-2, OPT, ...)"
        )
    return stacks[0]


def pruned_config(config, keep: list[int]):
    """A copy of ``config`` with ``keep``'s length as its layer count and per-layer lists sliced."""
    num_layers = config.num_hidden_layers
    # GPT-2 and OPT spell the count differently; the attribute map says how.
    count_key = config.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    values = config.to_dict()
    for key, value in values.items():
        # Per-layer settings (e.g. Qwen2/Mistral `layer_types`) are lists as long as the stack.
        if isinstance(value, list) and len(value) == num_layers and num_layers > 1:
            values[key] = [value[index] for index in keep]
    values[count_key] = len(keep)
    return type(config).from_dict(values)


def prune_layers(model: PreTrainedModel, keep: list[int], *, build=None) -> PreTrainedModel:
    """A new model holding only the blocks ``keep`` (ascending, 0-based) of ``model``.

    Embeddings, final norm and LM head are copied unchanged; block ``keep[i]`` of the source
    becomes block ``i``. The source model is left untouched. ``build(config, dtype=...)`` makes
    the fresh model: ``AutoModelForCausalLM.from_config`` by default, ``AutoModel.from_config``
    for an encoder (the embedding wing prunes its encoders through this).
    """
    prefix, blocks = decoder_blocks(model)
    num_layers = len(blocks)
    if not keep or sorted(set(keep)) != list(keep) or keep[0] < 0 or keep[-1] >= num_layers:
        raise MtaError(f"layers to keep must be distinct, ascending indices in 0..{num_layers - 1}; got {keep}")
    if getattr(model.config, "scale_attn_by_inverse_layer_idx", False):
        # GPT-2 can scale attention by 1/(layer index + 1): renumbering blocks would change
        # what every kept block computes, so the copy would not be the teacher's blocks.
        raise MtaError(
            "this GPT-2 checkpoint sets scale_attn_by_inverse_layer_idx, which ties each block "
            "to its position; it cannot be layer-pruned"
        )

    position_of = {index: position for position, index in enumerate(keep)}
    state = {}
    for key, tensor in model.state_dict().items():
        if key.startswith(prefix + "."):
            index, rest = key[len(prefix) + 1 :].split(".", 1)
            if int(index) not in position_of:
                continue
            key = f"{prefix}.{position_of[int(index)]}.{rest}"
        state[key] = tensor

    build = build or AutoModelForCausalLM.from_config
    student = build(pruned_config(model.config, keep), dtype=model.dtype)
    student.load_state_dict(state, strict=True)
    if model.can_generate():
        student.generation_config = copy.deepcopy(model.generation_config)
    return student.to(model.device)


def init_student(
    teacher: str | Path,
    out_dir: str | Path,
    *,
    num_layers: int | None = None,
    pick: LayerPick | str = LayerPick.evenly,
    keep: list[int] | None = None,
    force: bool = False,
) -> dict:
    """Save a layer-pruned copy of ``teacher`` (directory or hub name) with its tokenizer.

    Give ``num_layers`` (chosen by ``pick``) or an explicit ``keep`` list. Writes the model,
    the tokenizer and ``mta_init.json`` atomically into ``out_dir``; returns that record.
    An existing ``out_dir`` is replaced only with ``force``.
    """
    out_dir = Path(out_dir)
    if num_layers is None and keep is None:
        raise MtaError("say how many layers to keep (--layers K) or which (--keep 0,5,9)")
    if num_layers is not None and keep is not None:
        raise MtaError("say how many layers to keep (--layers K) or which (--keep 0,5,9), not both")
    pick = _layer_pick(pick)
    if out_dir.exists() and not force:
        raise MtaError(f"{out_dir} already exists; choose another -o or pass --force to replace it")
    try:
        model = load_pretrained(AutoModelForCausalLM.from_pretrained, teacher, what="--from", dtype="auto")
    except MtaError:
        raise
    except (OSError, ValueError) as error:
        raise MtaError(
            f"cannot load '{teacher}' as a causal LM: {error}. Give a directory holding a "
            "Hugging Face checkpoint (config.json + weights) of a decoder-only model"
        ) from error
    tokenizer = load_tokenizer(teacher)
    source_layers = model.config.num_hidden_layers
    chosen = list(keep) if keep is not None else pick_layers(source_layers, num_layers, pick)
    student = prune_layers(model, chosen)

    record = {
        "source": str(Path(teacher).resolve()) if Path(teacher).exists() else str(teacher),
        "model_type": model.config.model_type,
        "source_num_layers": source_layers,
        "kept_layers": chosen,
        "pick": "explicit" if keep is not None else pick.value,
        "source_parameters": model.num_parameters(),
        "parameters": student.num_parameters(),
    }
    with atomic_directory(out_dir) as staging:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        atomic_write_json(staging / INIT_RECORD, record)
    return record
