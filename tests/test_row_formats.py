"""Row formats beyond MiniLLM / Dolly / prompt-response (TRL prompt/completion, conversations)
and the prompt templates (alpaca, chat, none): through `mta annotate`, the recipe check, an
older artefact, evaluation's rows, and `mta distill` on a conversation file."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from conftest import REPO
from fixtures.distill import write_recipe
from mta.data.annotations import read_annotations
from mta.data.prompts import alpaca_prompt, prompt_style, recorded_template
from mta.data.rows import RowProblem, read_rows
from mta.errors import MtaError
from mta.evaluation.datasets import load_rows
from mta.training.config.loading import load_recipe
from mta.training.train_data import check_manifest
from mta_cli.main import app

pytestmark = pytest.mark.usefixtures("one_thread")

runner = CliRunner()
V1 = REPO / "tests" / "data" / "annotate-v1"
LIMITS = ("--max-length", 400, "--max-prompt-length", 300, "--workers", 1)

# ChatML, refusing a conversation that opens with an assistant turn (as real templates refuse
# what they cannot render, through raise_exception).
CHATML = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation must not open with an assistant turn') }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def invoke(*args):
    return runner.invoke(app, [str(arg) for arg in args], env={"COLUMNS": "200"})


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def with_chat_template(source: Path, out: Path, template: str = CHATML) -> Path:
    """A copy of a tokenizer (or model) directory whose tokenizer_config.json has ``template``."""
    shutil.copytree(source, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    return with_chat_template(tiny_tokenizer_dir, tmp_path_factory.mktemp("chat-tok") / "tok")


def texts_by_id(directory: Path) -> dict[int, tuple[str, int]]:
    table = read_annotations(directory).table
    return {r["id"]: (r["text"], r["prompt_chars"]) for r in table.select(["id", "text", "prompt_chars"]).to_pylist()}


CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour of the sky."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And at sunset?"},
    {"role": "assistant", "content": "Orange and red."},
]
NEW_FORMAT_ROWS = [
    {"prompt": "Q: what is two plus two?\nA:", "completion": " Four."},  # TRL standard
    {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]},
    {
        "prompt": [{"role": "user", "content": "Count to three."}],  # TRL conversational
        "completion": [{"role": "assistant", "content": "One, two, three."}],
    },
    {"messages": CONVERSATION},
    {"instruction": "Name a fruit.", "input": "It is yellow.", "output": "A banana."},  # MiniLLM
    {"instruction": "Name a tree.", "context": "It has needles.", "response": "A pine."},  # Dolly
    {"prompt": "Plain prompt:", "response": " plain answer."},
]


def chat_turns(row: dict) -> tuple[list[dict], str]:
    """The turns the chat template renders and the response, derived here from the row."""
    if "messages" in row:
        return row["messages"][:-1], row["messages"][-1]["content"]
    if isinstance(row.get("completion"), list):
        return row["prompt"], row["completion"][0]["content"]
    if "instruction" in row:
        context = row.get("input") or row.get("context")
        user = row["instruction"] + (f"\n\n{context}" if context else "")
        return [{"role": "user", "content": user}], row.get("output", row.get("response"))
    return [{"role": "user", "content": row["prompt"]}], row.get("completion", row.get("response"))


def test_new_formats_under_alpaca_through_mta_annotate(tmp_path, tiny_tokenizer_dir):
    data = write_jsonl(tmp_path / "rows.jsonl", NEW_FORMAT_ROWS)
    out = tmp_path / "out"
    result = invoke(
        "annotate",
        data,
        "--teacher",
        tiny_tokenizer_dir,
        "--student",
        tiny_tokenizer_dir,
        "-o",
        out,
        "--on-error",
        "skip",
        *LIMITS,
    )
    assert result.exit_code == 0, result.output
    expected = {
        0: ("Q: what is two plus two?\nA:", " Four."),
        1: (alpaca_prompt("Say hello."), "Hello!"),  # one user turn: the Alpaca instruction
        2: (alpaca_prompt("Count to three."), "One, two, three."),
        4: (alpaca_prompt("Name a fruit.", "It is yellow."), "A banana."),
        5: (alpaca_prompt("Name a tree.", "It has needles."), "A pine."),
        6: ("Plain prompt:", " plain answer."),
    }
    assert texts_by_id(out) == {i: (p + r, len(p)) for i, (p, r) in expected.items()}
    manifest = read_annotations(out).manifest
    assert manifest["template"] == {"name": "alpaca"}
    # A conversation of several turns has no Alpaca form: skipped, its line named.
    assert manifest["skipped"] == {"no_prompt": 1}
    assert manifest["skipped_examples"] == [
        f"{data}:4: a conversation whose prompt is system + user + assistant + user has no Alpaca "
        "form (only a single user turn has); use template chat (`--template chat`, recipe "
        "`data.template: chat`)"
    ]


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "must end with the assistant turn to learn, but its last turn is a user turn",
        ),
        ({"messages": []}, "must end with the assistant turn to learn, but it is empty"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "is only the assistant turn"),
        (
            {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            "messages[0] has role 'human'; a turn's role is one of system, user, assistant",
        ),
        (
            {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]},
            "messages[0] has role null (missing)",
        ),
        (
            {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},
            "messages[0] (user) must have a string 'content', got an array",
        ),
        ({"messages": [{"role": "user", "content": "hi"}, "hello"]}, "messages[1] must be an object"),
        ({"messages": "hi"}, "field 'messages' must be an array of"),
        (
            {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
            "field 'completion' must hold exactly one assistant turn (the response), got user",
        ),
        ({"prompt": [], "completion": [{"role": "assistant", "content": "a"}]}, "field 'prompt' holds no turn"),
        ({"prompt": "q", "completion": 3}, "field 'completion' must be a string, got a number"),
    ],
)
def test_bad_conversations_are_problems_naming_their_line(tmp_path, row, message):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "fine", "completion": "row"}, row])
    first, second = read_rows(data)
    assert not isinstance(first, RowProblem)
    assert isinstance(second, RowProblem) and second.line == 2, second
    assert message in second.describe(data) and second.describe(data).startswith(f"{data}:2: ")


def test_a_bad_conversation_stops_mta_annotate_naming_the_line(tmp_path, tiny_tokenizer_dir):
    data = write_jsonl(tmp_path / "rows.jsonl", [NEW_FORMAT_ROWS[1], {"messages": [{"role": "user", "content": "hi"}]}])
    result = invoke(
        "annotate", data, "--teacher", tiny_tokenizer_dir, "--student", tiny_tokenizer_dir, "-o", tmp_path / "o"
    )
    assert isinstance(result.exception, MtaError)
    assert f"{data}:2: the conversation in 'messages' must end with the assistant turn" in str(result.exception)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def chat_annotated(tmp_path_factory, chat_tokenizer_dir, other_tokenizer_dir) -> tuple[Path, Path]:
    """NEW_FORMAT_ROWS + an assistant-first conversation, annotated with --template chat: the
    student (the chat tokenizer) renders, the teacher (another vocabulary) encodes the same text."""
    root = tmp_path_factory.mktemp("chat-annotate")
    bad = {
        "messages": [
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Hm?"},
            {"role": "assistant", "content": "Yes."},
        ]
    }
    data = write_jsonl(root / "rows.jsonl", [*NEW_FORMAT_ROWS, bad])
    result = invoke(
        "annotate",
        data,
        "--teacher",
        other_tokenizer_dir,
        "--student",
        chat_tokenizer_dir,
        "-o",
        root / "out",
        "--template",
        "chat",
        "--on-error",
        "skip",
        *LIMITS,
    )
    assert result.exit_code == 0, result.output
    return data, root / "out"


def test_chat_text_is_apply_chat_template_plus_response_on_both_sides(
    chat_annotated, chat_tokenizer_dir, other_tokenizer_dir
):
    data, out = chat_annotated
    chat = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    expected = {}
    for index, row in enumerate(NEW_FORMAT_ROWS):
        turns, response = chat_turns(row)
        prompt = chat.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        expected[index] = (prompt + response, len(prompt))
    assert texts_by_id(out) == expected
    assert expected[3][0].startswith("<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\n")
    # Both sides encode the one text: each id list is its tokenizer's encoding of it (+ EOS).
    teacher = AutoTokenizer.from_pretrained(str(other_tokenizer_dir))
    annotations = read_annotations(out)
    for row in annotations.table.to_pylist():
        for side, tokenizer in (("teacher", teacher), ("student", chat)):
            ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
            assert row[f"{side}_input_ids"] == ids + [tokenizer.eos_token_id]
    manifest = annotations.manifest
    template_hash = hashlib.sha256(json.dumps(CHATML).encode()).hexdigest()
    assert manifest["template"] == {
        "name": "chat",
        "rendered_by": "student",
        "tokenizer": str(chat_tokenizer_dir),
        "chat_template_sha256": f"sha256:{template_hash}",
    }
    # The template's own refusal is the row's problem, its line named.
    assert manifest["skipped"] == {"invalid_conversation": 1}
    assert manifest["skipped_examples"][0].startswith(f"{data}:8: the chat template of ")
    assert manifest["skipped_examples"][0].endswith(
        "refuses this conversation: a conversation must not open with an assistant turn"
    )


def test_a_chat_artefact_is_reused_only_for_the_same_template(
    tmp_path, chat_annotated, chat_tokenizer_dir, other_tokenizer_dir
):
    data, annotated = chat_annotated
    out = shutil.copytree(annotated, tmp_path / "copy")
    before = read_annotations(out).manifest["run_key"]
    result = invoke(
        "annotate",
        data,
        "--teacher",
        other_tokenizer_dir,
        "--student",
        chat_tokenizer_dir,
        "-o",
        out,
        "--template",
        "chat",
        "--on-error",
        "skip",
        *LIMITS,
    )
    assert result.exit_code == 0 and "(same input and settings" in result.output
    result = invoke(
        "annotate",
        data,
        "--teacher",
        other_tokenizer_dir,
        "--student",
        chat_tokenizer_dir,
        "-o",
        out,
        "--on-error",
        "skip",
        *LIMITS,
    )
    assert result.exit_code == 0 and "(same input and settings" not in result.output
    assert read_annotations(out).manifest["template"] == {"name": "alpaca"}
    assert read_annotations(out).manifest["run_key"] != before
    # A chat template changed under the same vocabulary is a different artefact.
    changed = with_chat_template(chat_tokenizer_dir, out.parent / "changed", CHATML.replace("<|im_end|>", "<|end|>"))
    target = out.parent / "changed-out"
    result = invoke(
        "annotate",
        data,
        "--teacher",
        other_tokenizer_dir,
        "--student",
        changed,
        "-o",
        target,
        "--template",
        "chat",
        "--on-error",
        "skip",
        *LIMITS,
    )
    assert result.exit_code == 0, result.output
    assert read_annotations(target).manifest["run_key"] != before
    assert all("<|end|>" in text for text, _ in texts_by_id(target).values())


def test_template_none_uses_the_prompt_as_given_and_needs_one(tmp_path):
    data = write_jsonl(
        tmp_path / "rows.jsonl",
        [
            {"instruction": "ignored", "output": "A.", "prompt": "Given:"},
            {"prompt": "Q:", "completion": " A."},
            {"instruction": "No prompt here.", "output": "B."},
            NEW_FORMAT_ROWS[1],
        ],
    )
    rows = list(read_rows(data, style=prompt_style("none")))
    assert [(r.prompt, r.response) for r in rows[:2]] == [("Given:", "A."), ("Q:", " A.")]
    assert [(r.line, r.reason) for r in rows[2:]] == [(3, "no_prompt"), (4, "no_prompt")]
    assert "template none uses the row's 'prompt' as given, and this row has none" in rows[2].message


def test_a_tokenizer_without_chat_template_is_refused(tmp_path, tiny_tokenizer_dir):
    data = write_jsonl(tmp_path / "rows.jsonl", NEW_FORMAT_ROWS[:2])
    result = invoke(
        "annotate",
        data,
        "--teacher",
        tiny_tokenizer_dir,
        "--student",
        tiny_tokenizer_dir,
        "-o",
        tmp_path / "o",
        "--template",
        "chat",
    )
    assert isinstance(result.exception, MtaError)
    message = str(result.exception)
    assert f"the tokenizer '{tiny_tokenizer_dir}' has no chat template" in message
    assert "--template alpaca" in message and not (tmp_path / "o").exists()


def fitting_recipe(tmp_path: Path, manifest: dict, student: Path, **data) -> object:
    """A recipe whose lengths are the artefact's, so only what the test changes can differ."""
    lengths = {key: manifest[key] for key in ("max_length", "max_prompt_length")}
    return load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            teacher=student,
            student=student,
            annotations="unused",
            output_dir=tmp_path / "run",
            data={**lengths, **data},
        )
    )


