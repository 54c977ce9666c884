"""`loss.reference_code` and `data.span_rule: reference` against literal transcriptions of the
authors' code (docs/method.md §8).

The transcriptions below follow the public `wind123mountain/MTA` code line by line, as loops
over sequences, tokens, spans and pairs that share nothing with ``mta``:
`distillm-master/span_utils.py` (`compute_token_weights` L7-23,
`prepare_span_indices_and_weights` L25-111, `get_span_loss` L113-144,
`compute_overall_span_loss` L172-200, `compute_hidden_span_loss` L202-274,
`filter_overlapping_spans` L277-304, `get_spans_offsets` L306-327) and, for the uniform-weights
ablation, `distillm-master/ablation_span_finetune.py` (`compute_hidden_span_loss` L373-448).
Each difference from the formulas is isolated in a batch where only it is at work, where the
formulas' code must then disagree with the transcription and ``reference_code`` agree.
"""

from __future__ import annotations

import copy
import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from mta.data.annotate import AnnotateSettings, annotate_run_key, run_annotate
from mta.data.annotations import read_annotations
from mta.data.encoding import TokenizerSide
from mta.data.span_extraction import VERB_PHRASE_PATTERN, SpanExtractor, load_spacy
from mta.data.token_ranges import token_ranges
from mta.errors import MtaError
from mta.losses import SpanBatch, TrajectoryAlignmentLoss, token_importance
from mta.task_registry import task_named
from mta.training.batching import AnnotatedExamples, StepSchedule
from mta.training.config.schema import Recipe
from mta.training.train_data import check_manifest

REPO = Path(__file__).resolve().parents[1]
V1 = REPO / "tests" / "data" / "annotate-v1"
INF = float("inf")


# ------------------------------------------------------------ transcriptions of the authors' code


