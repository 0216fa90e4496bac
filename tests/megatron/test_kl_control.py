"""The adaptive KL controller (Ziegler et al. 2019, §2.2) by hand and against its update re-derived."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.kl_control import adaptive_kl_coef, kl_controller_update


def test_update_by_hand() -> None:
    # β = 0.01, target 0.1, horizon 10000, 1000 samples a step (K_β = 0.1).
    # KL 0.15: error 0.15/0.1 − 1 = 0.5, clipped to 0.2: β · (1 + 0.2 · 0.1) = 0.0102.
    assert kl_controller_update(0.01, 0.15, 0.1, 10000, 1000) == pytest.approx(0.0102)
    # KL 0.09: error −0.1 (inside the clip): β · (1 − 0.01) = 0.0099.
    assert kl_controller_update(0.01, 0.09, 0.1, 10000, 1000) == pytest.approx(0.0099)
    # KL 0: error −1, clipped to −0.2: β · 0.98.
    assert kl_controller_update(0.01, 0.0, 0.1, 10000, 1000) == pytest.approx(0.0098)
    # The steps in order; a step without a KL (NaN) changes nothing: 0.01 · 1.02 · 0.99.
    assert adaptive_kl_coef(0.01, 0.1, 10000, 1000, [0.15, float("nan"), 0.09]) == pytest.approx(0.010098)
    assert adaptive_kl_coef(0.01, 0.1, 10000, 1000, []) == 0.01
    with pytest.raises(ValueError, match="target"):
        kl_controller_update(0.01, 0.1, 0.0, 10000, 1000)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(1e-4, 1.0),
    st.lists(st.floats(0.0, 2.0), max_size=12),
    st.floats(1e-3, 1.0),
    st.integers(100, 100000),
    st.integers(1, 19),
)
def test_matches_the_papers_update(
    init: float, kls: list[float], target: float, horizon: int, n: int
) -> None:
    # e_t = clip(KL_t / KL_target − 1, −0.2, 0.2), β_{t+1} = β_t (1 + K_β e_t), K_β = n / horizon.
    expected = init
    for kl in kls:
        expected *= 1 + min(max(kl / target - 1, -0.2), 0.2) * n / horizon
    assert adaptive_kl_coef(init, target, horizon, n, kls) == pytest.approx(expected, rel=1e-12)
