"""PPO policy and value losses, their aggregation, explained variance and entropy, against hand computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.aggregation import metric_aggregation
from tandem.megatron.algorithms.entropy import entropy_from_logits, entropy_of_shifted
from tandem.megatron.algorithms.importance import tis_sequence_mask, tis_weights
from tandem.megatron.algorithms.losses import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    explained_variance,
    loss_sum_and_count,
    policy_loss,
    value_loss,
    value_loss_and_metrics,
)


def _policy(
    ratios: list[float], advantages: list[float], **kwargs: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Policy loss of one row with the given ratios (old log-probs 0, so log_probs = log ratio)."""
    log_probs = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        log_probs,
        torch.zeros_like(log_probs),
        torch.tensor([advantages], dtype=torch.float64),
        **kwargs,  # type: ignore[arg-type]
    )
    loss.sum().backward()
    assert log_probs.grad is not None
    return loss, metrics, log_probs.grad


def test_policy_loss_clip_on_both_sides() -> None:
    # ε = 0.2, so the ratio's clip range is [0.8, 1.2]; loss = max(−r·A, −clip(r)·A).
    # 0: A = +2, r = 1.5: the surrogate would reward pushing r past 1.2 → clipped: −1.2·2 = −2.4, no gradient.
    # 1: A = +2, r = 0.5: below the range but A > 0, so pessimism keeps the unclipped −0.5·2 = −1.0.
    # 2: A = −2, r = 0.5: pushing r below 0.8 would be rewarded → clipped: 0.8·2 = 1.6, no gradient.
    # 3: A = −2, r = 1.5: above the range but A < 0, unclipped: 1.5·2 = 3.0.
    # 4: A = +2, r = 1.1: inside the range, both terms agree: −1.1·2 = −2.2.
    loss, metrics, grad = _policy([1.5, 0.5, 0.5, 1.5, 1.1], [2.0, 2.0, -2.0, -2.0, 2.0], eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-2.4, -1.0, 1.6, 3.0, -2.2]], dtype=torch.float64))
    torch.testing.assert_close(
        metrics["clip_frac"], torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(metrics["dual_clip_frac"], torch.zeros(1, 5, dtype=torch.float64))
    # d(−A·r)/d log r = −A·r where unclipped; 0 where the clipped (constant) term is chosen.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, 0.0, 3.0, -2.2]], dtype=torch.float64))


def test_policy_loss_asymmetric_clip_high() -> None:
    # ε_low = 0.2, ε_high = 0.28 ("clip-higher"): range [0.8, 1.28].
    # 0: A = +1, r = 1.25 is inside the wider upper range: −1.25 (would be clipped to −1.2 symmetrically).
    # 1: A = +1, r = 1.3 is above it: −1.28.
    # 2: A = −1, r = 0.7 is below the unchanged lower bound: 0.8.
    loss, metrics, _ = _policy([1.25, 1.3, 0.7], [1.0, 1.0, -1.0], eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -1.28, 0.8]], dtype=torch.float64))
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64))


def test_policy_loss_dual_clip() -> None:
    # ε = 0.2, c = 3: for A < 0 the loss is min(c·|A|, max(r·|A|, clip(r)·|A|)).
    # 0: A = −1, r = 5: the ratio exploded; max(5, 1.2) = 5 is bounded to c·1 = 3, no gradient.
    # 1: A = −1, r = 2: 2 < c, dual clip inactive: 2.
    # 2: A = +1, r = 5: dual clip never applies to A > 0; the ordinary clip gives −1.2.
    # 3: A = −1, r = 0.5: the ordinary lower clip: 0.8 (< c, untouched).
    loss, metrics, grad = _policy([5.0, 2.0, 5.0, 0.5], [-1.0, -1.0, 1.0, -1.0], eps_clip=0.2, eps_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2, 0.8]], dtype=torch.float64))
    torch.testing.assert_close(
        metrics["dual_clip_frac"], torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        metrics["clip_frac"], torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=torch.float64))