def authors_token_weights(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`compute_token_weights` (span_utils.py L7-23), one query row at a time, in float64."""
    batch, length, dim = hidden.shape
    out = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        h = hidden[b].detach().double()
        q = h / (h.std(dim=-1, keepdim=True) + 1e-5)  # L8-10: Q = K = H / (std + 1e-5), unbiased
        for s in range(length):  # L22 `.mean(dim=1)`: every row of the padded batch, padding rows too
            allowed = attention_mask[b].bool() & (torch.arange(length) != s)  # L13-16: padding keys, diagonal
            scores = torch.where(allowed, q @ q[s] / math.sqrt(dim), -INF)  # L11
            exps = torch.where(allowed, torch.exp(scores - scores.max()), 0.0)  # L18 softmax
            out[b] += exps / exps.sum() / length  # L19-20 mask and renormalise: a no-op here
    return out


def authors_memberships(attention_mask, offsets, spans) -> list[tuple[int, int, int]]:
    """(b, t, k) for each token t of sequence b in span k (`prepare_span_indices_and_weights`
    L53-77): `offsets_start + 1 >= a and offsets_end <= b` on real tokens, in `nonzero` order."""
    found = []
    for b in range(attention_mask.shape[0]):
        for t in range(attention_mask.shape[1]):
            for k, (a, e) in enumerate(spans[b]):
                if offsets[b][t][0] + 1 >= a and offsets[b][t][1] <= e and attention_mask[b, t]:
                    found.append((b, t, k))
    return found


def authors_pair_loss(projector, s_hidden, t_hidden, s_weights, t_weights, members, *, uniform=False):
    """`compute_hidden_span_loss` for one layer pair (span_utils.py L202-274; with ``uniform`` the
    ablation_span_finetune.py version, L373-448). Returns (DSA, HRA); theirs returns DSA + HRA / 10."""

    def normalised(weights):  # L88-100 gather_layer_weights: over the sequence's memberships
        sums = defaultdict(float)
        for b, t, _ in members:
            sums[b] += float(weights[b, t])
        return [float(weights[b, t]) / max(sums[b], 1e-5) for b, t, _ in members]

    tw, sw = normalised(t_weights), normalised(s_weights)
    spans = sorted({(b, k) for b, _, k in members})  # L81-86: torch.unique over b * max_spans + k
    t_sum, s_sum = {}, {}
    t_mass, s_mass = defaultdict(float), defaultdict(float)
    for m, (b, t, k) in enumerate(members):  # L217-239: importance-weighted sums per span
        t_sum[b, k] = t_sum.get((b, k), 0) + tw[m] * t_hidden[b, t].double()
        s_sum[b, k] = s_sum.get((b, k), 0) + sw[m] * s_hidden[b, t].double()
        t_mass[b, k] += tw[m]
        s_mass[b, k] += sw[m]
    t_unit = {span: F.normalize(t_sum[span] / max(t_mass[span], 1e-5), dim=-1) for span in spans}  # L244-248
    s_unit = {span: F.normalize(s_sum[span] / max(s_mass[span], 1e-5), dim=-1) for span in spans}
    dsa_num, dsa_den = 0.0, 0.0
    for i in spans:  # L252-266: the pairs of one sequence, the whole batch in one mean
        for j in spans:
            if i == j or i[0] != j[0]:
                continue
            weight = t_mass[i] * t_mass[j]
            if uniform:  # ablation L436-437
                weight = float(weight > 0)
            gap = (s_unit[i] @ s_unit[j]) - (t_unit[i] @ t_unit[j])
            dsa_num = dsa_num + weight * gap**2
            dsa_den += weight
    hra_num, hra_den = 0.0, 0.0
    for m, (b, t, _) in enumerate(members):  # L268-272: every membership, a token once per span
        distance = 1 - F.cosine_similarity(
            projector(s_hidden[b, t].double()), t_hidden[b, t].double(), dim=-1, eps=1e-5
        )
        weight = float(tw[m] > 0) if uniform else tw[m]  # ablation L445-446
        hra_num = hra_num + weight * distance
        hra_den += weight
    return dsa_num / max(dsa_den, 1e-5), hra_num / max(hra_den, 1e-5)


def authors_overall(projectors, attention_mask, s_states, t_states, offsets, spans, pairs, *, uniform=False):
    """`compute_overall_span_loss` (L172-200) through `get_span_loss` (L113-144): each pair with
    its granularity's spans; returns the per-pair (DSA, HRA) in pair order."""
    out = []
    for (s_layer, t_layer, granularity), projector in zip(pairs, projectors, strict=True):
        members = authors_memberships(attention_mask, offsets, spans[granularity])
        s_w = authors_token_weights(s_states[s_layer], attention_mask)
        t_w = authors_token_weights(t_states[t_layer], attention_mask)
        out.append(
            authors_pair_loss(projector, s_states[s_layer], t_states[t_layer], s_w, t_w, members, uniform=uniform)
        )
    return out


def authors_filter(spans):
    """`filter_overlapping_spans` (L277-304)."""
    sorted_spans = sorted(spans, key=lambda s: (s[0], -s[1]))
    filtered, words = [], []
    if not sorted_spans:
        return filtered, words  # theirs returns `filtered` alone here (and its caller fails)
    current_span = sorted_spans[0]
    for next_span in sorted_spans[1:]:
        _, current_end, p = current_span
        _, next_end, _ = next_span
        if next_end <= current_end:
            continue
        filtered.append((current_span[0], current_span[1]))
        n_token = len(p)
        words.extend([(p[idx - 1].idx, p[idx].idx) for idx in range(1, n_token)])
        words.append((p[n_token - 1].idx, p[n_token - 1].idx + len(p[n_token - 1])))
        current_span = next_span
    filtered.append((current_span[0], current_span[1]))
    p = current_span[2]
    n_token = len(p)
    words.extend([(p[idx - 1].idx, p[idx].idx) for idx in range(1, n_token)])
    words.append((p[n_token - 1].idx, p[n_token - 1].idx + len(p[n_token - 1])))
    return filtered, words


def authors_spans_offsets(texts, nlp, matcher):
    """`get_spans_offsets` (L306-327): verb phrases first, then noun chunks, then the filter."""
    spans, words = [], []
    for doc in nlp.pipe(texts):
        found = [(doc[s:e].start_char, doc[s:e].end_char, doc[s:e]) for _, s, e in matcher(doc)]
        found.extend([(nc.start_char, nc.end_char, nc) for nc in doc.noun_chunks])
        phrases, doc_words = authors_filter(found)
        spans.append(phrases)
        words.append(doc_words)
    return spans, words


# ------------------------------------------------------------ the loss side


def span_batch(ranges: list[list[tuple[int, int]]]) -> SpanBatch:
    """The same token ranges on both sides (one tokenizer)."""
    width = max(1, max(len(r) for r in ranges))
    start = torch.zeros(len(ranges), width, dtype=torch.long)
    end = torch.zeros_like(start)
    mask = torch.zeros(len(ranges), width, dtype=torch.bool)
    for b, row in enumerate(ranges):
        for k, (s, e) in enumerate(row):
            start[b, k], end[b, k], mask[b, k] = s, e, True
    return SpanBatch(start, end, start.clone(), end.clone(), mask)


CASES = {
    # one unpadded sequence, disjoint spans: the formulas and the code agree (docs/method.md §8)
    "agree": dict(lengths=[12], phrase=[[(0, 3), (3, 7), (8, 12)]], word=[[(0, 1), (4, 5), (9, 10)]]),
    # difference 1 alone: padding rows ask in the importance
    "padding rows": dict(lengths=[7], phrase=[[(0, 2), (2, 5), (5, 7)]], word=[[(0, 1), (3, 4), (6, 7)]]),
    # difference 2 alone: DSA over all pairs of the batch (no padding, disjoint spans)
    "batch pairs": dict(
        lengths=[12, 12, 12],
        phrase=[[(0, 2), (2, 5), (5, 12)], [(1, 3), (4, 6)], [(0, 4), (4, 5), (6, 9), (9, 12)]],
        word=[[(0, 1), (3, 4)], [(1, 2), (5, 6), (7, 8)], [(2, 3), (10, 11)]],
    ),
    # difference 3 alone: a token once per span (one unpadded sequence, overlapping spans)
    "overlaps": dict(lengths=[12], phrase=[[(0, 4), (2, 6), (2, 6), (5, 12)]], word=[[(0, 1), (0, 1), (4, 5)]]),
    # everything at once: padding, several sequences, overlaps, a duplicate, a one-span sequence
    "all": dict(
        lengths=[12, 9, 6],
        phrase=[[(0, 3), (2, 6), (2, 6), (7, 12), (9, 10)], [(1, 4), (3, 8)], [(0, 6)]],
        word=[[(0, 1), (1, 2), (4, 5), (4, 5)], [(2, 3), (5, 6), (8, 9)], [(1, 2), (3, 5)]],
    ),
}
PAIRS = [
    SimpleNamespace(student=1, teacher=2, granularity="word"),
    SimpleNamespace(student=2, teacher=4, granularity="phrase"),
]


def run_both(case: str, *, importance="attention", reference_code=True, seed=0):
    """Our loss and the transcription on one batch: ``(ours, theirs_per_pair, grads_ours, grads_theirs)``."""
    spec = CASES[case]
    lengths, seq = spec["lengths"], 12
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    # Padding positions hold states too (the model computes them): theirs reads them.
    student = [torch.randn(len(lengths), seq, 8, generator=generator, requires_grad=True) for _ in range(3)]
    teacher = [torch.randn(len(lengths), seq, 12, generator=generator) for _ in range(5)]
    loss = TrajectoryAlignmentLoss(
        PAIRS, 8, 12, same_tokenizer=True, importance=importance, reference_code=reference_code
    )
    spans = {g: span_batch(spec[g]) for g in ("word", "phrase")}
    ours = loss(student, teacher, mask, mask, spans)
    (2.0 * ours["dsa"] + 0.2 * ours["hra"]).backward()
    grads_ours = [
        student[1].grad.clone(),
        student[2].grad.clone(),
        *(p.grad.clone() for p in loss.projectors.parameters()),
    ]

    # Theirs: token t of a row shows characters [2t, 2t + 2) ("Ġx"), a token range [s, e) is the
    # character span [2s + 1, 2e), so their membership rule picks exactly tokens s..e-1.
    offsets = [[(2 * t, 2 * t + 2) for t in range(seq)] for _ in lengths]
    chars = {g: [[(2 * s + 1, 2 * e) for s, e in row] for row in spec[g]] for g in ("word", "phrase")}
    s_states = [h.detach().double().requires_grad_() for h in student]
    projectors = [copy.deepcopy(p).double() for p in loss.projectors]
    pairs = [(p.student, p.teacher, p.granularity) for p in PAIRS]
    theirs = authors_overall(
        projectors, mask, s_states, teacher, offsets, chars, pairs, uniform=importance == "uniform"
    )
    overall = sum(dsa + hra / 10 for dsa, hra in theirs) / len(theirs)  # L199
    (2.0 * overall).backward()  # --w-span-loss 2.0
    grads_theirs = [
        s_states[1].grad,
        s_states[2].grad,
        *(p.grad for p in (projectors[0].weight, projectors[0].bias, projectors[1].weight, projectors[1].bias)),
    ]
    return ours, theirs, grads_ours, grads_theirs


def means(theirs) -> dict[str, float]:
    return {
        term: sum(float(torch.as_tensor(pair[i]).detach()) for pair in theirs) / len(theirs)
        for i, term in enumerate(("dsa", "hra"))
    }


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_code_is_the_authors_loss_values_and_gradients(case):
    ours, theirs, grads_ours, grads_theirs = run_both(case)
    expected = means(theirs)
    for term in ("dsa", "hra"):
        assert close(ours[term].item(), expected[term]), (term, ours[term].item(), expected[term])
    for got, want in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "case, differs",
    [
        ("agree", set()),
        ("padding rows", {"dsa", "hra"}),
        ("batch pairs", {"dsa"}),
        ("overlaps", {"hra"}),
    ],
)
def test_the_formulas_differ_from_the_authors_exactly_where_documented(case, differs):
    formulas, theirs, _, _ = run_both(case, reference_code=False)
    expected = means(theirs)
    for term in ("dsa", "hra"):
        same = close(formulas[term].item(), expected[term])
        assert same == (term not in differs), (case, term, formulas[term].item(), expected[term])


