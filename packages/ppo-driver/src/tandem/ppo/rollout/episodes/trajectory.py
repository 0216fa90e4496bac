"""An episode's tokens as they train: the first prompt, then model turns (trained) and context (not).

`Trajectory` is how an episode is built, by the built-in loop (`runner`), a custom
generate function (`--custom-generate-function-path`) or the chat endpoint
(`endpoint`): the model's tokens are appended as the engine sampled them, with their
log-probs and loss mask 1; the environment's and the tools' tokens as context, loss
mask 0 and log-prob 0; a reward is attached to the last model token so far. Nothing
is re-tokenized: what trains is what the engine saw and sampled. `Episode` is the
finished record that the rollout turns into a training sample: its prompt is the
first prompt, its response everything after it (docs/design.md, "Episodes").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.ppo.engines import FinishReason, Generation

__all__ = ["END_REASONS", "EndReason", "Episode", "Trajectory"]

EndReason = Literal["done", "max_turns", "episode_tokens", "context", "failed"]
END_REASONS: tuple[EndReason, ...] = ("done", "max_turns", "episode_tokens", "context", "failed")
"""Why an episode ended: the environment said done; `--max-turns` model turns; `--max-episode-tokens`;
the engine's context; the environment (or the custom generate function) failed."""


@dataclass
class Episode:
    """One finished episode, ready to train on.

    Attributes:
        prompt_ids: the first prompt's tokens (the first observation through the chat template).
        prompt_text: the first prompt as text.
        token_ids: every token after the first prompt: the model's turns and the context between them.
        log_probs: the sampler's log-prob of each model token; 0 at context tokens.
        loss_mask: 1 at the model's tokens, 0 at context tokens (and everywhere in a failed episode).
        rewards: (position in `token_ids`, reward) for each reward the episode got, at the last model
            token before it was given.
        end: why it ended (`END_REASONS`).
        turns: the model's turns.
        cut_turns: model turns cut at a token budget.
        counts: what happened on the way, summed into the rollout's metrics (tool calls and errors by kind).
        failure: what failed (the exception and its traceback), for a failed episode.
        transcript: the episode as chat messages, for its log.
    """

    prompt_ids: list[int]
    prompt_text: str
    token_ids: list[int]
    log_probs: list[float]
    loss_mask: list[int]
    rewards: list[tuple[int, float]] = field(default_factory=list)
    end: EndReason = "done"
    turns: int = 0
    cut_turns: int = 0
    counts: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    transcript: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its rewards."""
        return float(sum(r for _, r in self.rewards))

    @property
    def truncated(self) -> bool:
        """Ended by a budget (turns, tokens, context) before the environment said done."""
        return self.end in ("max_turns", "episode_tokens", "context")

    @property
    def failed(self) -> bool:
        return self.end == "failed"

    @property
    def finish_reason(self) -> FinishReason:
        """As a response's: `length` when truncated, `abort` when failed, else `stop`."""
        return "length" if self.truncated else "abort" if self.failed else "stop"

    def step_rewards(self) -> list[float]:
        """One reward per token of `token_ids`: each reward at its position, 0 elsewhere."""
        out = [0.0] * len(self.token_ids)
        for position, reward in self.rewards:
            out[position] += reward
        return out

    def as_generation(self) -> Generation:
        """The episode after its first prompt, as the one response a single-turn rollout would hold."""
        return Generation(list(self.token_ids), list(self.log_probs), self.finish_reason)


class Trajectory:
    """An episode under construction: the first prompt, then model tokens and context tokens in order."""

    def __init__(self, prompt_ids: Sequence[int], prompt_text: str = "") -> None:
        if not prompt_ids:
            raise ValueError("Trajectory: the first prompt has no tokens; an episode starts from a prompt")
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.prompt_text = prompt_text
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.loss_mask: list[int] = []
        self.rewards: list[tuple[int, float]] = []
        self.turns = 0
        self.cut_turns = 0
        self.counts: dict[str, float] = {}
        self.transcript: list[dict[str, Any]] = []

    def __len__(self) -> int:
        """Tokens after the first prompt."""
        return len(self.token_ids)

    @property
    def context_ids(self) -> list[int]:
        """Everything so far, first prompt included: what the engine continues from."""
        return self.prompt_ids + self.token_ids

    def add_model(self, generation: Generation) -> None:
        """One model turn as the engine sampled it: trained (loss mask 1), with its log-probs."""
        if len(generation.log_probs) != len(generation.token_ids):
            raise ValueError(
                f"Trajectory.add_model: {len(generation.token_ids)} tokens but {len(generation.log_probs)} "
                "log-probs; give the engine's Generation as it came"
            )
        self.token_ids.extend(int(t) for t in generation.token_ids)
        self.log_probs.extend(float(p) for p in generation.log_probs)
        self.loss_mask.extend([1] * len(generation.token_ids))
        self.turns += 1
        self.cut_turns += generation.finish_reason == "length"

    def add_context(self, token_ids: Sequence[int]) -> None:
        """Tokens the model did not sample (an observation, a tool result, the template between turns)."""
        self.token_ids.extend(int(t) for t in token_ids)
        self.log_probs.extend([0.0] * len(token_ids))
        self.loss_mask.extend([0] * len(token_ids))

    def add_reward(self, reward: float) -> None:
        """`reward` for what the model did so far: it lands on the last model token (a reward of 0 adds
        nothing; a nonzero one before the model's first token is refused: it would reach no token)."""
        if reward == 0:
            return
        trained = [i for i, m in enumerate(self.loss_mask) if m]
        if not trained:
            raise ValueError(
                "Trajectory.add_reward: a reward before the model's first token reaches no token"
            )
        self.rewards.append((trained[-1], float(reward)))

    def count(self, name: str, by: float = 1.0) -> None:
        """Add `by` to the episode's count `name` (a metric of the rollout, summed over episodes)."""
        self.counts[name] = self.counts.get(name, 0.0) + by

    def finish(self, end: EndReason = "done") -> Episode:
        """The finished episode; a trajectory without a model token (or a failed one) trains nothing."""
        token_ids, log_probs, loss_mask = list(self.token_ids), list(self.log_probs), list(self.loss_mask)
        if not token_ids:
            # A training sample needs one token after its prompt; this one is context, never trained.
            token_ids, log_probs, loss_mask = [self.prompt_ids[-1]], [0.0], [0]
        if end == "failed":
            loss_mask = [0] * len(token_ids)
        return Episode(
            prompt_ids=list(self.prompt_ids),
            prompt_text=self.prompt_text,
            token_ids=token_ids,
            log_probs=log_probs,
            loss_mask=loss_mask,
            rewards=[] if end == "failed" else list(self.rewards),
            end=end,
            turns=self.turns,
            cut_turns=self.cut_turns,
            counts=dict(self.counts),
            transcript=list(self.transcript),
        )