def fingerprints(manifest: dict) -> dict[str, str]:
    return {side: manifest[side]["fingerprint"] for side in ("teacher", "student")}


def test_a_recipe_with_another_template_is_refused(tmp_path, chat_annotated, chat_tokenizer_dir):
    _, out = chat_annotated
    annotations = read_annotations(out)
    manifest = annotations.manifest
    student = str(chat_tokenizer_dir)
    check = lambda recipe, tokenizer=student: check_manifest(  # noqa: E731
        annotations, recipe, "data.train", student, tokenizer, fingerprints(manifest)
    )
    check(fitting_recipe(tmp_path, manifest, chat_tokenizer_dir, template="chat"))  # fits: no error
    with pytest.raises(MtaError) as error:
        check(fitting_recipe(tmp_path, manifest, chat_tokenizer_dir))  # data.template defaults to alpaca
    assert "its prompt template is chat but data.template is alpaca" in str(error.value)
    # Same name, but the student's chat template is not the one that rendered the artefact.
    changed = with_chat_template(chat_tokenizer_dir, tmp_path / "changed", CHATML.replace("\\n", " "))
    with pytest.raises(MtaError) as error:
        check(fitting_recipe(tmp_path, manifest, changed, template="chat"), str(changed))
    assert f"rendered with the chat template of '{student}'" in str(error.value)
    assert f"the student tokenizer '{changed}' has another" in str(error.value)
    assert "--template chat" in str(error.value)  # the command that rebuilds it keeps the template


