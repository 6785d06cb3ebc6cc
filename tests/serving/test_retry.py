"""The one retry policy (serving/retry.py) that the generator, lake writer, index store and audit log share."""

from __future__ import annotations

import pytest

from serving.retry import RetryCallState, attempts, patience, retrying, stop_when


class Flaky(Exception):
    pass


class Fatal(Exception):
    pass


def run(failures: list[Exception], policy_kwargs: dict) -> tuple[list[float], int]:
    """Run an operation that raises ``failures`` in turn, then succeeds; return (waits, calls)."""
    waits: list[float] = []
    calls = 0
    for attempt in retrying(sleep=waits.append, **policy_kwargs):
        with attempt:
            calls += 1
            if failures:
                raise failures.pop(0)
    return waits, calls


def test_backoff_doubles_from_the_first_wait_up_to_its_cap():
    waits, calls = run([Flaky()] * 6, {"retry_on": lambda e: isinstance(e, Flaky), "first_s": 0.5, "max_s": 4.0})
    assert calls == 7
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_jitter_stays_within_its_band():
    waits, _ = run([Flaky()] * 40, {"retry_on": lambda e: True, "first_s": 1.0, "max_s": 1.0, "jitter": 0.2})
    assert all(0.8 <= w <= 1.2 for w in waits) and len(set(waits)) > 1


def test_the_last_failure_is_reraised_unwrapped_after_the_attempts():
    with pytest.raises(Flaky, match="third"):
        run(
            [Flaky("first"), Flaky("second"), Flaky("third"), Flaky("never")],
            {"retry_on": lambda e: True, "stop": attempts(3)},
        )


def test_a_failure_not_worth_retrying_is_raised_at_once():
    waits: list[float] = []
    with pytest.raises(Fatal):
        for attempt in retrying(retry_on=lambda e: isinstance(e, Flaky), sleep=waits.append):
            with attempt:
                raise Fatal("schema refused")
    assert waits == []


def test_zero_patience_means_one_attempt_and_patience_bounds_the_total_wait():
    with pytest.raises(Flaky):
        run([Flaky()] * 3, {"retry_on": lambda e: True, "stop": patience(0)})
    # the waits are not real here (sleep is injected), so the clock never reaches a 60 s patience
    _, calls = run([Flaky()] * 3, {"retry_on": lambda e: True, "stop": patience(60)})
    assert calls == 4
    # a wait that would pass the patience is not taken: the failure comes back instead
    with pytest.raises(Flaky):
        run([Flaky()], {"retry_on": lambda e: True, "stop": patience(0.4), "first_s": 0.5})


def test_a_callers_own_rule_sees_the_failure_and_the_coming_wait():
    seen: list[tuple[int, float, str]] = []

    def rule(state: RetryCallState) -> bool:
        assert state.outcome is not None
        seen.append((state.attempt_number, state.upcoming_sleep, str(state.outcome.exception())))
        return state.upcoming_sleep >= 2.0

    with pytest.raises(Flaky):
        run([Flaky("a"), Flaky("b"), Flaky("c"), Flaky("d")], {"retry_on": lambda e: True, "stop": stop_when(rule)})
    assert seen == [(1, 0.5, "a"), (2, 1.0, "b"), (3, 2.0, "c")]


def test_state_kept_between_attempts_sees_the_attempt_number():
    """The lake writer checks, from its second attempt on, whether its first one landed after all."""
    numbers = []
    for attempt in retrying(retry_on=lambda e: True, sleep=lambda s: None):
        with attempt:
            numbers.append(attempt.retry_state.attempt_number)
            if len(numbers) < 3:
                raise Flaky()
    assert numbers == [1, 2, 3]