def test_uniform_weights_with_reference_code_is_the_authors_ablation():
    ours, theirs, grads_ours, grads_theirs = run_both("all", importance="uniform")
    expected = means(theirs)
    for term in ("dsa", "hra"):
        assert close(ours[term].item(), expected[term]), (term, ours[term].item(), expected[term])
    for got, want in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)
    # Our own uniform ablation (uniform importance everywhere) is another loss.
    formulas, _, _, _ = run_both("all", importance="uniform", reference_code=False)
    assert not close(formulas["dsa"].item(), expected["dsa"])


def test_importance_over_padding_rows_is_the_authors_token_weights():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 10, 16, generator=generator)
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4, [1] * 2 + [0] * 8])
    got = token_importance(hidden, mask, padding_queries=True)
    want = authors_token_weights(hidden, mask)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    assert (got[mask == 0] == 0).all()
    # The formulas' weights agree on the unpadded row only.
    formulas = token_importance(hidden, mask)
    torch.testing.assert_close(formulas[0], got[0], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(formulas[1], got[1], atol=1e-4)
    # A padding state that is not finite is read as zeros, never as a NaN weight.
    hidden[1, 8] = float("nan")
    assert torch.isfinite(token_importance(hidden, mask, padding_queries=True)).all()


def test_default_objective_stays_the_formulas():
    """reference_code off is the code the formula tests pin (tests/test_losses_trajectory.py):
    bit for bit the same numbers as a loss built without the argument."""
    spans = {g: span_batch(CASES["all"][g]) for g in ("word", "phrase")}
    generator = torch.Generator().manual_seed(3)
    student = [torch.randn(3, 12, 8, generator=generator) for _ in range(3)]
    teacher = [torch.randn(3, 12, 12, generator=generator) for _ in range(5)]
    mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3, [1] * 6 + [0] * 6])
    torch.manual_seed(0)
    plain = TrajectoryAlignmentLoss(PAIRS, 8, 12, same_tokenizer=True)
    torch.manual_seed(0)
    off = TrajectoryAlignmentLoss(PAIRS, 8, 12, same_tokenizer=True, reference_code=False)
    a, b = plain(student, teacher, mask, mask, spans), off(student, teacher, mask, mask, spans)
    assert all(torch.equal(a[t], b[t]) for t in a)