def test_an_older_artefact_without_a_template_reads_as_alpaca(tmp_path, chat_tokenizer_dir):
    annotations = read_annotations(V1)
    manifest = annotations.manifest
    assert "template" not in manifest and recorded_template(manifest) == {"name": "alpaca"}
    check = lambda recipe: check_manifest(  # noqa: E731
        annotations, recipe, "data.train", "teacher", "student", fingerprints(manifest)
    )
    check(fitting_recipe(tmp_path, manifest, chat_tokenizer_dir))
    with pytest.raises(MtaError, match="its prompt template records none, so alpaca but data.template is chat"):
        check(fitting_recipe(tmp_path, manifest, chat_tokenizer_dir, template="chat"))


def test_evaluation_rows_use_the_same_prompt_building(tmp_path, chat_tokenizer_dir):
    data = write_jsonl(
        tmp_path / "set.jsonl",
        [
            {"instruction": "Do it.", "input": "with this", "output": ["b", "c"]},
            {"messages": CONVERSATION},
            {"prompt": "P", "output": "o"},
        ],
    )
    chat = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    rows, _ = load_rows(data, style=prompt_style("chat", chat_tokenizer_dir))
    assert [r.prompt for r in rows] == [
        chat.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        for turns in (
            [{"role": "user", "content": "Do it.\n\nwith this"}],
            CONVERSATION[:-1],
            [{"role": "user", "content": "P"}],
        )
    ]
    assert [r.references for r in rows] == [("b", "c"), ("Orange and red.",), ("o",)]
    with pytest.raises(MtaError, match=r"set\.jsonl:2: a conversation whose prompt is system \+ user"):
        load_rows(data)  # alpaca
    with pytest.raises(MtaError, match=r"set\.jsonl:1: template none uses the row's 'prompt'"):
        load_rows(data, style=prompt_style("none"))


