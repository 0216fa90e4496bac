"""On-policy distillation's math by hand and against exact expectations (`algorithms.distillation`).

The per-token reverse KL on a tiny example by hand; the folded rewards by hand; the
two modes' gradients against the exact gradient of the reverse KL they claim to
descend, computed by enumerating every sampled token (and every response of a
two-token toy): `reward` mode's GAE returns give the whole response's reverse KL's
gradient, `loss` mode's term each token's own. Then the worker's two uses, pure:
`targets.reward_signal` (both KLs folded, the same on critic and actor) and
`role_losses.actor_loss` (the loss term and the metric).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron import RolloutBatch, WorkerConfig
from tandem.megatron.algorithms.distillation import distillation_loss, distillation_rewards, reverse_kl
from tandem.megatron.algorithms.gae import compute_gae
from tandem.megatron.algorithms.kl import kl_penalized_rewards
from tandem.megatron.worker.response_outputs import ResponseOutputs
from tandem.megatron.worker.role_losses import actor_loss
from tandem.megatron.worker.targets import reward_signal

LN = math.log


def test_the_per_token_reverse_kl_by_hand() -> None:
    # Student p(y_t) = 0.5, 0.25, 0.9 on its sampled tokens; teacher 0.25, 0.5, 0.9: KL_t = ln(p / q).
    student = torch.tensor([[LN(0.5), LN(0.25), LN(0.9)]])
    teacher = torch.tensor([[LN(0.25), LN(0.5), LN(0.9)]])
    torch.testing.assert_close(reverse_kl(student, teacher), torch.tensor([[LN(2), -LN(2), 0.0]]))
    with pytest.raises(ValueError, match="padded alike"):
        reverse_kl(student, teacher[:, :2])


def test_the_folded_rewards_by_hand() -> None:
    # Sample 0: three trainable tokens, reward 1 at the last; sample 1: two, its third masked, reward 0.
    log_probs = torch.tensor([[LN(0.5), LN(0.25), LN(0.5)], [LN(0.5), LN(0.5), LN(0.1)]])
    teacher = torch.tensor([[LN(0.25), LN(0.5), LN(0.5)], [LN(1.0), LN(0.125), LN(0.9)]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = distillation_rewards(torch.tensor([1.0, 0.0]), log_probs, teacher, mask, opd_coef=0.5)
    # KL = (ln 2, −ln 2, 0 | −ln 2, ln 4, ·): r_t = −0.5 KL_t, the scalar reward added at the last trainable token.
    expected = torch.tensor([[-0.5 * LN(2), 0.5 * LN(2), 1.0], [0.5 * LN(2), -LN(2), 0.0]])
    torch.testing.assert_close(rewards, expected)
    # Token rewards that already pay a KL to the reference keep it: the two terms add.
    ref = log_probs - torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # k1 = 1 at token (0, 0)
    with_ref = kl_penalized_rewards(torch.tensor([1.0, 0.0]), log_probs, ref, mask, 0.1)
    both = distillation_rewards(with_ref, log_probs, teacher, mask, opd_coef=0.5)
    torch.testing.assert_close(both, expected - torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="opd_coef"):
        distillation_rewards(torch.tensor([1.0, 0.0]), log_probs, teacher, mask, opd_coef=-1.0)


def _logits(draw: list[float], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(draw, dtype=torch.float64).reshape(shape)


VOCAB = 3
floats = st.floats(-3.0, 3.0, allow_nan=False)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(floats, min_size=VOCAB * (1 + VOCAB), max_size=VOCAB * (1 + VOCAB)),
    st.lists(floats, min_size=VOCAB * (1 + VOCAB), max_size=VOCAB * (1 + VOCAB)),
)
def test_reward_mode_descends_the_whole_responses_reverse_kl(
    student_draw: list[float], teacher_draw: list[float]
) -> None:
    """Two-token responses over a vocabulary of 3, every one enumerated with its probability: the policy
    gradient with the folded rewards' GAE advantages (γ = λ = 1, values 0) is −∇ KL(π ‖ π_T) of the
    responses, the exact gradient of the sequence-level reverse KL."""
    # Student: logits of token 1, and of token 2 given token 1 (rows); the teacher alike, fixed.
    theta = _logits(student_draw, (1 + VOCAB, VOCAB)).requires_grad_()
    teacher_logp = torch.log_softmax(_logits(teacher_draw, (1 + VOCAB, VOCAB)), dim=-1)
    logp = torch.log_softmax(theta, dim=-1)
    sequences = list(itertools.product(range(VOCAB), repeat=2))
    student_lp = torch.stack([torch.stack([logp[0, a], logp[1 + a, b]]) for a, b in sequences])
    teacher_lp = torch.stack(
        [torch.stack([teacher_logp[0, a], teacher_logp[1 + a, b]]) for a, b in sequences]
    )
    weights = student_lp.sum(-1).exp()  # P(y) of each response under the student

    exact_kl = (weights * (student_lp - teacher_lp).sum(-1)).sum()
    (exact_grad,) = torch.autograd.grad(exact_kl, theta, retain_graph=True)

    mask = torch.ones(len(sequences), 2, dtype=torch.float64)
    rewards = distillation_rewards(torch.zeros(len(sequences)), student_lp, teacher_lp, mask, opd_coef=1.0)
    advantages, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    surrogate = (weights.detach()[:, None] * student_lp * advantages.to(torch.float64)).sum()
    (pg_grad,) = torch.autograd.grad(surrogate, theta)
    torch.testing.assert_close(pg_grad, -exact_grad, rtol=1e-6, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.lists(floats, min_size=VOCAB, max_size=VOCAB), st.lists(floats, min_size=VOCAB, max_size=VOCAB))
def test_loss_mode_descends_each_tokens_own_reverse_kl(
    student_draw: list[float], teacher_draw: list[float]
) -> None:
    """One position, every token of the vocabulary weighted by the student's (detached) probability: the
    expected gradient of `distillation_loss` is ∇ KL(π ‖ π_T) at that position."""
    theta = _logits(student_draw, (VOCAB,)).requires_grad_()
    logp = torch.log_softmax(theta, dim=-1)
    teacher = torch.log_softmax(_logits(teacher_draw, (VOCAB,)), dim=-1)
    exact = (logp.exp() * (logp - teacher)).sum()
    (exact_grad,) = torch.autograd.grad(exact, theta, retain_graph=True)
    expected_loss = (logp.exp().detach() * distillation_loss(logp, teacher)).sum()
    (loss_grad,) = torch.autograd.grad(expected_loss, theta)
    torch.testing.assert_close(loss_grad, exact_grad, rtol=1e-6, atol=1e-9)


# --- the worker's uses, pure ----------------------------------------------------------------------


def _config(tmp_path: Path, **overrides: object) -> WorkerConfig:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fields: dict[str, object] = {
        "hf_checkpoint": str(tmp_path),
        "rollout_batch_size": 2,
        "global_batch_size": 2,
        "device": "cpu",
        "params_dtype": "float32",
        "normalize_advantages": False,
    }
    fields.update(overrides)
    return WorkerConfig(**fields)  # type: ignore[arg-type]


# Two samples of two response tokens; sample 1's second token is masked. Teacher log-probs per sample.
TEACHER = [torch.tensor([LN(0.25), LN(0.5)]), torch.tensor([LN(0.5), LN(0.9)])]
OLD = torch.tensor([[LN(0.5), LN(0.25)], [LN(0.25), 0.0]])


def _batch(teacher: list[torch.Tensor] | None = TEACHER) -> RolloutBatch:
    return RolloutBatch(
        tokens=[torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])],
        response_lengths=[2, 2],
        loss_masks=[torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])],
        rewards=torch.tensor([1.0, 0.0]),
        teacher_log_probs=teacher,
    )


def test_reward_signal_folds_the_teacher_beside_the_reference(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    # KL to the teacher (k1) = (ln 2, −ln 2 | −ln 2, ·); to the reference 0.5 at token (0, 0).
    ref = OLD - torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    config = _config(tmp_path, opd_coef=2.0, kl_coef=0.1)
    assert config.kl_first and config.opd_in_rewards
    rewards, figures = reward_signal(_batch(), OLD, ref, config, device=cpu)
    expected = torch.tensor([[-2 * LN(2) - 0.05, 2 * LN(2) + 1.0], [2 * LN(2), 0.0]])
    torch.testing.assert_close(rewards, expected)
    assert figures["reward_kl"].item() == pytest.approx(0.5 / 3)
    # The teacher alone: no reference read, and the KL-first plan still (the critic needs the log-probs).
    alone = _config(tmp_path, opd_coef=2.0)
    assert alone.kl_first and not alone.needs_reference
    rewards, figures = reward_signal(_batch(), OLD, None, alone, device=cpu)
    torch.testing.assert_close(rewards, expected + torch.tensor([[0.05, 0.0], [0.0, 0.0]]))
    assert figures == {}
    # Loss mode leaves the rewards scalar and needs no log-probs; a batch without teacher log-probs is named.
    loss_mode = _config(tmp_path, opd_coef=2.0, opd_mode="loss")
    assert not loss_mode.kl_first
    scalar, _ = reward_signal(_batch(), None, None, loss_mode, device=cpu)
    torch.testing.assert_close(scalar, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"^opd_coef: .*--teacher-hf-checkpoint"):
        reward_signal(_batch(teacher=None), OLD, None, alone, device=cpu)


def test_the_actor_loss_adds_the_distillation_term_and_reports_the_reverse_kl(tmp_path: Path) -> None:
    mb = _batch().with_targets(old_log_probs=OLD, advantages=torch.zeros(2, 2))
    log_probs = OLD.clone().requires_grad_()
    config = _config(tmp_path, opd_coef=2.0, opd_mode="loss")
    loss_sum, count, metrics = actor_loss(config, mb, ResponseOutputs(log_probs=log_probs))
    # Advantages 0: the policy term is 0. ½ KL² per token = (½ ln²2, ½ ln²2 | ½ ln²2); sample_mean sums
    # the samples' token means: ½ ln²2 + ½ ln²2 = ln²2, times opd_coef 2.
    assert count.item() == 2
    assert metrics["opd_loss"].item() == pytest.approx(LN(2) ** 2)
    assert loss_sum.item() == pytest.approx(2 * LN(2) ** 2)
    # The reverse KL's token means per sample, summed: (ln 2 − ln 2) / 2 + (−ln 2) = −ln 2.
    assert metrics["opd_reverse_kl"].item() == pytest.approx(-LN(2))
    # d/d log π of 2 · ½ KL² / 2 tokens = KL: ln 2 at token (0, 0); 0 where masked.
    loss_sum.backward()
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, torch.tensor([[LN(2), -LN(2)], [-2 * LN(2), 0.0]]))
    # Reward mode: the metric, no loss term.
    _, _, reward_metrics = actor_loss(_config(tmp_path, opd_coef=2.0), mb, ResponseOutputs(log_probs=OLD))
    assert "opd_loss" not in reward_metrics and "opd_reverse_kl" in reward_metrics


def test_a_teacher_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="teacher log-probs for 2 response tokens"):
        _batch(teacher=[torch.zeros(3), torch.zeros(2)])
    picked = _batch().select([1])
    assert picked.teacher_log_probs is not None
    torch.testing.assert_close(picked.teacher_log_probs[0], TEACHER[1])