# ------------------------------------------------------------ the span side


TEXTS = [
    'Below is an instruction that describes a task.\n\n### Instruction:\nName the "largest" planet (in mass).\n\n'
    "### Response:\nJupiter is the largest planet, and it has been studied closely by many probes.",
    "The quick brown fox has been quickly running away from the farmer's angry dogs.",
    "She quickly ran and jumped over the old fence, then happily went home.\n\nThe end.",
    "The students who were studying very hard passed.",  # two phrases share "very ": a word twice
]


@pytest.fixture(scope="module")
def nlp():
    return load_spacy("en_core_web_sm").nlp


def test_reference_membership_is_the_authors_rule(tiny_tokenizer_dir):
    side = TokenizerSide.load(tiny_tokenizer_dir)
    rng = np.random.default_rng(0)
    took_the_token_before = 0
    for text in TEXTS:
        offsets = side.encode(text).offsets
        spans = np.sort(rng.integers(0, len(text) + 1, size=(300, 2)), axis=1)
        spans = spans[spans[:, 0] < spans[:, 1]]
        start, end, found = token_ranges(text, offsets, spans, rule="reference")
        paper_start, _, paper_found = token_ranges(text, offsets, spans)
        for k, (a, b) in enumerate(spans.tolist()):
            members = [t for t, (s, e) in enumerate(offsets.tolist()) if s + 1 >= a and e <= b]  # L61-62
            assert bool(found[k]) == bool(members)
            if members:
                assert list(range(start[k], end[k])) == members
            if found[k] and paper_found[k] and start[k] < paper_start[k]:
                took_the_token_before += 1
    assert took_the_token_before  # the rules differ on real text, as documented
    # The newline before "Jupiter" belongs to the word under the authors' rule, not under §1.
    text = TEXTS[0]
    a = text.index("Jupiter")
    offsets = side.encode(text).offsets
    start, end, _ = token_ranges(text, offsets, np.array([[a, a + len("Jupiter")]]), rule="reference")
    paper, _, _ = token_ranges(text, offsets, np.array([[a, a + len("Jupiter")]]))
    assert text[offsets[start[0], 0] : offsets[start[0], 1]].endswith("\n") and paper[0] > start[0]