def test_mta_distill_trains_on_conversations_with_the_chat_template(tmp_path, teacher_dir, tiny_model_dir):
    student = with_chat_template(tiny_model_dir, tmp_path / "student")
    examples = [json.loads(line) for line in (REPO / "recipes/examples/tiny.jsonl").read_text().splitlines()[:8]]
    conversations = [
        {"messages": [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": row["output"]}]}
        for row in examples
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", conversations)
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        teacher=teacher_dir,
        student=student,
        annotations=data,
        output_dir=out,
        data={"dev": None, "template": "chat"},
        train={"max_steps": 2},
    )
    result = invoke("distill", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    assert (out / "final" / "model.safetensors").is_file()
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    annotations = read_annotations(out / "data" / "train")
    assert annotations.manifest["template"]["name"] == "chat"
    texts = [text for text, _ in texts_by_id(out / "data" / "train").values()]
    assert len(texts) == 8 and all(t.startswith("<|im_start|>user\n") for t in texts)

    # The same conversations as a `datasets` save_to_disk directory train the same way.
    import datasets

    datasets.Dataset.from_list(conversations).save_to_disk(str(tmp_path / "chat-dataset"))
    out_ds = tmp_path / "run-ds"
    recipe = write_recipe(
        tmp_path / "r-ds.yaml",
        teacher=teacher_dir,
        student=student,
        annotations=tmp_path / "chat-dataset",
        output_dir=out_ds,
        data={"dev": None, "template": "chat"},
        train={"max_steps": 2},
    )
    result = invoke("distill", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    assert (out_ds / "final" / "model.safetensors").is_file()
    assert (
        read_annotations(out_ds / "data" / "train").table.drop_columns([]).column("text").to_pylist()
        == annotations.table.column("text").to_pylist()
    )


def test_mta_evaluate_renders_each_checkpoint_with_its_own_chat_template(tmp_path, tiny_model_dir):
    first = with_chat_template(tiny_model_dir, tmp_path / "a")
    second = with_chat_template(tiny_model_dir, tmp_path / "b", CHATML.replace("<|im_end|>", "<|end|>"))
    rows = [
        {"instruction": "Name a fruit.", "input": "It is yellow.", "output": "A banana."},
        {"messages": CONVERSATION},
    ]
    (tmp_path / "data" / "dolly").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "dolly" / "valid.jsonl", rows)
    options = (
        "--data-dir",
        tmp_path / "data",
        "--benchmarks",
        "dolly",
        "--seeds",
        "1",
        "--max-new-tokens",
        3,
        "--template",
        "chat",
    )
    result = invoke("evaluate", first, second, "--names", "a,b", "-o", tmp_path / "eval", *options)
    assert result.exit_code == 0, result.output
    for label, model in (("a", first), ("b", second)):
        chat = AutoTokenizer.from_pretrained(str(model))
        predictions = tmp_path / "eval" / "predictions" / label / "dolly" / "seed-1.jsonl"
        assert [json.loads(line)["prompt"] for line in predictions.read_text().splitlines()] == [
            chat.apply_chat_template(chat_turns(row)[0], tokenize=False, add_generation_prompt=True) for row in rows
        ]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["settings"]["template"] == "chat"
    # A checkpoint without a chat template is refused before anything is generated.
    result = invoke("evaluate", first, tiny_model_dir, "--names", "a,plain", "-o", tmp_path / "eval2", *options)
    assert isinstance(result.exception, MtaError)
    assert f"the tokenizer '{tiny_model_dir}' has no chat template" in str(result.exception)
    assert not (tmp_path / "eval2" / "predictions" / "a" / "dolly").exists()