def test_policy_loss_approx_kl_metric_and_detachment() -> None:
    # approx_kl = (r − 1) − log r: r = 2 → 1 − ln 2; r = 1 → 0; r = 0.5 → −0.5 + ln 2.
    loss, metrics, _ = _policy([2.0, 1.0, 0.5], [1.0, 1.0, 1.0], eps_clip=0.2)
    expected = torch.tensor([[1 - math.log(2), 0.0, -0.5 + math.log(2)]], dtype=torch.float64)
    torch.testing.assert_close(metrics["approx_kl"], expected)
    assert loss.requires_grad
    assert not any(m.requires_grad for m in metrics.values())
    assert all(m.shape == loss.shape for m in metrics.values())


def test_policy_loss_clamps_the_log_ratio() -> None:
    # A log-ratio of ±50 (or a garbage log-prob at a padded position) would overflow exp; clamped to
    # ±20 the loss stays finite: A = −1 with r = e^20 → e^20 (unclipped, A < 0); A = +1 with r = e^−20
    # → −e^−20 (below the range but A > 0, unclipped); and with A = 0 at padding exactly 0.
    log_probs = torch.tensor([[50.0, -50.0, 1e30]])
    loss, metrics = policy_loss(log_probs, torch.zeros(1, 3), torch.tensor([[-1.0, 1.0, 0.0]]), eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[math.exp(20.0), -math.exp(-20.0), 0.0]]))
    assert torch.isfinite(metrics["approx_kl"]).all()


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"eps_clip": 1.0}, "eps_clip"),
        ({"eps_clip": math.nan}, "eps_clip"),
        ({"eps_clip_high": 0.0}, "eps_clip_high"),
        ({"eps_clip_c": 1.0}, "eps_clip_c"),
        ({"advantages": torch.zeros(2, 2)}, "advantages"),
    ],
)
def test_policy_loss_bad_input_names_the_argument(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {
        "log_probs": torch.zeros(2, 3),
        "old_log_probs": torch.zeros(2, 3),
        "advantages": torch.zeros(2, 3),
        "eps_clip": 0.2,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"`{flag}`"):
        policy_loss(**args)  # type: ignore[arg-type]


def test_value_loss_clip_cases() -> None:
    # V_old = 1, R = 2, value_clip = 0.2, so the clipped value lies in [0.8, 1.2]; loss = 0.5·max(...).
    # 0: V = 1.5 moved toward R beyond the clip: clipped (1.2 − 2)² = 0.64 > (1.5 − 2)² = 0.25 → 0.32, no gradient.
    # 1: V = 1.1 inside the clip: both terms (1.1 − 2)² = 0.81 → 0.405.
    # 2: V = 3 overshoots R: unclipped (3 − 2)² = 1 > clipped 0.64 → 0.5.
    # 3: V = 0.5 moved away from R: unclipped 2.25 > clipped (0.8 − 2)² = 1.44 → 1.125.
    values = torch.tensor([[1.5, 1.1, 3.0, 0.5]], dtype=torch.float64, requires_grad=True)
    old_values = torch.ones(1, 4, dtype=torch.float64)
    returns = torch.full((1, 4), 2.0, dtype=torch.float64)
    loss, metrics = value_loss_and_metrics(values, old_values, returns, value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.405, 0.5, 1.125]], dtype=torch.float64))
    torch.testing.assert_close(
        metrics["value_clip_frac"], torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    )
    assert not metrics["value_clip_frac"].requires_grad
    loss.sum().backward()
    # Where unclipped the 0.5 makes the gradient V − R: 1.1 − 2, 3 − 2, 0.5 − 2.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.9, 1.0, -1.5]], dtype=torch.float64))
    torch.testing.assert_close(value_loss(values, old_values, returns, 0.2), loss)


