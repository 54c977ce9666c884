"""Every documented rule names a fast test (issue #26): the registry below maps each rule to the
test that checks it, and fails when a named test is missing or marked ``slow``, when a README
sentence saying "refused" is not listed, or when a rule table (schedules, modes, ``select_by``
goals, pair roles) gains an entry the registry does not name.

The resume keys, each schedule and each goal are also checked entry by entry against the live
tables in their own files (``tests/test_rules_resume.py`` and the others)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import get_args

import pytest

from mta.data.artefact_schema import ROLES
from mta.training.config.schema import OffPolicyMode, OffPolicySchedule, TrainSpec

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"

# rule -> the fast tests that check it ("file.py::test_name").
RULES: dict[str, tuple[str, ...]] = {
    # resume rules (src/mta/training/config/resume_rules.py)
    "resume: every key of an LLM recipe may change or is refused as restated": (
        "test_rules_resume.py::test_each_llm_recipe_key_changes_or_is_refused_as_restated",
    ),
    "resume: every key of an embedding recipe may change or is refused as restated": (
        "test_rules_resume.py::test_each_embedding_recipe_key_changes_or_is_refused_as_restated",
    ),
    "resume: an optional section switched on or off is refused": (
        "test_rules_resume.py::test_switching_an_optional_section_on_or_off_is_refused",
    ),
    "resume: the keys that may change are exactly MUTABLE_KEYS": (
        "test_rules_resume.py::test_the_keys_that_may_change_are_exactly_mutable_keys",
        "test_rules_resume.py::test_the_llm_table_names_every_key_of_the_recipe_schema",
        "test_rules_resume.py::test_the_embedding_tables_name_every_key_of_the_embedding_schema",
        "test_rules_resume.py::test_the_section_table_names_every_optional_section",
    ),
    "resume: a key an older checkpoint lacks counts as its default": (
        "test_rules_resume.py::test_a_key_an_older_checkpoint_lacks_counts_as_its_default",
    ),
    "resume: one refusal names every refused key, old and new value, and how to put it back": (
        "test_resume_rules.py::test_one_message_names_every_refused_key_and_how_to_put_it_back",
    ),
    "resume: new base rates under the schedule re-planned for the new total": (
        "test_rules_resume.py::test_a_resume_takes_the_new_base_rates_under_the_schedule_planned_for_the_new_total",
    ),
    # off-policy sampling (src/mta/training/off_policy/policy.py)
    "schedule: decreasing": ("test_rules_off_policy.py::test_each_schedule_value_is_the_restated_one",),
    "schedule: constant": ("test_rules_off_policy.py::test_each_schedule_value_is_the_restated_one",),
    "schedule: increasing": ("test_rules_off_policy.py::test_each_schedule_value_is_the_restated_one",),
    "mode: off": ("test_rules_off_policy.py::test_each_mode_and_schedule_decides_as_restated",),
    "mode: always": ("test_rules_off_policy.py::test_each_mode_and_schedule_decides_as_restated",),
    "mode: adaptive": ("test_rules_off_policy.py::test_each_mode_and_schedule_decides_as_restated",),
    "sampling: generate / buffer / gold from r, s and tau": (
        "test_rules_off_policy.py::test_choose_is_the_restated_rule_on_a_grid_with_its_boundaries",
    ),
    "sampling: the threshold update": (
        "test_rules_off_policy.py::test_the_threshold_update_is_the_restated_one_over_random_dev_losses",
        "test_rules_off_policy.py::test_ten_steps_of_a_tenth_reach_exactly_one_and_the_threshold_moves_only_in_adaptive",
    ),
    "sampling: the draw is keyed, the same on every rank and resume": (
        "test_rules_off_policy.py::test_the_draw_is_uniform_on_the_unit_interval_and_the_same_for_the_same_key",
        "test_off_policy.py::test_the_draw_is_keyed_pinned_and_independent_of_the_global_streams",
    ),
    "sampling: tau, L0 and the buffer are saved and read back exactly": (
        "test_off_policy.py::test_the_state_round_trips_through_json_exactly",
        "test_off_policy.py::test_the_buffer_round_trips_through_parquet_row_for_row",
    ),
    # checkpoint selection (src/mta/training/lifecycle/selection.py)
    "select_by: loss": (
        "test_rules_selection.py::test_the_best_step_is_the_restated_one_with_ties_to_the_earlier_step",
        "test_rules_selection.py::test_best_is_written_at_each_strict_improvement_after_step_0_with_its_selection",
    ),
    "select_by: rouge": (
        "test_rules_selection.py::test_the_best_step_is_the_restated_one_with_ties_to_the_earlier_step",
        "test_rules_selection.py::test_best_is_written_at_each_strict_improvement_after_step_0_with_its_selection",
        "test_rules_selection.py::test_rouge_samples_the_first_rows_but_never_the_rejected_half_of_a_pair",
    ),
    "selection: metric, key and goal of each select_by": (
        "test_rules_selection.py::test_the_criterion_names_the_restated_metric_key_and_goal",
    ),
    "selection: a resume keeps best/ only when it is the best up to the resumed step": (
        "test_selection.py::test_best_is_kept_only_when_it_is_the_best_up_to_the_resumed_step",
    ),
    # DistiLLM-2 pairs (src/mta/data/rows.py, src/mta/training/batching.py)
    "role: chosen": ("test_rules_pairs.py::test_each_role_has_its_restated_id_response_and_place",),
    "role: rejected": ("test_rules_pairs.py::test_each_role_has_its_restated_id_response_and_place",),
    "pairs: whole pairs, chosen first, in every micro batch": (
        "test_rules_pairs.py::test_every_micro_batch_holds_whole_pairs_chosen_first",
        "test_rules_pairs.py::test_a_step_split_over_ranks_keeps_every_pair_in_one_micro_batch",
    ),
    "pairs: an odd micro batch or a broken pair is refused": (
        "test_rules_pairs.py::test_an_odd_micro_batch_or_a_broken_pair_is_refused",
        "test_rules_pairs.py::test_a_single_row_in_a_pair_file_is_a_problem_not_a_row",
    ),
    "pairs: (2 - beta) skew KL on chosen rows, beta skew reverse KL on rejected rows": (
        "test_losses_contrastive.py::test_value_and_gradient_match_the_loop_reference",
        "test_losses_contrastive.py::test_swapping_chosen_and_rejected_changes_the_result",
    ),
    # checksum paths
    "checksums: a checkpoint's checksums.sha256, verified on resume": (
        "test_rules_checksums.py::test_a_checkpoint_list_is_sha256sum_of_every_other_file",
        "test_rules_checksums.py::test_a_resume_refuses_changed_bytes_naming_the_file_and_the_previous_checkpoint",
        "test_rules_checksums.py::test_a_corrupt_list_is_refused_and_a_checkpoint_without_one_resumes_with_a_warning",
    ),
    "checksums: final/ and best/ carry checksums.sha256": (
        "test_rules_checksums.py::test_final_and_best_carry_the_list_of_every_file_they_hold",
    ),
    "checksums: annotate parts' sha256 in the manifest": (
        "test_rules_checksums.py::test_a_part_is_intact_exactly_when_its_bytes_have_the_recorded_sha256",
        "test_rules_checksums.py::test_a_read_refuses_a_part_whose_sha256_differs_from_the_manifest",
        "test_rules_checksums.py::test_a_manifest_entry_that_is_no_part_of_the_directory_is_refused",
    ),
    "checksums: mta embed parts' sha256": ("test_embed.py::test_a_changed_part_is_refused",),
    "checksums: evaluation fingerprints and checksum lists": (
        "test_rules_checksums.py::test_the_fingerprint_is_the_sha256_of_the_model_files_and_nothing_else",
        "test_rules_checksums.py::test_the_list_is_verified_for_model_files_and_leaves_the_fingerprint_as_it_is",
        "test_rules_checksums.py::test_weights_that_are_not_whole_are_refused_before_anything_loads",
    ),
    # guarantees that are not refusals
    "a step that leaves non-finite weights or loss stops the run before anything is saved": (
        "test_rules_refusals.py::test_a_non_finite_step_stops_before_the_step_returns",
    ),
}

# Each README sentence that says "refused" / "refuses" (quoted as the README words it, whitespace
# joined) -> the fast tests of that refusal.
REFUSALS: dict[str, tuple[str, ...]] = {
    "FSDP1 is refused (use FSDP2).": ("test_trl_plugin.py::test_a_launch_the_engine_would_not_run_is_refused",),
    "nor FSDP (refused: it would train unsharded)": (
        "test_trl_plugin.py::test_a_launch_the_engine_would_not_run_is_refused",
    ),
    "`mta annotate`, `mta embed` and `mta teacher` refuse an output directory whose manifest (or shard "
    "manifests) names another artefact kind, `--force` included": (
        "test_hostile_stages.py::test_case1_teacher_into_an_annotations_directory_is_refused_even_with_force",
    ),
    "refuses scores of the same path made from another model, naming both.": (
        "test_hostile_stages.py::test_case3_push_results_of_the_same_path_but_another_model_are_refused_naming_both",
    ),
    "a directory link leading out of that directory is refused (`mta.files.open_inside`); a planted link is "
    "refused, never written through": (
        "test_hostile_stages.py::test_case7_a_planted_link_at_a_lock_is_refused_and_its_target_untouched",
        "test_hostile_stages.py::test_case7_a_journal_never_appends_through_a_link",
    ),
    "a card whose `data_files` name an absolute path or `../` is refused.": (
        "test_hostile_stages.py::test_case8_a_hub_card_naming_files_outside_its_snapshot_is_refused",
    ),
    "(a student's `recipe.yaml` naming them as its training rows is refused)": (
        "test_inspect.py::test_training_rows_and_other_tokenizers_are_refused",
    ),
    "`run_evidence` refuses a plan that does not.": (
        "test_evidence.py::test_a_design_over_its_budget_is_refused_before_anything_is_written",
    ),
    "A directory of other settings, or of the first design, is refused, never overwritten.": (
        "test_evidence.py::test_a_directory_of_other_settings_is_refused_naming_them_and_left_as_it_was",
    ),
    "The manifest records it and a recipe with another template is refused.": (
        "test_rules_refusals.py::test_annotations_built_for_another_template_rule_length_or_tokenizer_are_refused",
    ),
    "A per-shard file lock refuses a second writer of the same shard, naming its pid": (
        "test_rules_refusals.py::test_a_second_writer_of_the_same_shard_is_refused_naming_its_pid",
    ),
    "so a planted, swapped or corrupt file is refused, never read or deleted.": (
        "test_rules_refusals.py::test_a_part_outside_the_directory_is_refused_never_read_or_deleted",
        "test_rules_refusals.py::test_a_swapped_or_corrupt_part_is_refused_naming_it",
    ),
    "`mta distill` into a directory holding another run's outputs (`run.json`, `checkpoints/`, `final/`, "
    "`metrics.jsonl`) is refused naming the directory": (
        "test_rules_refusals.py::test_a_directory_holding_any_one_run_output_is_refused_and_left_as_it_was",
        "test_rules_refusals.py::test_every_run_output_is_restated",
    ),
    "a checkpoint already past the new total is refused": (
        "test_rules_refusals.py::test_a_checkpoint_past_the_new_total_is_refused",
    ),
    "Any other change (models, tokenizers, losses, layers, batch sizes, precision, ZeRO stage, seed, lengths, "
    "`deepspeed:`) is refused naming each key with its old and new value": (
        "test_rules_resume.py::test_each_llm_recipe_key_changes_or_is_refused_as_restated",
        "test_rules_resume.py::test_each_embedding_recipe_key_changes_or_is_refused_as_restated",
    ),
    "non-finite numbers and impossible lengths are refused by the recipe schema before anything loads.": (
        "test_rules_refusals.py::test_a_non_finite_number_is_refused_by_the_schema",
        "test_rules_refusals.py::test_impossible_lengths_are_refused_by_the_schema",
    ),
    "a file that needs anything else is refused by name without being loaded.": (
        "test_rules_refusals.py::test_a_state_file_needing_another_type_is_refused_by_name_and_runs_nothing",
    ),
    "a resume refuses files whose bytes changed and names the previous complete checkpoint.": (
        "test_rules_checksums.py::test_a_resume_refuses_changed_bytes_naming_the_file_and_the_previous_checkpoint",
    ),
    "If those files change at the same path, or the settings change, the old predictions are refused naming "
    "the file that changed and the fix": (
        "test_rules_checksums.py::test_predictions_of_other_model_files_at_the_same_path_are_refused_naming_the_file",
        "test_rules_refusals.py::test_predictions_made_with_other_settings_are_refused_naming_the_setting_and_the_fix",
    ),
    "ZeRO 0/1/2 (ZeRO-3 is refused)": ("test_rules_refusals.py::test_asam_under_zero3_is_refused",),
    "a tracking server that does not answer is refused within seconds, before any model loads.": (
        "test_tracking.py::test_an_unreachable_mlflow_server_is_refused_within_seconds_before_any_model_loads",
    ),
}


@cache
def fast_tests(file: str) -> dict[str, bool]:
    """The module-level test functions of ``tests/<file>``: name -> whether it runs in the fast suite."""
    tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "slow" in ast.unparse(node.value)
        for node in tree.body
    )
    return {
        node.name: not module_slow and not any("mark.slow" in ast.unparse(d) for d in node.decorator_list)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def named_tests() -> list[tuple[str, str]]:
    return sorted({(rule, test) for table in (RULES, REFUSALS) for rule, tests in table.items() for test in tests})


@pytest.mark.parametrize("rule, test", named_tests())
def test_each_named_test_exists_and_runs_in_the_fast_suite(rule, test):
    file, _, name = test.partition("::")
    tests = fast_tests(file)
    assert name in tests, f"{rule}: {test} does not exist"
    assert tests[name], f"{rule}: {test} is marked slow; the rule needs a fast test"


def readme_text() -> str:
    return " ".join(README.read_text(encoding="utf-8").split())


def test_every_refusal_the_readme_promises_is_listed():
    text = readme_text()
    spans = []
    for sentence in REFUSALS:
        assert sentence in text, f"the README no longer says: {sentence!r}; update REFUSALS"
        start = text.index(sentence)
        spans.append((start, start + len(sentence)))
    unlisted = [
        text[max(0, found.start() - 80) : found.end() + 40]
        for found in re.finditer(r"refus", text)
        if not any(start <= found.start() < end for start, end in spans)
    ]
    assert not unlisted, f"README refusals without a fast test in REFUSALS: {unlisted}"


def names_of(prefix: str) -> set[str]:
    return {rule.removeprefix(prefix) for rule in RULES if rule.startswith(prefix)}


def test_every_schedule_and_mode_names_a_fast_test():
    assert names_of("schedule: ") == set(get_args(OffPolicySchedule))
    assert names_of("mode: ") == set(get_args(OffPolicyMode))


def test_every_select_by_goal_names_a_fast_test():
    assert names_of("select_by: ") == set(get_args(TrainSpec.model_fields["select_by"].annotation))


def test_every_pair_role_names_a_fast_test():
    assert names_of("role: ") == set(ROLES)
