"""On-policy distillation: the student's per-token reverse KL to a teacher, on the student's own samples.

A teacher scores the responses the student sampled, and each trainable token `t`
of a response `y ~ π` gets

    KL_t = log π(y_t | y_<t) − log π_T(y_t | y_<t)

(`reverse_kl`, the k1 estimator of `kl.py` with the teacher as the reference),
both under the sampling temperature. Its sum over a response is an unbiased
estimate of the sequence-level reverse KL `KL(π ‖ π_T)`, which is mode-seeking: the
student is pushed off what the teacher finds unlikely rather than spread over all
the teacher would say (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", arXiv:2306.13649; Lu and Thinking
Machines Lab 2025, "On-Policy Distillation"). It trains the student in one of two
ways (`WorkerConfig.opd_mode`):

- `reward` (`distillation_rewards`): `−opd_coef · KL_t` is each trainable token's
  reward, added to the token rewards the estimator folds into returns (GAE,
  REINFORCE++). With γ = 1 a token's advantage then holds the reverse KL of every
  token after it, the policy gradient of the whole response's reverse KL
  (`∇ E[Σ_t KL_t] = E[Σ_t ∇log π(y_t) · Σ_{s≥t} KL_s]`): a token that leads the
  student to where it strays from the teacher pays for it. slime subtracts the
  same term from the advantages after its estimator, without the return.
- `loss` (`distillation_loss`): `opd_coef · ½ (log π(y_t) − log π_T(y_t))²` per
  token in the policy loss. Its gradient `(log π(y_t) − log π_T(y_t)) ∇log π(y_t)`
  is, for tokens sampled from π, an unbiased gradient of each token's own reverse
  KL `KL(π(·|y_<t) ‖ π_T(·|y_<t))` (the `k2` estimator's, as `kl.py`'s `+` kinds
  take it): the per-token objective, with no credit to the tokens before.

Both are computed from log-probs of the sampled tokens only, the teacher's over
its own vocabulary (which may be larger than the student's, as Qwen2.5-7B's is
than 0.5B's: the same tokenizer, more padding rows).
"""

from __future__ import annotations

import math

import torch

from tandem.megatron.algorithms.gae import scalar_at_last_token

__all__ = ["distillation_loss", "distillation_rewards", "reverse_kl"]


def reverse_kl(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token reverse KL estimate `log π(y_t) − log π_T(y_t)` on the sampled tokens (k1; can be negative).

    Shapes: both `(batch, response_len)` (any shape, the same); returns the same shape.
    Gradients flow into `log_probs` as autograd allows; the teacher's should be detached.
    """
    if log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"reverse_kl: `teacher_log_probs` has shape {tuple(teacher_log_probs.shape)} but `log_probs` has "
            f"{tuple(log_probs.shape)}; both must be padded alike"
        )
    return log_probs - teacher_log_probs


@torch.no_grad()
def distillation_rewards(
    rewards: torch.Tensor,
    log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    opd_coef: float,
) -> torch.Tensor:
    """Token rewards with the reverse KL to the teacher folded in: `r_t − opd_coef · KL_t` at trainable tokens.

    Args:
        rewards: scalar rewards, shape `(batch,)` (each placed at its response's last trainable
            token, as `gae.scalar_at_last_token` does), or token rewards `(batch, response_len)`
            (e.g. `kl.kl_penalized_rewards`' already).
        log_probs: the student's old log-probs of the sampled tokens. Shape `(batch, response_len)`.
        teacher_log_probs: the teacher's log-probs of the same tokens. Same shape.
        loss_mask: 1 (or True) for trainable tokens. Same shape.
        opd_coef: the weight (finite, ≥ 0).

    Returns:
        Token rewards, shape `(batch, response_len)`, in at least float32, 0 at masked positions.
    """
    if not (math.isfinite(opd_coef) and opd_coef >= 0):
        raise ValueError(f"distillation_rewards: `opd_coef` must be a finite number >= 0, got {opd_coef}")
    if loss_mask.shape != log_probs.shape:
        raise ValueError(
            f"distillation_rewards: `loss_mask` has shape {tuple(loss_mask.shape)} but `log_probs` has "
            f"{tuple(log_probs.shape)}; pad both to (batch, response_len)"
        )
    if rewards.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(
            f"distillation_rewards: `rewards` must have shape (batch,) or (batch, response_len) = "
            f"{tuple(log_probs.shape)}, got {tuple(rewards.shape)}"
        )
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    mask = loss_mask.detach().to(log_probs.device) != 0
    rewards = rewards.detach().to(device=log_probs.device, dtype=dtype)
    token_rewards = scalar_at_last_token(rewards, mask) if rewards.dim() == 1 else rewards
    kl = reverse_kl(
        log_probs.detach().to(dtype), teacher_log_probs.detach().to(device=log_probs.device, dtype=dtype)
    )
    return torch.where(mask, token_rewards - opd_coef * kl, 0.0)


def distillation_loss(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token distillation loss `½ (log π(y_t) − log π_T(y_t))²` (not masked, not aggregated, not weighted).

    Its gradient with respect to `log π(y_t)` is `KL_t` (`reverse_kl`), so that on the
    student's own samples it descends each token's reverse KL to the teacher (see the
    module docstring). Shapes: both `(batch, response_len)`; returns the same shape.
    """
    return 0.5 * reverse_kl(log_probs, teacher_log_probs.detach()).square()
