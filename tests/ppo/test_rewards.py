"""Rewards: the built-ins, user functions loaded by spec (sync and async), and errors that name the sample."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo.rollout import rewards
from tandem.ppo.rollout.rewards import RewardError, RewardInput, compute_rewards, load_reward


def inputs(*pairs: tuple[str, Any]) -> list[RewardInput]:
    return [
        RewardInput(f"prompt {i}", response, label, {"i": i}, i) for i, (response, label) in enumerate(pairs)
    ]


# --- built-ins ------------------------------------------------------------------------------------


def test_exact_match() -> None:
    batch = inputs((" 42\n", "42"), ("42", 42), ("42.0", "42"), ("", ""), ("4 2", "42"))
    assert compute_rewards(load_reward("exact_match"), batch) == [1.0, 1.0, 0.0, 1.0, 0.0]


MATH_CASES = [
    # Same value, different spelling: math-verify compares symbolically / numerically.
    ("\\boxed{1/2}", "0.5", 1.0),
    ("0.5", "\\boxed{1/2}", 1.0),
    ("so the answer is \\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("5 + 7 = 12", "12", 1.0),
    ("12", 12, 1.0),
    ("3.0", "3", 1.0),
    ("the total is 1,000", "1000", 1.0),
    ("$1+x$", "x+1", 1.0),  # a label that only parses as LaTeX
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    # Different values, or no answer at all.
    ("\\boxed{13}", "12", 0.0),
    ("-3", "3", 0.0),
    ("I do not know", "12", 0.0),
    ("", "12", 0.0),
]


def test_math_equivalences() -> None:
    batch = inputs(*[(response, label) for response, label, _ in MATH_CASES])
    assert compute_rewards(load_reward("math"), batch) == [expected for _, _, expected in MATH_CASES]


def test_math_works_off_the_main_thread() -> None:
    # math-verify's signal-based timeouts fail outside the main thread; the built-in turns them off there.
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(rewards.math(inputs(("\\boxed{1/2}", "0.5")))))
    thread.start()
    thread.join()
    assert results == [[1.0]]


def test_math_label_that_does_not_parse_names_the_sample() -> None:
    with pytest.raises(RewardError, match=r"sample 1 .*label ''") as info:
        compute_rewards(rewards.math, inputs(("1", "1"), ("1", "")))
    assert isinstance(info.value.__cause__, ValueError)


# --- load_reward ----------------------------------------------------------------------------------

USER_MODULE = """
    import asyncio

    def length(inputs):
        return [float(len(inp.response)) for inp in inputs]

    async def async_length(inputs):
        await asyncio.sleep(0)
        return [float(len(inp.response)) + inp.metadata["i"] for inp in inputs]

    NOT_CALLABLE = 3
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    # tmp_path is outside the package and not on sys.path: the file is loaded by its path.
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_MODULE), encoding="utf-8")
    return path


def test_user_function_from_a_file_sync_and_async(user_file: Path) -> None:
    batch = inputs(("abc", None), ("", None))
    assert compute_rewards(load_reward(f"{user_file}:length"), batch) == [3.0, 0.0]
    assert compute_rewards(load_reward(f"{user_file}:async_length"), batch) == [3.0, 1.0]


def test_async_function_called_from_inside_an_event_loop(user_file: Path) -> None:
    fn = load_reward(f"{user_file}:async_length")

    async def driver() -> list[float]:
        return compute_rewards(fn, inputs(("ab", None)))

    assert asyncio.run(driver()) == [2.0]


def test_user_function_from_a_module(user_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(user_file.parent))
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)
    assert compute_rewards(load_reward("my_reward:length"), inputs(("abcd", None))) == [4.0]
    assert load_reward("tandem.ppo.rollout.rewards:exact_match") is rewards.exact_match


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nonsense", "not a built-in reward"),
        ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
        ("tandem.ppo.rollout.rewards:nope", "has no function 'nope'.*exact_match"),
        ("/no/such/file.py:f", "does not exist"),
        ("{file}:missing", "has no function 'missing'.*async_length"),
        ("{file}:NOT_CALLABLE", "is a int, not callable"),
    ],
)
def test_load_reward_errors_name_the_flag(user_file: Path, spec: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected) as info:
        load_reward(spec.format(file=user_file))
    assert str(info.value).startswith("--custom-rm-path ")


def test_load_reward_file_that_raises_on_import(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--custom-rm-path .*RuntimeError\('boom'\).*fix the error") as info:
        load_reward(f"{path}:f")
    assert isinstance(info.value.__cause__, RuntimeError)


# --- compute_rewards errors -----------------------------------------------------------------------


def fails_on_label_bad(batch: list[RewardInput]) -> list[float]:
    for inp in batch:
        if inp.label == "bad":
            raise KeyError("boom")
    return [1.0] * len(batch)


async def async_fails_on_label_bad(batch: list[RewardInput]) -> list[float]:
    return fails_on_label_bad(batch)


@pytest.mark.parametrize("fn", [fails_on_label_bad, async_fails_on_label_bad])
def test_a_raising_function_names_the_first_failing_sample(fn: Any) -> None:
    batch = inputs(("a", "ok"), ("b", "ok"), ("c", "bad"), ("d", "bad"))
    with pytest.raises(
        RewardError, match=r"raised on sample 2 \(prompt 'prompt 2', label 'bad'\): KeyError"
    ) as info:
        compute_rewards(fn, batch)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_function_that_fails_only_on_the_batch() -> None:
    def needs_two(batch: list[RewardInput]) -> list[float]:
        if len(batch) < 2:
            return [0.0] * len(batch)
        raise RuntimeError("batch too big")

    with pytest.raises(RewardError, match=r"on the batch of 2 samples .* but on none of them alone") as info:
        compute_rewards(needs_two, inputs(("a", 1), ("b", 1)))
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ([1.0], "returned 1 rewards for 2 samples"),
        (None, "returned a NoneType, not a list of floats"),
        ([1.0, "1"], r"returned '1' for sample 1 "),
        ([float("nan"), 1.0], r"returned nan for sample 0 "),
        ([1.0, float("inf")], r"returned inf for sample 1 "),
    ],
)
def test_wrong_results_name_the_sample(returned: Any, expected: str) -> None:
    with pytest.raises(RewardError, match=expected):
        compute_rewards(lambda batch: returned, inputs(("a", 1), ("b", 1)))


def test_numbers_of_any_kind_become_floats() -> None:
    def tuple_of_numbers(batch: list[RewardInput]) -> Any:
        return (1, True, 0.5)

    result = compute_rewards(tuple_of_numbers, inputs(("a", 1), ("b", 1), ("c", 1)))
    assert result == [1.0, 1.0, 0.5]
    assert all(type(r) is float for r in result)
    assert compute_rewards(rewards.exact_match, []) == []


def test_every_real_number_type_is_a_reward() -> None:
    """NumPy's bool, integer and float scalars (np.bool_ is no `numbers.Real`), 0-d arrays and tensors,
    and fractions are rewards; complex numbers and arrays of several values are not."""
    from fractions import Fraction

    import numpy as np
    import torch

    returned = [np.bool_(True), np.bool_(False), np.int8(3), np.uint16(2), np.float16(0.5), np.float64(0.25)]
    returned += [np.array(0.75), torch.tensor(1.5), torch.tensor(True), Fraction(1, 4)]
    result = compute_rewards(lambda batch: returned, inputs(*[("p", 1)] * len(returned)))
    assert result == [1.0, 0.0, 3.0, 2.0, 0.5, 0.25, 0.75, 1.5, 1.0, 0.25]
    assert all(type(r) is float for r in result)
    for bad in (np.complex64(1), np.array([1.0, 2.0]), torch.tensor([1.0]), np.float32("nan")):
        with pytest.raises(RewardError, match=r"for sample 0 .*each reward must be a finite real number"):
            compute_rewards(lambda batch, bad=bad: [bad], inputs(("p", 1)))