def test_value_loss_without_clip() -> None:
    # value_clip=None: plain 0.5·(V − R)², even where V moved far from V_old.
    loss = value_loss(
        torch.tensor([[5.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[2.0, 2.0]]), value_clip=None
    )
    torch.testing.assert_close(loss, torch.tensor([[4.5, 0.5]]))


@pytest.mark.parametrize(("value_clip", "flag"), [(0.0, "value_clip"), (-1.0, "value_clip")])
def test_value_loss_bad_clip(value_clip: float, flag: str) -> None:
    with pytest.raises(ValueError, match=f"`{flag}`"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), value_clip)


LOSS = [[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


def test_aggregate_sample_mean() -> None:
    # Row means 2 and 4; the all-masked third row carries no loss and is not counted: (2 + 4) / 2 = 3.
    # The 99s sit at masked positions and must not count.
    got = aggregate_loss(torch.tensor(LOSS), torch.tensor(MASK), "sample_mean")
    torch.testing.assert_close(got, torch.tensor(3.0))


def test_aggregate_token_mean() -> None:
    # Four trainable tokens summing to 10: 10 / 4 = 2.5 (the long first row weighs three times as much).
    got = aggregate_loss(torch.tensor(LOSS), torch.tensor(MASK), "token_mean")
    torch.testing.assert_close(got, torch.tensor(2.5))


def test_loss_sum_and_count_by_hand() -> None:
    # token_mean: the four trainable tokens sum to 10 (the 99s are masked), count 4.
    total, count = loss_sum_and_count(torch.tensor(LOSS), torch.tensor(MASK), "token_mean")
    assert (total.item(), count.item(), count.dtype) == (10.0, 4, torch.int64)
    # sample_mean: the two row means 2 and 4 add up to 6, over the 2 rows with a trainable token.
    total, count = loss_sum_and_count(torch.tensor(LOSS), torch.tensor(MASK), "sample_mean")
    assert (total.item(), count.item()) == (6.0, 2)


def test_token_sum_modes_by_hand() -> None:
    # seq_mean_token_sum: the row sums 1 + 2 + 3 = 6 and 4, over the 2 rows with a trainable token: 5.
    # seq_mean_token_sum_norm with L = 4: (6 / 4 + 4 / 4) / 2 = 1.25 (Dr.GRPO: no 1/|y_i|, a constant L).
    total, count = loss_sum_and_count(torch.tensor(LOSS), torch.tensor(MASK), "seq_mean_token_sum")
    assert (total.item(), count.item()) == (10.0, 2)
    got = aggregate_loss(torch.tensor(LOSS), torch.tensor(MASK), "seq_mean_token_sum")
    torch.testing.assert_close(got, torch.tensor(5.0))
    got = aggregate_loss(torch.tensor(LOSS), torch.tensor(MASK), "seq_mean_token_sum_norm", norm_tokens=4)
    torch.testing.assert_close(got, torch.tensor(1.25))
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregate_loss(torch.tensor(LOSS), torch.tensor(MASK), "seq_mean_token_sum_norm")
    # Metrics beside a token-sum loss are token means per sample (their count is the samples').
    assert metric_aggregation("seq_mean_token_sum_norm") == "sample_mean"
    assert metric_aggregation("token_mean") == "token_mean"


def test_aggregate_nothing_trainable_gives_connected_zero() -> None:
    loss = torch.full((2, 3), 7.0, requires_grad=True)
    for mode in LOSS_AGGREGATIONS:
        got = aggregate_loss(loss, torch.zeros(2, 3), mode, norm_tokens=3)  # type: ignore[arg-type]
        assert got.item() == 0.0
        got.backward()  # still in the graph, so a backward pass on every rank works
        assert loss.grad is not None and loss.grad.eq(0).all()


def test_a_row_without_trainable_token_counts_for_nothing() -> None:
    mask = torch.tensor([[1, 0], [0, 0]])
    total, count = loss_sum_and_count(torch.tensor([[3.0, 5.0], [7.0, 9.0]]), mask, "sample_mean")
    assert (total.item(), count.item()) == (3.0, 1)


@st.composite
def split_batches(draw: st.DrawFn) -> tuple[list[list[float]], list[list[bool]], list[int]]:
    batch = draw(st.integers(1, 6))
    length = draw(st.integers(1, 5))
    losses = [draw(st.lists(st.floats(-100, 100), min_size=length, max_size=length)) for _ in range(batch)]
    masks = [draw(st.lists(st.booleans(), min_size=length, max_size=length)) for _ in range(batch)]
    cuts = sorted(draw(st.lists(st.integers(1, batch - 1), max_size=3, unique=True))) if batch > 1 else []
    return losses, masks, cuts


@settings(max_examples=60, deadline=None)
@given(split_batches(), st.sampled_from(LOSS_AGGREGATIONS))
def test_sums_and_counts_of_micro_batches_give_the_whole_mean(
    case: tuple[list[list[float]], list[list[bool]], list[int]], mode: LossAggregation
) -> None:
    # What Megatron's per-token-loss path does with a step cut into micro-batches (or ranks):
    # the numerators and the counts are summed, and divided once. That must be the whole step's mean.
    losses, masks, cuts = case
    loss = torch.tensor(losses, dtype=torch.float64)
    mask = torch.tensor(masks)
    whole = aggregate_loss(loss, mask, mode, norm_tokens=7)
    parts = [
        loss_sum_and_count(loss[a:b], mask[a:b], mode, norm_tokens=7)
        for a, b in itertools.pairwise([0, *cuts, len(losses)])
    ]
    total = torch.stack([t for t, _ in parts]).sum()
    count = int(sum(int(c) for _, c in parts))
    torch.testing.assert_close(total / max(count, 1), whole)


def test_aggregate_bad_mode_lists_the_modes() -> None:
    with pytest.raises(ValueError, match="sample_mean, token_mean"):
        aggregate_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean")  # type: ignore[arg-type]


def test_explained_variance() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # A perfect critic explains everything.
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    # Predicting the mean of the trainable returns (3) explains nothing: Var[R − 3] = Var[R].
    assert explained_variance(torch.full_like(returns, 3.0), returns, mask).item() == pytest.approx(0.0)
    # Values off by ±1 alternately: R − V = (1, −1, 1, ·; −1, 1) with mean 0.2, Var = 1 − 0.04 = 0.96;
    # Var[R] over 1..5 is 2 (population variance): 1 − 0.96 / 2 = 0.52.
    offsets = torch.tensor([[-1.0, 1.0, -1.0, 0.0], [1.0, -1.0, 0.0, 0.0]])
    assert explained_variance(returns + offsets, returns, mask).item() == pytest.approx(0.52)
    # Constant returns: the ratio is undefined.
    assert math.isnan(explained_variance(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)).item())


@st.composite
def logit_rows(draw: st.DrawFn) -> list[list[float]]:
    vocab = draw(st.integers(1, 6))
    row = st.lists(st.floats(-30, 30), min_size=vocab, max_size=vocab)
    return draw(st.lists(row, min_size=1, max_size=4))


@settings(max_examples=40, deadline=None)
@given(logit_rows())
def test_entropy_matches_torch_categorical(rows: list[list[float]]) -> None:
    # torch.distributions.Categorical is the reference no one here wrote.
    logits = torch.tensor(rows, dtype=torch.float64)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_entropy_is_stable_for_large_and_peaked_logits() -> None:
    # Entropy is invariant to adding a constant; with logits near 1e4 in float32 the form
    # logsumexp(l) − Σ p·l would lose about 1e-3 to cancellation.
    logits = torch.tensor([[0.0, -1.0, -2.0, -30.0]])
    expected = entropy_from_logits(logits.double()).float()
    torch.testing.assert_close(entropy_from_logits(logits + 1e4), expected, rtol=1e-5, atol=1e-6)
    # Uniform over V entries: log V. A vocabulary entry masked with finfo.min does not count.
    uniform = torch.zeros(2, 3, 8)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(8)))
    masked = torch.tensor([[0.0, 0.0, torch.finfo(torch.float32).min]])
    torch.testing.assert_close(entropy_from_logits(masked), torch.tensor([math.log(2)]))


