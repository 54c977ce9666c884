"""DistiLLM's adaptive off-policy sampling against a plain restatement of docs/method.md §5 (and
``mta.training.off_policy.policy``'s docstring): each schedule, the choice of a micro batch's
source, each mode, and the threshold update. The last tests fail when the schema gains a
schedule or a mode these tables do not restate."""

from __future__ import annotations

from itertools import product
from typing import get_args

import numpy as np
import pytest

from mta.training.config.schema import OffPolicyMode, OffPolicySchedule, OffPolicySpec
from mta.training.off_policy.policy import (
    OffPolicyState,
    choose,
    decide,
    draw,
    schedule_value,
    update_threshold,
)

SEED = 1234

# s, the share of τ that generates fresh rows even with a full buffer, at 1-based step t of T.
SCHEDULES = {
    "decreasing": lambda tau, t, total: tau * (1 - t / total),
    "constant": lambda tau, t, total: tau / 2,
    "increasing": lambda tau, t, total: tau * t / total,
}


def restated_choice(r: float, tau: float, s: float, buffer_full: bool) -> str:
    """r < s, or r < τ with the buffer not full: generate; else r < τ: the buffer; else gold."""
    if r < s:
        return "generated"
    if r < tau:
        return "buffer" if buffer_full else "generated"
    return "gold"


def restated_decision(mode, schedule, tau, step, total, k, full, empty) -> str:
    if mode == "off":
        return "gold"
    if mode == "always":
        return "generated"
    source = restated_choice(draw(SEED, step, k), tau, SCHEDULES[schedule](tau, step + 1, total), full)
    return "generated" if source == "buffer" and empty else source  # an empty buffer cannot be drawn from


MODES = {"off", "always", "adaptive"}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_schedule_value_is_the_restated_one(schedule):
    for tau, total in product((0.0, 0.1, 0.35, 0.8, 1.0), (1, 2, 7, 100)):
        for step in range(total):
            want = SCHEDULES[schedule](tau, step + 1, total)
            assert schedule_value(schedule, tau, step, total) == pytest.approx(want, abs=1e-15), (tau, step, total)
    with pytest.raises(ValueError, match="not a step"):
        schedule_value(schedule, 0.5, 3, 3)  # t = step + 1 never exceeds T


def test_choose_is_the_restated_rule_on_a_grid_with_its_boundaries():
    values = (0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.999)
    for r, tau, s, full in product(values, values, values, (False, True)):
        if s <= tau:  # s is a share of τ
            assert choose(r, tau, s, full) == restated_choice(r, tau, s, full), (r, tau, s, full)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_mode_and_schedule_decides_as_restated(mode, schedule):
    spec = OffPolicySpec(mode=mode, schedule=schedule)
    total = 9
    for tau, step, k, full, empty in product(
        (0.0, 0.4, 0.9, 1.0), range(total), range(3), (False, True), (False, True)
    ):
        if full and empty:
            continue
        got = decide(OffPolicyState(tau), spec, step, total, k, full, empty, SEED)
        assert got == restated_decision(mode, schedule, tau, step, total, k, full, empty)


def test_the_draw_is_uniform_on_the_unit_interval_and_the_same_for_the_same_key():
    draws = np.array([draw(SEED, step, k) for step in range(200) for k in range(5)])
    assert ((0 <= draws) & (draws < 1)).all() and abs(draws.mean() - 0.5) < 0.05
    assert draw(SEED, 3, 1) == draw(SEED, 3, 1) != draw(SEED, 3, 2)


def restated_update(tau, reference, eps, step, dev_loss):
    """The first dev loss sets L₀; then L ≥ L₀ + ε: τ ← min(τ + step, 1) (12 decimals), L₀ ← L."""
    if reference is None:
        return tau, dev_loss
    if dev_loss >= reference + eps:
        return min(round(tau + step, 12), 1.0), dev_loss
    return tau, reference


@pytest.mark.parametrize("eps, step", [(0.1, 0.1), (0.0, 0.3), (0.05, 0.25), (1.0, 1.0)])
def test_the_threshold_update_is_the_restated_one_over_random_dev_losses(eps, step):
    spec = OffPolicySpec(mode="adaptive", loss_eps=eps, threshold_step=step, init_threshold=0.0)
    rng = np.random.default_rng(7)
    state, tau, reference = OffPolicyState.initial(spec), 0.0, None
    for evaluation, loss in enumerate(2.0 + 0.06 * np.arange(60) + rng.normal(0, 0.3, 60), start=1):
        state = update_threshold(state, spec, float(loss))
        tau, reference = restated_update(tau, reference, eps, step, float(loss))
        assert (state.threshold, state.reference_loss, state.dev_evaluations) == (tau, reference, evaluation)
    assert 0 < state.threshold_raises < state.dev_evaluations - 1  # both branches were taken


def test_a_dev_loss_of_exactly_the_reference_plus_eps_raises_the_threshold():
    spec = OffPolicySpec(mode="adaptive", loss_eps=0.5, threshold_step=0.25)
    state = update_threshold(OffPolicyState.initial(spec), spec, 2.0)
    tau, reference = 0.0, 2.0
    for loss in (2.25, 2.5, 2.75, 3.0, 1.0, 3.5):  # exactly representable: 2.5 = 2.0 + 0.5 is a tie
        state = update_threshold(state, spec, loss)
        tau, reference = restated_update(tau, reference, 0.5, 0.25, loss)
        assert (state.threshold, state.reference_loss) == (tau, reference)
    assert (tau, reference) == (0.75, 3.5)


def test_ten_steps_of_a_tenth_reach_exactly_one_and_the_threshold_moves_only_in_adaptive():
    spec = OffPolicySpec(mode="adaptive")
    state = update_threshold(OffPolicyState.initial(spec), spec, 0.0)
    for loss in range(1, 11):
        state = update_threshold(state, spec, float(loss))
    assert state.threshold == 1.0 and state.threshold_raises == 10
    for mode in MODES - {"adaptive"}:
        other = OffPolicySpec(mode=mode)
        assert update_threshold(OffPolicyState(0.3, 1.0), other, 9.0) == OffPolicyState(0.3, 1.0)


# --- the tables above name every schedule and mode -----------------------------------------


def test_every_schedule_of_the_schema_is_restated():
    assert set(get_args(OffPolicySchedule)) == set(SCHEDULES)


def test_every_mode_of_the_schema_is_restated():
    assert set(get_args(OffPolicyMode)) == MODES
