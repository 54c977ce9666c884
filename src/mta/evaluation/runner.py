"""The whole evaluation: checkpoints x sets x seeds, resumable, shardable under torchrun.

Up front, before any model loads: every checkpoint is checked (config, tokenizer, whole weights),
fingerprinted (``mta.models.weights``; its checksum list verified) and its directory's claim compared
(``layout``), so a changed or broken fifth checkpoint fails at once.
For each checkpoint: claim its directory, generate what its predictions files lack
(rows split over ranks, each finished row journalled as its batch ends, see ``predictions``),
score perplexity when asked, then build results.json and results.md from the files alone
(``results``, ``report``). Because each row's sampling noise is keyed by (seed, set, row), a
resumed or re-sharded run draws the same noise as an uninterrupted one. A full disk while
writing a journal, a predictions file or the results is one ``MtaError`` naming the file
(``mta.files.disk_full_is_reported``): finished files are intact and a re-run resumes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mta import distributed
from mta.data.prompts import PromptStyle, prompt_style
from mta.dtypes import dtype_name, resolve_dtype
from mta.errors import MtaError
from mta.evaluation.datasets import (
    EvalSet,
    default_data_dir,
    load_eval_set,
    load_rows,
    resolve_benchmarks,
    resolve_split_file,
)
from mta.evaluation.layout import FINGERPRINT, CheckpointPaths, check_claim, claim_directory, generation_manifest
from mta.evaluation.models_under_test import check_checkpoint, checkpoint_names, loaded_checkpoint
from mta.evaluation.predictions import finished_rows, is_complete, journal_record, write_predictions
from mta.evaluation.report import results_markdown
from mta.evaluation.results import collect_results
from mta.evaluation.settings import EvalSettings, evaluation_seed
from mta.files import Journal, atomic_write_json, atomic_write_text, disk_full_is_reported, make_output_directory
from mta.generation.generator import Generator, HFGenerator
from mta.models.weights import checkpoint_fingerprint, require_unchanged
from mta.reporting import Reporter, SilentReporter
from mta.scoring import completion_text

if TYPE_CHECKING:
    import torch

    from mta.evaluation.perplexity import PerplexitySet

log = logging.getLogger(__name__)


def evaluate_checkpoints(
    checkpoints: Sequence[str | Path],
    names: Sequence[str] | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path = "eval",
    settings: EvalSettings | None = None,
    reporter: Reporter | None = None,
    report_to: Sequence[str] = (),
) -> dict:
    """Generate, score and compare ``checkpoints``; returns what results.json holds.

    Every input is checked before the first model loads, each checkpoint's weights fingerprinted
    (predictions of other weights at the same path are refused, never reused). One model is in
    memory at a time. Under torchrun every rank must call this with the same arguments; rank 0
    writes results. report_to: experiment trackers (``mta.tracking``) that also get the results,
    checked before any work.
    """
    if report_to:  # mta.tracking (and a backend) only when results go to one
        from mta import tracking

        report_to = tracking.require(report_to, "--report-to")
    settings = settings or EvalSettings()
    reporter = reporter or SilentReporter()
    checkpoints = [str(c) for c in checkpoints]
    if not checkpoints:
        raise MtaError("give at least one checkpoint to evaluate")
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    out_dir = Path(out_dir)
    labels = checkpoint_names(checkpoints, names)
    distinct = list(dict.fromkeys(checkpoints))  # one path under two --names: checked and hashed once
    for checkpoint in distinct:
        check_checkpoint(checkpoint)
    fingerprint_of = {checkpoint: checkpoint_fingerprint(checkpoint) for checkpoint in distinct}
    fingerprints = [fingerprint_of[checkpoint] for checkpoint in checkpoints]
    found = resolve_benchmarks(
        data_dir, settings.benchmarks, split=settings.split, subset=settings.subset, revision=settings.revision
    )
    # The prompts of each checkpoint: with template chat, rendered with its own chat template.
    styles = [prompt_style(settings.template, checkpoint) for checkpoint in checkpoints]
    sets_of = {
        style: [load_eval_set(b, p, settings.limit, style, settings.fields) for b, p in found]
        for style in dict.fromkeys(styles)
    }
    perplexity_of = {style: _perplexity_set(data_dir, settings, style) for style in sets_of}
    eval_sets = sets_of[styles[0]]  # the sets' names, rows and references, the same for every style

    device = distributed.resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    manifests = [
        generation_manifest(checkpoint, settings, dtype, fingerprint, files)
        for checkpoint, (fingerprint, files) in zip(checkpoints, fingerprints, strict=True)
    ]
    for label, manifest in zip(labels, manifests, strict=True):
        check_claim(CheckpointPaths.of(out_dir, label), manifest)
    make_output_directory(out_dir)  # a read-only or full -o: one line before any model loads
    with distributed.joined_process_group():
        for checkpoint, label, manifest, style in zip(checkpoints, labels, manifests, styles, strict=True):
            paths = CheckpointPaths.of(out_dir, label)
            claim_directory(paths, manifest)
            _evaluate_checkpoint(
                checkpoint,
                manifest[FINGERPRINT],
                label,
                paths,
                sets_of[style],
                perplexity_of[style],
                settings,
                device,
                dtype,
                reporter,
            )
        distributed.barrier()
        results = collect_results(out_dir, checkpoints, labels, eval_sets, settings, data_dir, dtype_name(dtype))
        if distributed.is_main():
            _log_truncated_prompts(results, settings.max_prompt_length)
            with disk_full_is_reported(out_dir / "results.json"):
                atomic_write_json(out_dir / "results.json", results)
            with disk_full_is_reported(out_dir / "results.md"):
                atomic_write_text(out_dir / "results.md", results_markdown(results))
            if report_to:
                tracking.report_evaluation(report_to, out_dir, results, run_id=uuid.uuid4().hex)
        distributed.barrier()
        return results


def _perplexity_set(data_dir: Path, settings: EvalSettings, style: PromptStyle) -> PerplexitySet | None:
    if not settings.perplexity:
        return None
    from mta.evaluation.perplexity import PerplexitySet

    path = resolve_split_file(data_dir, settings.perplexity)
    return PerplexitySet(settings.perplexity, path, load_rows(path, limit=settings.perplexity_limit, style=style)[0])


def _perplexity_key(perplexity: PerplexitySet, settings: EvalSettings) -> dict:
    """What a stored perplexity.json must match to be reused: the set, lengths and template."""
    return {**perplexity.key(settings.max_prompt_length, settings.max_new_tokens), "template": settings.template}


def _evaluate_checkpoint(
    checkpoint: str,
    fingerprint: str,
    label: str,
    paths: CheckpointPaths,
    eval_sets: Sequence[EvalSet],
    perplexity: PerplexitySet | None,
    settings: EvalSettings,
    device: torch.device,
    dtype: torch.dtype,
    reporter: Reporter,
) -> None:
    """Generate what this checkpoint's directory lacks; load the model only when something does,
    and generate from it only when it is still the model ``fingerprint`` names."""
    todo = [(s, seed) for s in eval_sets for seed in settings.seeds if not is_complete(paths, s, seed)]
    wants_perplexity = perplexity is not None and not _perplexity_is_current(paths, perplexity, settings)
    if not todo and not wants_perplexity:
        log.info("%s: every predictions file is complete, nothing to generate", label)
        return
    if settings.engine == "vllm" and todo:
        from mta.generation.vllm_engine import vllm_generation
        from mta.models.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(checkpoint)
        length = settings.max_prompt_length + settings.max_new_tokens
        reporter.message(f"{label}: starting vLLM on {checkpoint}")
        with vllm_generation(
            checkpoint, tokenizer, settings.sampling(), dtype=dtype, device=device, max_model_len=length
        ) as generator:
            require_unchanged(checkpoint, fingerprint)
            reporter.message(f"{label}: {generator.engine.version} ready in {generator.engine.startup_s:.1f} s")
            for eval_set, seed in todo:
                _generate_set(generator, tokenizer, eval_set, seed, paths, settings, reporter, label)
        todo = []
        if not wants_perplexity:
            return
    with loaded_checkpoint(checkpoint, device, dtype) as (model, tokenizer):
        require_unchanged(checkpoint, fingerprint)
        generator = HFGenerator(model, tokenizer, settings.sampling(), batch_size=settings.batch_size)
        for eval_set, seed in todo:
            _generate_set(generator, tokenizer, eval_set, seed, paths, settings, reporter, label)
        if wants_perplexity:
            _write_perplexity(model, tokenizer, perplexity, paths, settings, reporter, label)
        del model, generator  # so that leaving the context really frees the weights


def _log_truncated_prompts(results: dict, limit: int) -> None:
    for label, run in results["checkpoints"].items():
        for name, summary in run["sets"].items():
            if summary["prompts_truncated"]:
                log.warning(
                    "%s: %d of %d %s prompts exceed %d tokens and keep their first %d, as the protocol does",
                    label,
                    summary["prompts_truncated"],
                    summary["rows"],
                    name,
                    limit,
                    limit,
                )


def _generate_set(
    generator: Generator,
    tokenizer,
    eval_set: EvalSet,
    seed: int,
    paths: CheckpointPaths,
    settings: EvalSettings,
    reporter: Reporter,
    label: str,
) -> None:
    """This rank's share of the rows still missing, journalled batch by batch; rank 0 then
    writes the scored predictions file."""
    done = finished_rows(paths, eval_set, seed)
    pending = [row for row in eval_set.rows if row.index not in done]
    distributed.barrier()  # every rank splits the same pending list before any journal grows
    mine = pending[distributed.rank() :: distributed.world_size()]
    prompts = [tokenizer(row.prompt, add_special_tokens=False)["input_ids"] for row in mine]
    truncated = [len(p) > settings.max_prompt_length for p in prompts]
    prompts = [p[: settings.max_prompt_length] for p in prompts]
    seeds = [evaluation_seed(seed, eval_set.name, row.index) for row in mine]
    if mine:
        journal_path = paths.journal(eval_set.name, seed, distributed.rank())
        reporter.start(f"{label} · {eval_set.name} · seed {seed}", len(mine), unit="rows")
        try:
            with disk_full_is_reported(journal_path), Journal(journal_path, inside=paths.out_dir) as journal:
                for completions in generator.generate(prompts, seeds):
                    journal.append(
                        journal_record(
                            mine[c.position], completion_text(tokenizer, c.token_ids), c, truncated[c.position]
                        )
                        for c in completions
                    )
                    reporter.advance(len(completions), tokens=sum(c.num_tokens for c in completions))
        finally:
            reporter.stop()
    distributed.barrier()
    if distributed.is_main():
        with disk_full_is_reported(paths.predictions(eval_set.name, seed)):
            write_predictions(paths, eval_set, seed)
    distributed.barrier()


def _perplexity_is_current(paths: CheckpointPaths, perplexity: PerplexitySet, settings: EvalSettings) -> bool:
    stored = paths.stored_perplexity()
    key = _perplexity_key(perplexity, settings)
    return stored is not None and all(stored.get(k) == v for k, v in key.items())


def _write_perplexity(model, tokenizer, perplexity: PerplexitySet, paths, settings, reporter, label) -> None:
    """Every rank scores its share; rank 0 writes perplexity.json."""
    from mta.evaluation.perplexity import response_perplexity

    result = response_perplexity(
        model,
        tokenizer,
        perplexity.rows,
        max_prompt_length=settings.max_prompt_length,
        max_response_length=settings.max_new_tokens,
        batch_size=settings.perplexity_batch_size,
        reporter=reporter,
        description=f"{label} · perplexity {perplexity.spec}",
    )
    if distributed.is_main():
        key = _perplexity_key(perplexity, settings)
        with disk_full_is_reported(paths.perplexity):
            atomic_write_json(paths.perplexity, {**key, **result.to_dict()})
    distributed.barrier()


__all__ = ["evaluate_checkpoints"]
