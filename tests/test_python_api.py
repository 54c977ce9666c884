"""The public Python API's surface (issue 27): ``import mta`` stays light, ``mta.__all__`` (the
public names, listed once) resolves from ``mta.api`` and star-imports, every name and signature
docs/python-api.md states is the code's, and the doc's examples and README's run as written (tiny
random models in place of the Hub names)."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"
README = DOC.parents[1] / "README.md"
HEAVY = ("torch", "transformers", "numpy", "pyarrow", "spacy", "tokenizers", "pydantic", "mta.api")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_import_mta_loads_neither_torch_nor_transformers():
    code = (
        "import sys, mta\n"
        "assert mta.__version__ and set(mta.__all__) <= set(dir(mta))\n"
        "try:\n    mta.no_such_name\nexcept AttributeError:\n    pass\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
        "from mta import errors, versions  # submodules still import through the package\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"import mta loads {done.stdout.strip()}"


def test_every_name_of_all_resolves_from_the_api_module():
    import mta
    import mta.api

    for name in mta.__all__:
        assert getattr(mta, name) is getattr(mta.api, name)


# --- the reference section against the code -------------------------------------------------

ENTRY = re.compile(r"^mta\.(?P<name>[\w.]+)(?P<signature>\(.*\))?(?: -> (?P<returns>.+))?$")


def documented_entries() -> dict[str, tuple[str | None, str | None]]:
    """``{dotted name: (signature text or None, return annotation or None)}`` of every ``mta.``
    line in the ```text blocks of the doc's reference section."""
    reference = DOC.read_text(encoding="utf-8").split("## Reference", 1)[1]
    entries = {}
    for block in re.findall(r"^```text\n(.*?)^```", reference, re.S | re.M):
        for line in block.splitlines():
            match = ENTRY.match(line.strip())
            assert match, f"not a signature line: {line!r}"
            entries[match["name"]] = (match["signature"], match["returns"])
    return entries


def parameters_of(signature: str) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of a documented signature (``inspect.Parameter.empty``: none)."""
    args = ast.parse(f"def f{signature}: pass").body[0].args
    positional = [*args.posonlyargs, *args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(node) for node in args.defaults
    ]
    kind = "POSITIONAL_ONLY"
    found = []
    for index, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "POSITIONAL_ONLY" if index < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        found.append((arg.arg, kind, default))
    if args.vararg:
        found.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        found.append(
            (arg.arg, "KEYWORD_ONLY", inspect.Parameter.empty if default is None else ast.literal_eval(default))
        )
    if args.kwarg:
        found.append((args.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return found


def actual_signature(name: str) -> inspect.Signature:
    import mta

    obj = mta
    for part in name.split("."):
        obj = getattr(obj, part)
    signature = inspect.signature(obj)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":  # a method read from its class
        signature = signature.replace(parameters=parameters[1:])
    return signature


def test_every_name_of_all_is_documented_and_nothing_else_is():
    import mta

    entries = documented_entries()
    top = {name.split(".")[0] for name in entries}
    assert top == set(mta.__all__)
    assert "MtaError" in entries and entries["MtaError"] == (None, None)  # an exception: no signature


@pytest.mark.parametrize("name", sorted(name for name, (signature, _) in documented_entries().items() if signature))
def test_the_documented_signature_is_the_codes(name):
    signature, returns = documented_entries()[name]
    actual = actual_signature(name)
    assert parameters_of(signature) == [
        (parameter.name, parameter.kind.name, parameter.default) for parameter in actual.parameters.values()
    ], f"docs/python-api.md: mta.{name}{signature}; the code: {actual}"
    if returns is not None:
        annotation = actual.return_annotation
        assert isinstance(annotation, str), f"mta.{name} has no return annotation"
        assert ast.unparse(ast.parse(returns)) == ast.unparse(ast.parse(annotation)), (name, returns, annotation)


def test_the_signature_parser_reads_every_kind():
    assert parameters_of("(a, b=1, *, c, d=('x', 'y'), **rest)") == [
        ("a", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("b", "POSITIONAL_OR_KEYWORD", 1),
        ("c", "KEYWORD_ONLY", inspect.Parameter.empty),
        ("d", "KEYWORD_ONLY", ("x", "y")),
        ("rest", "VAR_KEYWORD", inspect.Parameter.empty),
    ]


# --- the examples ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_student_dir(other_tokenizer_dir, tmp_path_factory) -> Path:
    """A random Llama on the 300-token tokenizer: the two-tokenizer example's student."""
    from mta.models.tiny import build_tiny_model

    return build_tiny_model(other_tokenizer_dir, tmp_path_factory.mktemp("other-student"))


def test_the_documented_examples_run_as_written(
    teacher_dir, tiny_model_dir, other_student_dir, capsys, tmp_path, monkeypatch
):
    """Every ```python block of the doc, in order, in one namespace; only the assignments of
    the three model names are replaced (tiny random models: the teacher and the first student
    share the 512-token tokenizer, the other student has its own). In a scratch directory: the
    Trainer block's output_dir is relative."""
    monkeypatch.chdir(tmp_path)
    names = {"TEACHER": teacher_dir, "STUDENT": tiny_model_dir, "OTHER_STUDENT": other_student_dir}
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) >= 6
    namespace: dict = {}
    replaced = 0
    for number, block in enumerate(blocks, 1):
        source, count = re.subn(
            rf"^({'|'.join(names)}) = .*$", lambda m: f"{m[1]} = {str(names[m[1]])!r}", block, flags=re.M
        )
        replaced += count
        exec(compile(source, f"docs/python-api.md, python block {number}", "exec"), namespace)
    assert replaced == len(names)
    # README's "Python API" example, in the same namespace (student, teacher, tokenizer defined), its
    # two Hub names being the doc's TEACHER and STUDENT.
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1].split("\n## ", 1)[0]
    (readme_example,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    for hub_name, local in (
        ("Qwen/Qwen2.5-1.5B-Instruct", teacher_dir),
        ("Qwen/Qwen2.5-0.5B-Instruct", tiny_model_dir),
    ):
        assert f'"{hub_name}"' in readme_example
        readme_example = readme_example.replace(f'"{hub_name}"', repr(str(local)))
    exec(compile(readme_example, "README.md, Python API", "exec"), namespace)
    assert namespace["kd"].needs_teacher and namespace["batch"].spans["phrase"].mask.any()
    printed = capsys.readouterr().out
    assert "look shifted already" in printed and "labels_shifted=True" in printed  # the refusal example
    losses = namespace["losses"]
    assert set(losses) == {"base", "dsa", "hra", "total"} and all(value.isfinite() for value in losses.values())
    assert namespace["sampled"].student.input_ids.shape[0] == 1
    assert namespace["trainer"].state.global_step == 2  # the Trainer block trained through mta's batch
