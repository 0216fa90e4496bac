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

λ may differ per response (a `(batch,)` tensor): VAPO's length-adaptive GAE
(`length_adaptive_lambdas`; Yue et al. 2025, arXiv:2504.05118, "Length-Adaptive GAE") gives each
response `λ = 1 − 1/(α · l)` with `l` its trainable tokens.

Both recursions run without a loop over positions (`_suffix_sums`): each row's trainable
tokens are first gathered to the front in order (`_Steps`), which turns the recursions into
discounted sums over consecutive steps, `x_k + a x_{k+1} + a² x_{k+2} + ...`. A loop over
positions costs a handful of kernel launches per token, which on a GPU is host time that grows
with the response length (the critic computes its returns once per micro-batch when its old
values come from its update's forward, `WorkerConfig.reuse_old_values`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Lambda", "compute_gae", "lambda_returns", "length_adaptive_lambdas", "scalar_at_last_token"]

Lambda = float | torch.Tensor
"""GAE's λ: one for every response, or one per response, shape `(batch,)`."""


@torch.no_grad()
def length_adaptive_lambdas(loss_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's per-response λ, `1 − 1/(α · l)` with `l` the response's trainable tokens, clamped to [0, 1].

    VAPO (arXiv:2504.05118, "Length-Adaptive GAE") argues that with one λ the weight of a reward `l`
    tokens ahead is `λ^l`: a long response barely carries its reward back to its
    first tokens, a short one hardly discounts it; `λ = 1 − 1/(α l)` makes the sum of
    the TD errors' weights, `1 / (1 − λ)`, equal `α l`, proportional to the length
    (α = 0.05 there). Responses shorter than `1/α` tokens would get λ < 0: they get 0.

    Shapes: `loss_mask` `(batch, response_len)`; returns float64 `(batch,)` on its device
    (0 for a row with no trainable token).
    """
    if not alpha > 0:
        raise ValueError(f"length_adaptive_lambdas: `alpha` must be > 0 (VAPO's 0.05), got {alpha}")
    lengths = (loss_mask.detach() != 0).sum(dim=-1).to(torch.float64)
    return (1.0 - 1.0 / (alpha * lengths.clamp(min=1.0))).clamp(0.0, 1.0)


def _checked_lambda(fn: str, lambd: Lambda, batch: int, device: torch.device) -> Lambda:
    """`lambd` checked: a float in [0, 1], or a `(batch,)` tensor of them (as float64 on `device`)."""
    if not isinstance(lambd, torch.Tensor):
        if not 0.0 <= lambd <= 1.0:
            raise ValueError(f"{fn}: `lambd` must be in [0, 1], got {lambd}")
        return lambd
    if lambd.shape != (batch,):
        raise ValueError(
            f"{fn}: a per-response `lambd` must have shape (batch,) = ({batch},), got {tuple(lambd.shape)}"
        )
    lambd = lambd.detach().to(device=device, dtype=torch.float64)
    if bool(((lambd < 0) | (lambd > 1)).any()):
        raise ValueError(
            f"{fn}: every per-response `lambd` must be in [0, 1], got {lambd.min()} .. {lambd.max()}"
        )
    return lambd


def _column(x: Lambda) -> Lambda:
    """A per-response λ (or a term of it) as a column that broadcasts over positions; a float as is."""
    return x[:, None] if isinstance(x, torch.Tensor) else x


@torch.no_grad()
def _checked(
    fn: str, rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lambd: Lambda
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Lambda]:
    """Inputs checked and brought to one dtype and device: (rewards, values, mask, lambd)."""
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
    lambd = _checked_lambda(fn, lambd, values.shape[0], values.device)
    dtype = torch.promote_types(values.dtype, torch.float32)
    values = values.detach().to(dtype)
    rewards = rewards.detach().to(device=values.device, dtype=dtype)
    mask = loss_mask.detach().to(values.device) != 0
    return rewards, values, mask, lambd


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
    lambd: Lambda = 1.0,
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
    rewards, values, mask, lambd = _checked("lambda_returns", rewards, values, loss_mask, gamma, lambd)
    steps = _Steps(mask)
    token_rewards, step_values = steps.gather(_token_rewards(rewards, mask)), steps.gather(values)
    # G_k = c_k + γλ G_{k+1}, with c_k = r_k + γ(1 − λ) V_{k+1}.
    terms = token_rewards + (gamma * _column(1.0 - lambd)) * steps.following(step_values)
    return steps.scatter(_suffix_sums(terms.to(token_rewards.dtype), gamma * lambd))


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lambd: Lambda = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of each trainable response token, for the actor's and the critic's losses.

    Runs under `no_grad` on detached inputs: advantages and returns are targets,
    never differentiated through. Computed in at least float32 (`values`'s dtype
    if wider; the sums themselves in float64), with no loop over positions.

    Args:
        rewards: one scalar reward per response, shape `(batch,)`, added at its last
            trainable token; or one reward per token, shape `(batch, response_len)`,
            used at the trainable tokens (masked positions are ignored).
        values: the critic's value of the state before each response token
            (the old values). Shape `(batch, response_len)`; masked positions are ignored.
        loss_mask: 1 (or True) for trainable tokens, 0 for the rest.
            Shape `(batch, response_len)`. A row with no trainable token gets all zeros.
        gamma: discount γ in [0, 1].
        lambd: GAE λ in [0, 1]; 1 gives Monte-Carlo returns, 0 one-step TD. One for every
            response, or one per response, shape `(batch,)` (`length_adaptive_lambdas`).

    Returns:
        `(advantages, returns)`, each of shape `(batch, response_len)`, 0 at masked positions.
    """
    rewards, values, mask, lambd = _checked("compute_gae", rewards, values, loss_mask, gamma, lambd)
    steps = _Steps(mask)
    token_rewards, step_values = steps.gather(_token_rewards(rewards, mask)), steps.gather(values)
    # δ_k = r_k + γ V_{k+1} − V_k over consecutive steps, A_k = δ_k + γλ A_{k+1}.
    deltas = token_rewards + gamma * steps.following(step_values) - step_values
    advantages = steps.scatter(_suffix_sums(deltas, gamma * lambd))
    # `where`, not multiplication: a NaN/inf value at a masked position must not leak.
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


_BLOCK = 64
"""Positions per block of `_suffix_sums`' blocked form."""


class _Steps:
    """The trainable tokens of each row gathered to its front, in order: the steps of the recursions.

    `gather` moves a `(batch, response_len)` tensor's trainable entries to the front of each row
    and zeroes the rest (whatever they held, NaN included); `scatter` puts step-ordered entries
    back at their tokens, 0 at masked ones. A hole is then no step at all, as the conventions ask.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        # A stable sort of "masked?" keeps the trainable tokens first and in order.
        self.order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
        counts = mask.sum(dim=1, keepdim=True)
        self.live = torch.arange(mask.shape[1], device=mask.device)[None, :] < counts

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.live, x.gather(1, self.order), 0.0)

    def following(self, x: torch.Tensor) -> torch.Tensor:
        """Each step's next step's entry, 0 after the last (`x` from `gather`, 0 past the steps)."""
        return F.pad(x[:, 1:], (0, 1))

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x).scatter(1, self.order, torch.where(self.live, x, 0.0))


def _suffix_sums(terms: torch.Tensor, decay: Lambda) -> torch.Tensor:
    """`out[:, k] = Σ_{j ≥ k} decay^(j − k) · terms[:, j]` along rows, in float64, in `terms`' dtype.

    `decay`: one for every row, or one per row (a `(batch,)` tensor in [0, 1]).
    Blocked, with two matrix products and no loop over positions: within each block of
    `_BLOCK` positions, the block's upper-triangular matrix of powers; across blocks, the sums
    at each block's first position. Every coefficient is a power of `decay` <= 1, so nothing
    overflows or cancels, unlike a cumulative sum of `decay^(−j) · terms_j` would.
    """
    batch, length = terms.shape
    per_row = isinstance(decay, torch.Tensor)
    if length == 0 or (not per_row and decay == 0.0):
        return terms.clone()
    x = terms.to(torch.float64)
    if not per_row and decay == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1).to(terms.dtype)
    block = min(_BLOCK, length)
    blocks = -(-length // block)
    x = F.pad(x, (0, blocks * block - length)).view(batch, blocks, block)
    # One decay per row (shape (batch, 1, 1)), or a single one as a (1, 1, 1) tensor filled on the
    # device (a copy from the host would make the host wait, once per micro-batch of the critic).
    if isinstance(decay, torch.Tensor):
        base = decay.to(device=x.device, dtype=torch.float64)[:, None, None]
    else:
        base = torch.full((1, 1, 1), decay, dtype=torch.float64, device=x.device)

    def powers(size: int, scale: int, shift: int) -> torch.Tensor:
        """`[row, k, j] = decay^(scale · (j − k − shift))` where `j − k >= shift`, else 0."""
        at = torch.arange(size, device=x.device)
        ahead = at[None, :] - at[:, None] - shift
        exponent = (scale * ahead.clamp(min=0)).to(torch.float64)
        return torch.where(ahead >= 0, base.pow(exponent), 0.0)

    def apply(y: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """`out[b, ..., k] = Σ_j y[b, ..., j] · matrix[b or 0, k, j]`."""
        if not per_row:
            return y @ matrix[0].T
        return torch.einsum("b...j,bkj->b...k", y, matrix)

    within = apply(x, powers(block, 1, 0))  # each block's own sums
    # The sum at the first position of the block after each block: decay^(block) per block.
    following = apply(within[..., 0], powers(blocks, block, 1))
    tail = powers(block + 1, 1, 0)[:, 0, 1:].flip(-1)  # decay^(block − k) for k = 0 .. block − 1
    out = within + tail[:, None, :] * following[..., None]
    return out.view(batch, blocks * block)[:, :length].to(terms.dtype)
