"""Generalised advantage estimation over the trainable tokens of padded responses.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", eq. 16) with the conventions of docs/design.md
("PPO math conventions"):

- Only trainable tokens (`loss_mask != 0`) are steps. A masked token between two
  trainable ones (e.g. a tool output inside a multi-turn response) is skipped:
  the trainable token before it bootstraps from the value of the trainable
  token after it, and no discount is applied for the hole.
- The scalar reward of a response is the reward of its last trainable token;
  every other step has reward 0. Token-level rewards, shape `(batch,
  response_len)` (e.g. the scalar reward at the last trainable token plus a
  per-token KL penalty, `kl.kl_penalized_rewards`), are taken as they are at
  trainable tokens; at masked tokens they are ignored (a hole is not a step).
- The value after the last trainable token is 0, also for truncated responses.
- `δ_t = r_t + γ V_{t+1} − V_t`, `A_t = δ_t + γ λ A_{t+1}` (t, t+1 are
  consecutive trainable tokens), `returns = A + V`.
- Masked positions of both outputs are 0, whatever `values` holds there.
"""

from __future__ import annotations

import torch

__all__ = ["compute_gae", "lambda_returns", "scalar_at_last_token"]


@torch.no_grad()
def _checked(
    fn: str, rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs checked and brought to one dtype and device: (rewards, values, mask)."""
    if values.dim() != 2:
        raise ValueError(f"{fn}: `values` must have shape (batch, response_len), got {tuple(values.shape)}")
    if loss_mask.shape != values.shape:
        raise ValueError(
            f"{fn}: `loss_mask` has shape {tuple(loss_mask.shape)} but `values` has "
            f"{tuple(values.shape)}; pad both to (batch, response_len)"
        )
    if rewards.shape not in (values.shape[:1], values.shape):
        raise ValueError(
            f"{fn}: `rewards` must have shape (batch,) = {tuple(values.shape[:1])} (one scalar reward "
            f"per response) or (batch, response_len) = {tuple(values.shape)} (one reward per token), "
            f"got {tuple(rewards.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{fn}: `gamma` must be in [0, 1], got {gamma}")
    if not 0.0 <= lambd <= 1.0:
        raise ValueError(f"{fn}: `lambd` must be in [0, 1], got {lambd}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    values = values.detach().to(dtype)
    rewards = rewards.detach().to(device=values.device, dtype=dtype)
    mask = loss_mask.detach().to(values.device) != 0
    return rewards, values, mask


def scalar_at_last_token(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards of scalar rewards: each response's reward at its last trainable token, 0 elsewhere.

    Shapes: `rewards` `(batch,)`, `loss_mask` `(batch, response_len)`; returns
    `(batch, response_len)` in `rewards`' dtype, on `loss_mask`'s device. A row with
    no trainable token is all 0.
    """
    mask = loss_mask.detach() != 0
    rewards = rewards.detach().to(mask.device)
    # The last trainable token is the trainable token with no trainable token after it.
    trainable_at_or_after = mask.flip(-1).cumsum(-1).flip(-1)
    is_last = mask & (trainable_at_or_after == 1)
    return torch.where(is_last, rewards[:, None], torch.zeros((), dtype=rewards.dtype, device=rewards.device))


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards: scalar rewards placed at the last trainable token, or token rewards as given."""
    if rewards.dim() == 2:
        return rewards
    return scalar_at_last_token(rewards, mask)


@torch.no_grad()
def lambda_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> torch.Tensor:
    """The critic's targets alone: `compute_gae`'s returns, without computing advantages.

    The λ-return recursion (Sutton & Barto, 2nd ed., eq. 12.18 in recursive form):
    `G_t = r_t + γ((1 − λ) V_{t+1} + λ G_{t+1})`, with `V` and `G` after the last
    trainable token 0 and masked tokens skipped as in `compute_gae`. It equals
    `A_t + V_t` of GAE term by term (`A_t + V_t = r_t + γ V_{t+1} + γλ A_{t+1}`
    and `A_{t+1} = G_{t+1} − V_{t+1}`).

    Args and shapes as `compute_gae`. Returns the returns, shape `(batch, response_len)`,
    0 at masked positions.
    """
    rewards, values, mask = _checked("lambda_returns", rewards, values, loss_mask, gamma, lambd)
    token_rewards = _token_rewards(rewards, mask)
    returns = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_return = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        trainable = mask[:, t]
        g = token_rewards[:, t] + gamma * ((1.0 - lambd) * next_value + lambd * next_return)
        returns[:, t] = torch.where(trainable, g, 0.0)
        next_value = torch.where(trainable, values[:, t], next_value)
        next_return = torch.where(trainable, g, next_return)
    return returns


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of each trainable response token, for the actor's and the critic's losses.

    Runs under `no_grad` on detached inputs: advantages and returns are targets,
    never differentiated through. Computed in at least float32 (`values`'s dtype
    if wider). The loop runs over time steps only (vectorised over the batch).

    Args:
        rewards: one scalar reward per response, shape `(batch,)`, added at its last
            trainable token; or one reward per token, shape `(batch, response_len)`,
            used at the trainable tokens (masked positions are ignored).
        values: the critic's value of the state before each response token
            (the old values). Shape `(batch, response_len)`; masked positions are ignored.
        loss_mask: 1 (or True) for trainable tokens, 0 for the rest.
            Shape `(batch, response_len)`. A row with no trainable token gets all zeros.
        gamma: discount γ in [0, 1].
        lambd: GAE λ in [0, 1]; 1 gives Monte-Carlo returns, 0 one-step TD.

    Returns:
        `(advantages, returns)`, each of shape `(batch, response_len)`, 0 at masked positions.
    """
    rewards, values, mask = _checked("compute_gae", rewards, values, loss_mask, gamma, lambd)
    batch, response_len = values.shape
    token_rewards = _token_rewards(rewards, mask)

    advantages = torch.zeros_like(values)
    # Carried across masked tokens unchanged, so a hole is not a step.
    next_value = values.new_zeros(batch)
    next_advantage = values.new_zeros(batch)
    for t in reversed(range(response_len)):
        trainable = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        # `where`, not multiplication: a NaN/inf value at a masked position must not leak.
        advantages[:, t] = torch.where(trainable, advantage, 0.0)
        next_value = torch.where(trainable, values[:, t], next_value)
        next_advantage = torch.where(trainable, advantage, next_advantage)

    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns
