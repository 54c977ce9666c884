"""bench/mutation_survivors.json, the equivalent and accepted mutants bench/mutation.py reads."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("mutation_driver", REPO / "bench" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_driver_reads_both_tables_from_the_data_file():
    driver = _driver()
    assert driver.SURVIVORS == REPO / "bench" / "mutation_survivors.json"
    assert driver.EQUIVALENT and driver.ACCEPTED
    for table, explanation in (("equivalent", "reason"), ("accepted", "note")):
        entries = driver.load_survivors()[table]
        keys = [(e["file"], e["function"], e["from"], e["to"]) for e in entries]
        assert len(keys) == len(set(keys)), f"{table}: an entry is listed twice"
        for entry in entries:
            assert (REPO / entry["file"]).is_file(), entry
            assert entry[explanation].strip(), entry
    first = driver.EQUIVALENT[0]
    found = driver.lookup(driver.EQUIVALENT, "reason", first["file"], first["function"], first["from"], first["to"])
    assert found == first["reason"]


def test_an_entry_without_its_explanation_is_refused(tmp_path):
    driver = _driver()
    path = tmp_path / "survivors.json"
    path.write_text('{"equivalent": [{"file": "f", "function": "g", "from": "a", "to": "b"}], "accepted": []}')
    with pytest.raises(SystemExit, match=re.escape("equivalent[0] lacks ['reason']")):
        driver.load_survivors(path)


def test_a_module_without_functions_is_left_out_with_its_reason_not_failed_on(tmp_path):
    driver = _driver()
    (tmp_path / "reexports.py").write_text("from os import path\n__all__ = ['path']\nLIMIT = 3\n")
    (tmp_path / "rules.py").write_text("class C:\n    def f(self):\n        return 1\n")
    assert not driver.defines_functions(tmp_path / "reexports.py")
    assert driver.defines_functions(tmp_path / "rules.py")
    left_out = driver.functionless_files(list(driver.GROUPS))
    assert "src/mta/losses/__init__.py" in left_out and "src/mta/losses/dsa.py" not in left_out
    assert set(driver.mutated_files(["losses"], REPO)).isdisjoint(left_out)


def _module(killed: int) -> dict:
    return {"total": 10, "killed": killed, "timeout": 0, "survived": 10 - killed, "equivalent": 0}


def _survivor(file: str, mutant: str) -> dict:
    return {"file": file, "function": "f", "mutant": mutant, "status": "survived", "from": "a", "to": "b"}


def test_an_only_run_replaces_its_files_and_keeps_the_rest_of_the_group():
    driver = _driver()
    fdd, kd, dsa = (f"src/mta/losses/{name}.py" for name in ("fdd", "kd", "dsa"))
    previous = {
        "modules": {fdd: _module(5), kd: _module(7), dsa: _module(9)},
        "survivors": [_survivor(fdd, "old_fdd"), _survivor(kd, "old_kd")],
        "runs": {"losses": {"wall_s": 700}, "store": {"wall_s": 900}},
    }
    found = {"modules": {fdd: _module(9)}, "survivors": [_survivor(fdd, "new_fdd")]}
    run = {"wall_s": 60, "only": [fdd]}

    modules, survivors, runs = driver.merged(previous, found, ["losses"], [fdd], run)
    assert modules == {fdd: _module(9), kd: _module(7), dsa: _module(9)}
    assert sorted(s["mutant"] for s in survivors) == ["new_fdd", "old_kd"]
    assert runs == {"losses": run, "store": {"wall_s": 900}}

    # A whole-group run stands in for every file of the group: one it did not mutate (gone from
    # the tree, say) leaves the report with its survivors.
    modules, survivors, _ = driver.merged(previous, found, ["losses"], None, {"wall_s": 700})
    assert modules == {fdd: _module(9)}
    assert [s["mutant"] for s in survivors] == ["new_fdd"]


def test_only_narrows_a_groups_files_to_the_patterns():
    driver = _driver()
    assert driver.mutated_files(["losses"], REPO, ["src/mta/losses/fdd.py", "src/mta/losses/k*.py"]) == [
        "src/mta/losses/fdd.py",
        "src/mta/losses/kd.py",
    ]
    assert len(driver.mutated_files(["losses"], REPO)) > 2


def test_every_label_matches_a_survivor_of_the_last_results():
    """A label whose mutant is killed now, or whose line was rewritten, is stale: it would quietly
    mark a future mutant of the same text. The committed results and tables agree entry by entry."""
    import json

    driver = _driver()
    results = json.loads((REPO / "bench" / "results" / "mutation.json").read_text(encoding="utf-8"))
    labelled = {
        "equivalent": {(s["file"], s["function"], s["from"], s["to"]) for s in results["survivors"] if "reason" in s},
        "accepted": {(s["file"], s["function"], s["from"], s["to"]) for s in results["survivors"] if "note" in s},
    }
    for table, entries in driver.load_survivors().items():
        stale = [e for e in entries if (e["file"], e["function"], e["from"], e["to"]) not in labelled[table]]
        assert not stale, f"{table}: {len(stale)} entries match no survivor of bench/results/mutation.json: {stale[:3]}"


def test_a_test_process_ended_by_an_unnamed_signal_counts_as_killed():
    from collections import defaultdict

    driver = _driver()
    # mutmut 3's table: known codes by name, any other code "suspicious"
    named = defaultdict(lambda: "suspicious", {0: "survived", 1: "killed", None: "not checked", -9: "segfault"})
    assert driver.mutant_status(-10, named) == "killed"  # SIGUSR1 the mutant left unhandled
    assert driver.mutant_status(-9, named) == "segfault"
    assert driver.mutant_status(0, named) == "survived"
    assert driver.mutant_status(None, named) == "not checked"
    assert driver.mutant_status(35, named) == "suspicious"  # an exit code, not a signal: left as it is