def test_reference_words_are_the_authors_words(nlp):
    from spacy.matcher import Matcher

    matcher = Matcher(nlp.vocab)
    matcher.add("VERB_PHRASE", [VERB_PHRASE_PATTERN])
    phrases, words = authors_spans_offsets(TEXTS, nlp, matcher)
    extractor = SpanExtractor(nlp, "phrase", "reference")
    paper = SpanExtractor(nlp, "phrase")
    repeated = 0
    for doc_spans, doc_phrases, doc_words, formulas in zip(
        extractor.pipe(TEXTS), phrases, words, paper.pipe(TEXTS), strict=True
    ):
        assert [tuple(p) for p in doc_spans.phrases.tolist()] == doc_phrases
        assert [tuple(w) for w in doc_spans.words.tolist()] == doc_words  # order and repeats too
        assert doc_spans.phrases.tolist() == formulas.phrases.tolist()  # phrases are the same
        assert doc_spans.words.tolist() != formulas.words.tolist()
        repeated += len(doc_words) - len(set(doc_words))
    assert repeated  # overlapping phrases list a word twice


def test_span_rule_reference_needs_the_words_of_phrases(tmp_path):
    with pytest.raises(MtaError, match="word_spans 'phrase'"):
        AnnotateSettings(teacher="t", student="s", span_rule="reference", word_spans="all")
    with pytest.raises(MtaError, match="span_rule must be"):
        AnnotateSettings(teacher="t", student="s", span_rule="authors")
    with pytest.raises(ValueError, match="word_spans=phrase"):
        recipe(tmp_path, span_rule="reference", word_spans="all")


def recipe(tmp_path: Path, **data) -> Recipe:
    """A recipe for the committed version-1 artefact (its tokenizers and lengths)."""
    return Recipe.model_validate(
        {
            "name": "t",
            "output_dir": str(tmp_path / "run"),
            "teacher": {"path": "teacher-tok512"},
            "student": {"path": "student-tok300"},
            "data": {"train": str(V1), "max_length": 180, "max_prompt_length": 160, **data},
            "loss": {"base": "ce"},
            "train": {"max_steps": 1},
        }
    )