def test_entropy_gradient_is_finite() -> None:
    logits = torch.tensor([[3.0, 0.0, torch.finfo(torch.float32).min]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


@settings(max_examples=30, deadline=None)
@given(logit_rows(), st.integers(1, 5))
def test_entropy_over_vocabulary_slices_matches_the_whole(rows: list[list[float]], cut: int) -> None:
    # Two tensor-parallel ranks, emulated: each holds a slice of the vocabulary, and a sum over the
    # vocabulary is its own part plus the other rank's (a constant to it: Megatron's all-reduce has
    # an identity backward). Values and each rank's gradient of its slice must be the full ones.
    logits = torch.tensor(rows, dtype=torch.float64)
    assume(logits.shape[-1] > cut)
    full = logits.clone().requires_grad_()
    entropy_from_logits(full).sum().backward()
    assert full.grad is not None
    shift = logits.max(dim=-1, keepdim=True).values
    halves = [logits[:, :cut], logits[:, cut:]]
    for rank in range(2):
        local = halves[rank].clone().requires_grad_()
        other = halves[1 - rank] - shift
        other_exp_sum = other.exp().sum(-1)
        other_partial = (other.exp() * other).sum(-1)
        shifted = local - shift
        exp = shifted.exp()
        sum_exp = exp.sum(-1) + other_exp_sum
        entropy = entropy_of_shifted(shifted, exp, sum_exp, lambda part, o=other_partial: part + o)
        torch.testing.assert_close(entropy, entropy_from_logits(logits))
        entropy.sum().backward()
        expected_grad = full.grad[:, :cut] if rank == 0 else full.grad[:, cut:]
        torch.testing.assert_close(local.grad, expected_grad)


def test_tis_weights_by_hand() -> None:
    # old − rollout = (0, ln 1.5, ln 3, −ln 2): weights 1, 1.5, 3 → cap 2, 0.5 (below 1: kept).
    old = torch.tensor([[0.0, math.log(1.5), math.log(3.0), -math.log(2.0)]], dtype=torch.float64)
    weights = tis_weights(old.requires_grad_(), torch.zeros_like(old), cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 2.0, 0.5]], dtype=torch.float64))
    assert not weights.requires_grad
    # A huge log-ratio is clamped before exp: the weight is the cap, not inf or NaN.
    assert tis_weights(torch.tensor([[1e6]]), torch.tensor([[0.0]]), cap=2.0).item() == 2.0
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, old, cap=0.0)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        tis_weights(old, torch.zeros(1, 3), cap=2.0)


