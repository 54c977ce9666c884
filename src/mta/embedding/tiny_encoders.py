"""Tiny random BERT encoders and WordPiece tokenizers, built offline (tiny-embed recipe, tests).

The embedding side of :mod:`mta.models.tiny`: a random ``BertModel`` (loads with
``AutoModel.from_pretrained``) with a WordPiece tokenizer beside it, trained in a second on the
example texts shipped in ``recipes/examples/*.jsonl`` (every string field of every
row), ``[CLS] text [SEP]`` framing, lower-cased like ``bert-base-uncased``.

Directories are keyed on what they are built from, as the recipe's tiny causal models are: the
model of ``build_tiny_encoder(DIR, ...)`` lives at ``DIR-<key>`` (``KEY_LENGTH`` hex digits of
the sha256 of its description and its tokenizer's fingerprint), so a changed description builds
a new directory instead of reusing or overwriting the old one, and an existing one is reused.
Both the tokenizer and the model directory appear atomically (:func:`mta.files.atomic_directory`).

With ``pooling`` the directory is also a sentence-transformers model (``modules.json``,
``sentence_bert_config.json``, ``1_Pooling/config.json``, ``2_Normalize`` when ``normalize``:
:func:`mta.embedding.export.write_sentence_transformers_modules`), so ``SentenceTransformer(dir)``
loads it and ``mta embed`` reads its pooling as it reads a real one's.
"""

from __future__ import annotations

from pathlib import Path

from mta.embedding.export import write_sentence_transformers_modules
from mta.files import atomic_directory
from mta.hashing import json_sha256
from mta.models.tiny import corpus_texts, keyed_directory
from mta.training.config.catalog import SHIPPED_DIR

EXAMPLES_DIR = SHIPPED_DIR / "examples"
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4, in this order
POOLING_MODES = ("mean", "cls", "max")


def example_texts() -> list[str]:
    """Every string field of every row of the shipped example JSONL files (sorted by name)."""
    texts: list[str] = []
    for path in sorted(EXAMPLES_DIR.glob("*.jsonl")):
        texts.extend(corpus_texts(path))
    return texts


def build_wordpiece_tokenizer(out_dir: str | Path, *, vocab_size: int = 512, texts: list[str] | None = None):
    """Train (once) a lower-cased WordPiece tokenizer (BERT's normaliser, pre-tokenizer and
    ``[CLS] $A [SEP]`` post-processor) on ``texts`` (default: :func:`example_texts`) and save it
    as a ``BertTokenizerFast`` directory; an existing ``out_dir`` is reused. Returns the loaded
    tokenizer."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(out_dir))
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(WORDPIECE_SPECIALS), show_progress=False
    )
    backend.train_from_iterator(texts if texts is not None else example_texts(), trainer=trainer)
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tokenizer = BertTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        do_lower_case=True,
        model_max_length=512,
    )
    with atomic_directory(out_dir) as staging:
        tokenizer.save_pretrained(str(staging))
    return AutoTokenizer.from_pretrained(str(out_dir))


def build_tiny_encoder(
    directory: str | Path,
    *,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    vocab_size: int | None = 512,
    seed: int = 0,
    tokenizer: str | Path | None = None,
    pooling: str | None = None,
    normalize: bool = False,
    max_position: int = 512,
) -> Path:
    """Build (once) a random ``BertModel`` + tokenizer at ``<directory>-<key>``; return that path.

    layers / hidden / heads: the encoder's size (intermediate size 4 x hidden, as BERT's).
    tokenizer: a tokenizer directory to use; None trains a WordPiece of ``vocab_size`` tokens on
    the shipped example texts into ``<directory's parent>/wordpiece-<vocab_size>-<key>`` (shared
    by every encoder of that vocabulary). vocab_size: the tokenizer's size to train; with a given
    ``tokenizer``, None (its own size) or a size at least its length (extra rows never used).
    seed: the weights' random seed. pooling: ``mean`` / ``cls`` / ``max`` also writes the
    sentence-transformers modules (``normalize`` adds a Normalize module), None writes a plain
    Hugging Face directory. The key covers all of these and the tokenizer's fingerprint.
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from mta.errors import MtaError
    from mta.models.tokenizers import tokenizer_fingerprint

    directory = Path(directory)
    if pooling is not None and pooling not in POOLING_MODES:
        raise MtaError(f"tiny encoder pooling '{pooling}': choose one of {', '.join(POOLING_MODES)} (or none)")
    if hidden % heads:
        raise MtaError(f"tiny encoder: hidden ({hidden}) must be a multiple of heads ({heads})")
    if tokenizer is None:
        size = vocab_size or 512
        corpus_key = json_sha256({"texts": example_texts(), "vocab_size": size})
        tokenizer_dir = directory.parent / f"wordpiece-{size}-{corpus_key[:12]}"
        loaded = build_wordpiece_tokenizer(tokenizer_dir, vocab_size=size)
    else:
        loaded = AutoTokenizer.from_pretrained(str(tokenizer))
    rows = len(loaded) if vocab_size is None or tokenizer is None else vocab_size
    if rows < len(loaded):
        raise MtaError(f"tiny encoder vocab_size {vocab_size} is smaller than the tokenizer ({len(loaded)} tokens)")
    description = {
        "kind": "bert-encoder",
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "vocab_rows": rows,
        "seed": seed,
        "pooling": pooling,
        "normalize": normalize,
        "max_position": max_position,
        "tokenizer": tokenizer_fingerprint(loaded),
    }
    out_dir = keyed_directory(directory, description)
    if (out_dir / "config.json").exists():
        return out_dir
    config = BertConfig(
        vocab_size=rows,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max_position,
        pad_token_id=loaded.pad_token_id if loaded.pad_token_id is not None else 0,
    )
    torch.manual_seed(seed)
    model = BertModel(config)  # with its (unused) pooler, so AutoModel loads every weight
    with atomic_directory(out_dir) as staging:
        model.save_pretrained(staging)
        loaded.save_pretrained(str(staging))
        if pooling is not None:
            write_sentence_transformers_modules(
                staging, hidden=hidden, pooling=pooling, normalize=normalize, max_seq_length=max_position
            )
    return out_dir