def test_an_artefact_without_a_rule_is_the_papers_and_a_mismatch_is_refused(tmp_path):
    annotations = read_annotations(V1)
    assert "span_rule" not in annotations.manifest
    fingerprints = {side: annotations.manifest[side]["fingerprint"] for side in ("teacher", "student")}
    args = ("data.train", "teacher-tok512", "student-tok300", fingerprints)
    check_manifest(annotations, recipe(tmp_path), *args)  # paper: fits
    with pytest.raises(MtaError, match="its span rule is paper but data.span_rule is reference"):
        check_manifest(annotations, recipe(tmp_path, span_rule="reference"), *args)


def test_a_papers_artefact_keeps_its_run_key():
    description = {
        "input": {"sha256": "x", "rows": 1},
        "teacher": {"fingerprint": "a"},
        "student": {"fingerprint": "b"},
        "template": {"name": "alpaca"},
    }
    old = annotate_run_key(description)
    assert annotate_run_key({**description, "span_rule": "paper"}) == old
    assert annotate_run_key({**description, "span_rule": "reference"}) != old


ROWS = [
    {
        "instruction": 'Name the "largest" planet (in mass).',
        "output": "Jupiter is the largest planet, and it has been studied closely by many probes.",
    },
    {
        "instruction": "Describe the fox.",
        "output": "The quick brown fox has been quickly running away from the farmer's angry dogs.",
    },
    {
        "instruction": "What did she do?",
        "output": "She quickly ran and jumped over the old fence.\n\nThen she happily went home.",
    },
    {"instruction": "How did they do?", "output": "The students who were studying very hard passed."},
]
MAX_LENGTH = 160