def test_tis_lower_bound_and_sequence_mask_by_hand() -> None:
    # old − rollout per token = ln of (1, 1.5, 3, 0.25): weights clipped to [0.5, 2] are (1, 1.5, 2, 0.5).
    old = torch.tensor([[0.0, math.log(1.5), math.log(3.0), math.log(0.25)]], dtype=torch.float64)
    rollout = torch.zeros_like(old)
    weights = tis_weights(old, rollout, cap=2.0, low=0.5)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 2.0, 0.5]], dtype=torch.float64))
    # Sequences: row 0's geometric mean is (1 · 1.5 · 3 · 0.25)^(1/4) = 1.125^(1/4) ≈ 1.03, inside [0.5, 2]:
    # kept. Row 1 = (4, 4, masked 0.01): its trainable tokens' mean ratio is 4 > 2: every token left out.
    # Row 2 = (0.25, 0.25): 0.25 < 0.5, out; with no lower bound (low 0) it stays.
    old = torch.tensor(
        [
            [0.0, math.log(1.5), math.log(3.0), math.log(0.25)],
            [math.log(4.0), math.log(4.0), math.log(0.01), 0.0],
            [math.log(0.25), math.log(0.25), 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
    kept = tis_sequence_mask(old, torch.zeros_like(old), mask, 2.0, low=0.5)
    torch.testing.assert_close(kept, torch.tensor([[1.0] * 4, [0.0] * 4, [0.0] * 4], dtype=torch.float64))
    unbounded_below = tis_sequence_mask(old, torch.zeros_like(old), mask, 2.0)
    torch.testing.assert_close(unbounded_below[:, 0], torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="`low`"):
        tis_weights(old, old, cap=2.0, low=3.0)


def _verl_agg_loss(loss: list[list[float]], mask: list[list[bool]], mode: str, norm: int) -> float:
    """verl's `agg_loss` (core_algos.py at b178a3c) over one whole batch, re-derived from its formulas.

    seq-mean-token-sum: each sequence's masked token sum, averaged over the sequences with a token;
    seq-mean-token-sum-norm: the sum over all sequences of their token sums / loss_scale_factor, which
    Tandem then divides by the sequences with a token (verl's actor by its gradient accumulation).
    """
    sums = [
        sum(v for v, m in zip(row, row_mask, strict=True) if m)
        for row, row_mask in zip(loss, mask, strict=True)
    ]
    live = [any(row_mask) for row_mask in mask]
    samples = max(sum(live), 1)
    total = sum(s for s, alive in zip(sums, live, strict=True) if alive)
    return total / samples if mode == "seq_mean_token_sum" else total / norm / samples


@settings(max_examples=60, deadline=None)
@given(split_batches(), st.sampled_from(["seq_mean_token_sum", "seq_mean_token_sum_norm"]), st.integers(1, 9))
def test_token_sum_modes_match_their_formulas(
    case: tuple[list[list[float]], list[list[bool]], list[int]], mode: LossAggregation, norm: int
) -> None:
    losses, masks, _ = case
    got = aggregate_loss(
        torch.tensor(losses, dtype=torch.float64), torch.tensor(masks), mode, norm_tokens=norm
    )
    assert got.item() == pytest.approx(_verl_agg_loss(losses, masks, mode, norm), rel=1e-12, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.floats(-3.0, 3.0), st.booleans()), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    ),
    st.floats(0.0, 1.0),
    st.floats(1.0, 5.0),
)
def test_tis_weights_and_sequence_mask_match_their_formulas(
    rows: list[list[tuple[float, bool]]], low: float, cap: float
) -> None:
    # Re-derived from OpenRLHF's `seq-mask-tis` (models/loss.py at 3c3be62), with TIS's clamp on the token
    # weights: w_t = clip(e^{d_t}, low, cap), d_t = log π_old − log π_rollout; a sequence is kept when
    # exp(mean of d over its trainable tokens) lies in [low, cap] (a row without one: ratio 1).
    width = max(len(r) for r in rows)
    diffs = [[d for d, _ in r] + [0.0] * (width - len(r)) for r in rows]
    masks = [[m for _, m in r] + [False] * (width - len(r)) for r in rows]
    old = torch.tensor(diffs, dtype=torch.float64)
    weights = tis_weights(old, torch.zeros_like(old), cap, low=low)
    kept = tis_sequence_mask(old, torch.zeros_like(old), torch.tensor(masks), cap, low=low)
    for i, (row, mask) in enumerate(zip(diffs, masks, strict=True)):
        for t, d in enumerate(row):
            assert weights[i, t].item() == pytest.approx(min(max(math.exp(d), low), cap), rel=1e-12)
        live = [d for d, m in zip(row, mask, strict=True) if m]
        ratio = math.exp(sum(live) / len(live)) if live else 1.0
        assert kept[i].eq(1.0 if low <= ratio <= cap else 0.0).all()
