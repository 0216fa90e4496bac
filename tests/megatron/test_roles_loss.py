"""The actor's loss with truncated importance sampling, and its metrics, by hand (no Megatron:
`role_losses.actor_loss` is pure)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tandem.megatron import RolloutBatch, WorkerConfig
from tandem.megatron.worker.response_outputs import ResponseOutputs
from tandem.megatron.worker.role_losses import actor_loss


def _config(tmp_path: Path, **overrides: object) -> WorkerConfig:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fields: dict[str, object] = {
        "hf_checkpoint": str(tmp_path),
        "rollout_batch_size": 2,
        "global_batch_size": 2,
        "device": "cpu",
        "params_dtype": "float32",
        "eps_clip": 0.2,
    }
    fields.update(overrides)
    return WorkerConfig(**fields)  # type: ignore[arg-type]


def _micro_batch(rollout_log_probs: list[torch.Tensor] | None) -> RolloutBatch:
    # Two samples of 2 response tokens; sample 1's last token is masked out.
    batch = RolloutBatch(
        tokens=[torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])],
        response_lengths=[2, 2],
        loss_masks=[torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])],
        rewards=torch.zeros(2),
        rollout_log_probs=rollout_log_probs,
    )
    return batch.with_targets(
        old_log_probs=torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.5), math.log(0.5)]]),
        advantages=torch.tensor([[1.0, -2.0], [3.0, 0.0]]),
    )


def test_tis_multiplies_each_tokens_policy_loss_by_its_truncated_weight(tmp_path: Path) -> None:
    # The new log-probs equal the old ones: ratio 1, no clipping, per-token loss −A = (−1, 2 | −3, ·).
    # Engine log-probs: ln 0.5 (weight 1), ln 0.2 (weight 2.5 → cap 2) | ln 1.0 (weight 0.5).
    rollout = [torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([1.0, 0.3]))]
    mb = _micro_batch(rollout)
    assert mb.old_log_probs is not None
    log_probs = mb.old_log_probs.clone().requires_grad_()
    outputs = ResponseOutputs(log_probs=log_probs)

    plain_sum, plain_count, plain_metrics = actor_loss(_config(tmp_path), mb, outputs)
    loss_sum, count, metrics = actor_loss(_config(tmp_path, use_tis=True, tis_cap=2.0), mb, outputs)

    # sample_mean: sample 0 (−1·1 + 2·2) / 2 = 1.5, sample 1: −3·0.5 = −1.5; the sum over samples 0.
    # Without TIS: (−1 + 2) / 2 + (−3) = −2.5.
    assert plain_sum.item() == pytest.approx(-2.5)
    assert loss_sum.item() == pytest.approx(0.0, abs=1e-6)
    assert count.item() == plain_count.item() == 2
    # Mean weight per sample, then summed: (1 + 2) / 2 + 0.5 = 2 (numerator over 2 samples: mean 1).
    assert metrics["tis_weight"].item() == pytest.approx(2.0)
    assert "tis_weight" not in plain_metrics
    # The weights are detached: the gradient of token (0, 1) is 2 (weight) · 2 (−A) · ratio / 2 tokens.
    loss_sum.backward()
    assert log_probs.grad is not None
    assert log_probs.grad[0, 1].item() == pytest.approx(2.0 * 2.0 / 2)


def test_tis_without_rollout_log_probs_names_the_flag(tmp_path: Path) -> None:
    mb = _micro_batch(None)
    assert mb.old_log_probs is not None
    with pytest.raises(ValueError, match="use_tis"):
        actor_loss(_config(tmp_path, use_tis=True), mb, ResponseOutputs(log_probs=mb.old_log_probs.clone()))


def test_the_sampler_log_prob_gap_is_the_mean_distance_over_trainable_tokens(tmp_path: Path) -> None:
    # Old log-probs ln 0.5 everywhere; the engine's ln 0.5, ln 0.2 | ln 1.0, (masked).
    rollout = [torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([1.0, 0.3]))]
    mb = _micro_batch(rollout)
    assert mb.old_log_probs is not None
    _, count, metrics = actor_loss(_config(tmp_path), mb, ResponseOutputs(log_probs=mb.old_log_probs.clone()))
    # sample_mean numerator: sample 0 (0 + ln 2.5) / 2, sample 1 |ln 0.5| / 1; divided by 2 samples.
    expected = (math.log(2.5) / 2 + math.log(2.0)) / 2
    assert (metrics["sampler_log_prob_gap"] / count).item() == pytest.approx(expected)
    _, _, without = actor_loss(
        _config(tmp_path), _micro_batch(None), ResponseOutputs(log_probs=mb.old_log_probs)
    )
    assert "sampler_log_prob_gap" not in without


def test_gspo_loss_type_clips_each_sequence_as_a_whole(tmp_path: Path) -> None:
    # Sample 0: tokens' ratios 1.5 and 0.5 (log-ratios ±ln: mean (ln 1.5 + ln 0.5) / 2 = ln √0.75);
    # sample 1: its one trainable token's ratio 2 (its masked token's 100 must not count).
    mb = _micro_batch(None)
    assert mb.old_log_probs is not None
    shift = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(2.0), math.log(100.0)]])
    log_probs = (mb.old_log_probs + shift).requires_grad_()
    outputs = ResponseOutputs(log_probs=log_probs)
    config = _config(tmp_path, loss_type="gspo", eps_clip=0.2, eps_clip_high=0.3)
    loss_sum, count, metrics = actor_loss(config, mb, outputs)
    s0 = math.sqrt(0.75)  # sample 1: s1 = 2
    # Sample 0: s0 = 0.866 is inside [0.8, 1.3]: per-token −A·s0 = (−0.866, 1.732), mean 0.433.
    # Sample 1: s1 = 2 > 1.3 with A = 3 > 0: clipped to −3·1.3 = −3.9, no gradient.
    assert loss_sum.item() == pytest.approx((-1.0 * s0 + 2.0 * s0) / 2 + (-3.0 * 1.3))
    assert count.item() == 2
    assert metrics["clip_frac"].item() == pytest.approx(0.0 + 1.0)  # sample means, summed
    loss_sum.backward()
    assert log_probs.grad is not None
    # GSPO-token: token t's gradient is −A_t · s_i / |y_i| (sample_mean), whatever its own ratio.
    expected = torch.tensor([[-1.0 * s0 / 2, 2.0 * s0 / 2], [0.0, 0.0]])
    torch.testing.assert_close(log_probs.grad, expected)


def test_cispo_loss_type_keeps_the_gradient_of_clipped_tokens(tmp_path: Path) -> None:
    # Ratios: sample 0 (1.5, 1.0), sample 1 (0.5 | masked). Weights clip(r, 0.8, 1.2) = (1.2, 1.0 | 0.8).
    # Advantages (1, −2 | 3): per-token loss −w·A·log π with log π = log r + ln 0.5.
    mb = _micro_batch(None)
    assert mb.old_log_probs is not None
    shift = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 0.0]])
    log_probs = (mb.old_log_probs + shift).requires_grad_()
    loss_sum, count, metrics = actor_loss(
        _config(tmp_path, loss_type="cispo"), mb, ResponseOutputs(log_probs=log_probs)
    )
    lp = log_probs.detach()
    expected = (-1.2 * 1.0 * lp[0, 0] + -1.0 * -2.0 * lp[0, 1]) / 2 + (-0.8 * 3.0 * lp[1, 0])
    assert loss_sum.item() == pytest.approx(expected.item())
    assert count.item() == 2
    # Clipped weights: token (0, 0) and (1, 0); sample means 0.5 and 1, summed.
    assert metrics["clip_frac"].item() == pytest.approx(1.5)
    loss_sum.backward()
    assert log_probs.grad is not None
    # −w·A / |y_i|: (−0.6, 1.0 | −2.4); PPO's clip would give token (0, 0) none.
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.6, 1.0], [-2.4, 0.0]]))


def test_seq_mask_tis_and_a_token_sum_loss(tmp_path: Path) -> None:
    # Ratio 1, per-token loss −A = (−1, 2 | −3, ·). Engine log-probs: sample 0 (ln 0.5, ln 0.2): token weights
    # (1, 2.5 → cap 2), geometric mean ratio √(1 · 2.5) = 1.58 ≤ 2: kept. Sample 1 (ln 0.125): ratio 4 > 2:
    # left out whole. seq_mean_token_sum: sample 0's token sum (−1·1 + 2·2) = 3, sample 1's 0; over 2 samples.
    rollout = [torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.125, 0.3]))]
    mb = _micro_batch(rollout)
    assert mb.old_log_probs is not None
    config = _config(
        tmp_path, use_tis=True, tis_cap=2.0, tis_mode="seq_mask", loss_aggregation="seq_mean_token_sum"
    )
    loss_sum, count, metrics = actor_loss(config, mb, ResponseOutputs(log_probs=mb.old_log_probs.clone()))
    assert loss_sum.item() == pytest.approx(3.0)
    assert count.item() == 2
    # Metrics stay token means per sample: weights (1 + 2) / 2 + 0 = 1.5; masked fraction 0 + 1 = 1.
    assert metrics["tis_weight"].item() == pytest.approx(1.5)
    assert metrics["tis_masked_frac"].item() == pytest.approx(1.0)