@pytest.fixture(scope="module")
def reference_artefact(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from mta_cli.main import app

    data = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    out = data.parent / "ann"
    result = CliRunner().invoke(
        app,
        [
            "annotate",
            str(data),
            "--teacher",
            str(tiny_tokenizer_dir),
            "--student",
            str(tiny_tokenizer_dir),
            "-o",
            str(out),
            "--max-length",
            str(MAX_LENGTH),
            "--max-prompt-length",
            "120",
            "--workers",
            "1",
            "--span-rule",
            "reference",
        ],
    )
    assert result.exit_code == 0, result.output
    return out


def test_the_manifest_records_the_rule_and_another_rule_is_never_reused(reference_artefact, tmp_path):
    manifest = read_annotations(reference_artefact).manifest
    assert manifest["span_rule"] == "reference"
    assert manifest["rows"]["written"] == len(ROWS) and manifest["rows"]["response_cut"] == 0
    copy_dir = tmp_path / "ann"
    import shutil

    shutil.copytree(reference_artefact, copy_dir)
    settings = AnnotateSettings(
        teacher=manifest["teacher"]["name"],
        student=manifest["student"]["name"],
        workers=1,
        max_length=MAX_LENGTH,
        max_prompt_length=120,
        span_rule="reference",
    )
    source = Path(manifest["input"]["path"])
    assert run_annotate(source, copy_dir, settings).reused
    paper = run_annotate(source, copy_dir, AnnotateSettings(**{**settings.__dict__, "span_rule": "paper"}))
    assert not paper.reused and paper.manifest["span_rule"] == "paper"
    # Training a reference recipe on it is refused, naming the command that builds a fitting one.
    annotations = read_annotations(copy_dir)
    fingerprints = {side: manifest[side]["fingerprint"] for side in ("teacher", "student")}
    spec = Recipe.model_validate(
        {
            "name": "t",
            "output_dir": str(tmp_path / "run"),
            "teacher": {"path": manifest["teacher"]["name"]},
            "student": {"path": manifest["student"]["name"]},
            "data": {
                "train": str(copy_dir),
                "max_length": MAX_LENGTH,
                "max_prompt_length": 120,
                "span_rule": "reference",
            },
            "loss": {"base": "ce"},
            "train": {"max_steps": 1},
        }
    )
    with pytest.raises(MtaError, match="span rule is paper but data.span_rule is reference") as error:
        check_manifest(
            annotations, spec, "data.train", manifest["teacher"]["name"], manifest["student"]["name"], fingerprints
        )
    assert "--span-rule reference" in str(error.value)


def test_annotated_reference_spans_feed_the_authors_loss(reference_artefact, nlp, tiny_tokenizer_dir):
    """The whole path: `mta annotate --span-rule reference`, a batch padded to max_length and
    `reference_code` give the loss the authors' pipeline computes from the same text (spaCy on
    the clean text, their offsets, membership, weights and losses)."""
    from spacy.matcher import Matcher

    annotations = read_annotations(reference_artefact)
    examples = AnnotatedExamples(annotations.table, student_pad_id=0, teacher_pad_id=0)
    batch = examples.batch(np.arange(len(examples))).padded_to(MAX_LENGTH, examples.pad_ids)
    mask = batch.student.attention_mask
    assert mask.shape[1] == MAX_LENGTH
    texts = annotations.table.column("text").to_pylist()

    matcher = Matcher(nlp.vocab)
    matcher.add("VERB_PHRASE", [VERB_PHRASE_PATTERN])
    phrases, words = authors_spans_offsets(texts, nlp, matcher)
    side = TokenizerSide.load(tiny_tokenizer_dir)
    offsets = []
    for text in texts:  # EOS and padding: past the text, in no span (as in theirs)
        own = side.encode(text).offsets.tolist()
        offsets.append(own + [(10**6, 10**6)] * (MAX_LENGTH - len(own)))

    generator = torch.Generator().manual_seed(5)
    student = [torch.randn(len(texts), MAX_LENGTH, 8, generator=generator, requires_grad=True) for _ in range(3)]
    teacher = [torch.randn(len(texts), MAX_LENGTH, 12, generator=generator) for _ in range(5)]
    loss = TrajectoryAlignmentLoss(PAIRS, 8, 12, same_tokenizer=True, reference_code=True)
    ours = loss(student, teacher, mask, batch.teacher.attention_mask, batch.spans)
    projectors = [copy.deepcopy(p).double() for p in loss.projectors]
    pairs = [(p.student, p.teacher, p.granularity) for p in PAIRS]
    theirs = means(
        authors_overall(
            projectors, mask, [h.detach() for h in student], teacher, offsets, {"word": words, "phrase": phrases}, pairs
        )
    )
    for term in ("dsa", "hra"):
        assert close(ours[term].item(), theirs[term]), (term, ours[term].item(), theirs[term])


def test_reference_code_pads_every_micro_batch_to_max_length(reference_artefact, tmp_path):
    from mta.training.trainer import Trainer

    annotations = read_annotations(reference_artefact)
    examples = AnnotatedExamples(annotations.table, student_pad_id=7, teacher_pad_id=7)
    for reference, width in ((True, MAX_LENGTH), (False, None)):
        recipe = Recipe.model_validate(
            {
                "name": "t",
                "output_dir": str(tmp_path),
                "teacher": {"path": "t"},
                "student": {"path": "s"},
                "data": {
                    "train": str(reference_artefact),
                    "max_length": MAX_LENGTH,
                    "max_prompt_length": 120,
                    "span_rule": "reference",
                },
                "loss": {"reference_code": reference},
                "train": {"max_steps": 1, "batch_size": 2, "micro_batch_size": 2, "loss_reduction": "micro_batch"},
            }
        )
        run = SimpleNamespace(
            schedule=StepSchedule(len(examples), 2, 1, 1),
            train=examples,
            off_policy=None,
            rank=0,
            recipe=recipe,
            task=task_named("llm"),
        )
        for batch in Trainer.micro_batches(SimpleNamespace(run=run, _orders={}), 0):  # the trainer's own loop
            real = batch.student.attention_mask.sum(dim=1)
            expected = width or int(real.max())
            assert batch.student.input_ids.shape[1] == batch.teacher.input_ids.shape[1] == expected
            padding = batch.student.attention_mask == 0
            assert (batch.student.input_ids[padding] == 7).all() and (batch.student.labels[padding] == -100).all()
