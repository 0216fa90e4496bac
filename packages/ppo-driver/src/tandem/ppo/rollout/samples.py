"""Step 1 of a PPO step: prompts -> engine samples -> rewards -> one `RolloutBatch` per data-parallel rank.

Samples of one prompt are consecutive (`n_samples_per_prompt` of them), and a
rollout is cut into contiguous, equal shares per data-parallel rank, so that
sample `i` of the rollout is the same sample for the actor and the critic
(`sample_indices` carries `i`); `train_batches` cuts a rollout into what the train
workers take. The `reward/` metrics are the task reward's.

A round of sampling is `generate_samples` (the engines' `generate` turn), then,
with a reward model, its scores (the `score` turn, `score_requests`), then
`score_rollout` (the rules, and the weighted sum of the terms).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.megatron.batch import RolloutBatch
from tandem.ppo.engines import Generation, SamplingParams
from tandem.ppo.rollout.data import PromptSample
from tandem.ppo.rollout.episodes.trajectory import END_REASONS, Episode
from tandem.ppo.rollout.reward_mix import RewardMix, ScoreRequest
from tandem.ppo.rollout.rewards import RewardFunction, RewardInput, compute_rewards

if TYPE_CHECKING:
    from ray import ObjectRef


class Generator(Protocol):
    """What samples a rollout: the engine group (`EngineGroup.generate`)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]: ...


class ShapingFields(Protocol):
    """The fields of the run's config that shape the rewards the models train on (`training_rewards`)."""

    @property
    def overlong_buffer_len(self) -> int | None: ...

    @property
    def overlong_penalty_factor(self) -> float: ...

    @property
    def rollout_max_response_len(self) -> int: ...


class SamplingFields(ShapingFields, Protocol):
    """The fields of the run's config that say how responses are sampled (`sampling_params`)."""

    @property
    def rollout_ignore_eos(self) -> bool: ...

    @property
    def temperature(self) -> float: ...

    @property
    def eval_temperature(self) -> float: ...

    @property
    def rollout_top_p(self) -> float: ...

    @property
    def rollout_top_k(self) -> int: ...

    @property
    def rollout_stop_token_ids(self) -> tuple[int, ...]: ...


@dataclass
class Rollout:
    """One rollout: its samples in order, their rewards, and what it cost.

    Attributes:
        prompts: the prompt of each sample (a prompt repeated `n_samples_per_prompt` times).
        generations: the engine's response per sample.
        responses: the decoded responses (special tokens skipped), as the reward saw them.
        rewards: one float per sample.
        seconds: `generate` and `reward` wall seconds (and `reward_model` with a reward model).
        reward_terms: with a weighted reward (`tandem.ppo.rollout.reward_mix`), each term's unweighted
            value per sample, by term name; empty for a plain reward function.
        params: what the responses were sampled with (whether a stop token could end them: `truncated`).
        teacher_log_probs: with a distillation teacher, its log-prob of each response token, one
            tensor per sample (`RolloutDrawing.teach`); None without one.
    """

    prompts: list[PromptSample]
    generations: list[Generation]
    responses: list[str]
    rewards: list[float]
    seconds: dict[str, float] = field(default_factory=dict)
    reward_terms: dict[str, list[float]] = field(default_factory=dict)
    params: SamplingParams | None = None
    episodes: list[Episode] | None = None
    teacher_log_probs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.generations)

    def metrics(
        self, *, accuracy_threshold: float, prefix: str = "reward", n_samples_per_prompt: int = 1
    ) -> dict[str, float]:
        """Reward mean, std, accuracy; each reward term's mean; response length; the share of truncated
        responses; with several samples a prompt, `tied_groups`: the share of prompts whose samples all
        got the same reward (no signal for a group baseline, nor for a critic between them)."""
        rewards = torch.tensor(self.rewards, dtype=torch.float64)
        lengths = torch.tensor([len(g.token_ids) for g in self.generations], dtype=torch.float64)
        terms = {
            f"{prefix}/{name}": float(torch.tensor(values, dtype=torch.float64).mean())
            for name, values in self.reward_terms.items()
        }
        metrics = {
            f"{prefix}/mean": float(rewards.mean()),
            f"{prefix}/std": float(rewards.std(unbiased=False)),
            f"{prefix}/accuracy": float((rewards >= accuracy_threshold).double().mean()),
            **terms,
            f"{prefix}/response_length": float(lengths.mean()),
            f"{prefix}/truncated": sum(truncated(g, self.params) for g in self.generations) / len(self),
            **self.episode_metrics("episodes" if prefix == "reward" else f"{prefix}_episodes"),
        }
        if n_samples_per_prompt > 1 and len(self) % n_samples_per_prompt == 0:
            groups = self.groups(n_samples_per_prompt)
            metrics[f"{prefix}/tied_groups"] = sum(not has_signal(g) for g in groups) / len(groups)
        return metrics

    def episode_metrics(self, prefix: str = "episodes") -> dict[str, float]:
        """Of a rollout of episodes: the mean turns, model tokens and cut turns per episode, the share of
        each way to end, failed episodes and tool calls and errors counted; empty otherwise."""
        episodes = self.episodes
        if not episodes:
            return {}
        n = len(episodes)
        metrics = {
            f"{prefix}/turns": sum(e.turns for e in episodes) / n,
            f"{prefix}/model_tokens": sum(sum(e.loss_mask) for e in episodes) / n,
            f"{prefix}/cut_turns": sum(e.cut_turns for e in episodes) / n,
            **{f"{prefix}/end_{end}": sum(e.end == end for e in episodes) / n for end in END_REASONS},
            f"{prefix}/failed": float(sum(e.failed for e in episodes)),
        }
        counts: dict[str, float] = {}
        for episode in episodes:
            for name, value in episode.counts.items():
                counts[name] = counts.get(name, 0.0) + value
        return metrics | dict(sorted(counts.items()))

    def groups(self, n_samples_per_prompt: int) -> list[Rollout]:
        """The rollout cut into its prompts' groups of `n_samples_per_prompt` consecutive samples."""
        return [
            self.select(range(i, i + n_samples_per_prompt)) for i in range(0, len(self), n_samples_per_prompt)
        ]

    def select(self, indices: Sequence[int]) -> Rollout:
        """The samples at `indices`, in that order (seconds are not carried over)."""
        return Rollout(
            prompts=[self.prompts[i] for i in indices],
            generations=[self.generations[i] for i in indices],
            responses=[self.responses[i] for i in indices],
            rewards=[self.rewards[i] for i in indices],
            reward_terms={k: [v[i] for i in indices] for k, v in self.reward_terms.items()},
            params=self.params,
            episodes=None if self.episodes is None else [self.episodes[i] for i in indices],
            teacher_log_probs=None
            if self.teacher_log_probs is None
            else [self.teacher_log_probs[i] for i in indices],
        )

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        """One rollout of `parts` in order; seconds added up."""
        seconds: dict[str, float] = {}
        for part in parts:
            for key, value in part.seconds.items():
                seconds[key] = seconds.get(key, 0.0) + value
        return Rollout(
            prompts=[p for part in parts for p in part.prompts],
            generations=[g for part in parts for g in part.generations],
            responses=[r for part in parts for r in part.responses],
            rewards=[r for part in parts for r in part.rewards],
            seconds=seconds,
            reward_terms={
                k: [v for part in parts for v in part.reward_terms[k]]
                for k in (parts[0].reward_terms if parts else {})
            },
            params=parts[0].params if parts else None,
            episodes=None
            if not parts or parts[0].episodes is None
            else [e for part in parts for e in part.episodes or []],
        )

    def response_tokens(self) -> int:
        """Response tokens sampled in this rollout."""
        return sum(len(g.token_ids) for g in self.generations)


def generate_samples(
    engines: Generator,
    prompts: Sequence[PromptSample],
    *,
    n_samples_per_prompt: int,
    params: SamplingParams,
    tokenizer: Any,
) -> Rollout:
    """Sample `n_samples_per_prompt` responses per prompt on the engine group, decoded with `tokenizer`
    (the policy's, transformers'); not scored yet (`rewards` empty until `score_rollout`)."""
    repeated = [p for p in prompts for _ in range(n_samples_per_prompt)]
    start = time.perf_counter()
    generations = engines.generate([p.prompt_ids for p in repeated], params)
    generated = time.perf_counter()
    responses = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
    return Rollout(
        repeated, generations, responses, rewards=[], seconds={"generate": generated - start}, params=params
    )


def score_requests(rollout: Rollout) -> list[ScoreRequest]:
    """What the reward model is given of each sample, in order (its `score` turn)."""
    return [
        ScoreRequest(p, g.token_ids, r)
        for p, g, r in zip(rollout.prompts, rollout.generations, rollout.responses, strict=True)
    ]


def score_rollout(
    rollout: Rollout, reward_fn: RewardFunction | RewardMix, model_scores: Sequence[float] | None = None
) -> Rollout:
    """`rollout` with its rewards: `reward_fn`, a batched reward function, or a `RewardMix` of weighted
    terms, whose model term is `model_scores` (the reward model's `score` turn) and whose terms the
    rollout keeps in `reward_terms`."""
    inputs = [
        RewardInput(
            prompt=p.prompt_text,
            response=response,
            label=p.record.label,
            metadata=p.record.metadata,
            index=i,
        )
        for i, (p, response) in enumerate(zip(rollout.prompts, rollout.responses, strict=True))
    ]
    start = time.perf_counter()
    if isinstance(reward_fn, RewardMix):
        mixed = reward_fn.compute(inputs, model_scores)
        rewards, terms, seconds = mixed.rewards, mixed.terms, mixed.seconds
    else:
        rewards, terms = compute_rewards(reward_fn, inputs), {}
        seconds = {"reward": time.perf_counter() - start}
    return dataclasses.replace(
        rollout, rewards=rewards, seconds={**rollout.seconds, **seconds}, reward_terms=terms
    )


def generate_rollout(
    engines: Generator,
    prompts: Sequence[PromptSample],
    *,
    n_samples_per_prompt: int,
    params: SamplingParams,
    tokenizer: Any,
    reward_fn: RewardFunction | RewardMix,
) -> Rollout:
    """Sample `n_samples_per_prompt` responses per prompt on the engine group and score them with rules
    alone (`ppo-driver eval`; a run's reward model scores in its own turn: `score_rollout`)."""
    samples = generate_samples(
        engines, prompts, n_samples_per_prompt=n_samples_per_prompt, params=params, tokenizer=tokenizer
    )
    return score_rollout(samples, reward_fn)


def truncated(generation: Generation, params: SamplingParams | None) -> bool:
    """Whether a response was cut by the length limit: it hit the limit (finish reason `length`) where a
    stop token could have ended it. Not where none could: sampling that ignores EOS or stops on no token
    runs every response to the limit by design, and a limit of one token leaves no room for EOS after an
    answer (the demo's one-digit answers). `params` None: any `length` counts."""
    if generation.finish_reason != "length":
        return False
    return params is None or (
        bool(params.stop_token_ids) and not params.ignore_eos and params.max_new_tokens > 1
    )


def has_signal(group: Rollout) -> bool:
    """Whether a prompt's samples got different rewards (all equal: every advantage is the same)."""
    return max(group.rewards) != min(group.rewards)


def dynamic_sample(
    draw: Callable[[int], Rollout],
    *,
    num_prompts: int,
    n_samples_per_prompt: int,
    max_rounds: int,
) -> tuple[Rollout, dict[str, float]]:
    """Draw rounds of `num_prompts` prompts, keeping only prompts whose samples' rewards differ.

    Stops once `num_prompts` such prompts are kept, or after `max_rounds` rounds; a batch
    still short then is filled with dropped prompts (so every step has the same size) and
    the shortfall is counted. Returns the rollout and its counts.
    """
    kept: list[Rollout] = []
    dropped: list[Rollout] = []
    rounds = 0
    parts: list[Rollout] = []
    while len(kept) < num_prompts and rounds < max_rounds:
        rounds += 1
        part = draw(num_prompts)
        parts.append(part)
        for group in part.groups(n_samples_per_prompt):
            (kept if has_signal(group) else dropped).append(group)
    filled = max(0, num_prompts - len(kept))
    chosen = kept[:num_prompts] + dropped[:filled]
    rollout = Rollout.concat(chosen)
    rollout.seconds = Rollout.concat(parts).seconds
    counts = {
        "dynamic/rounds": float(rounds),
        "dynamic/kept_prompts": float(min(len(kept), num_prompts)),
        "dynamic/dropped_prompts": float(len(dropped)),
        "dynamic/filled_prompts": float(filled),
    }
    return rollout, counts


@dataclass
class Sampled:
    """A rollout drawn for step `rollout_id`, ready to train on.

    Attributes:
        data_state: the training data's cursor right after this rollout's prompts (what a
            checkpoint of this step saves, even when the next rollout is already drawn).
        weights_version: the step whose weights generated it (`rollout_id` in the sync loop,
            `rollout_id - 1` in the async one: its staleness).
        background: generated on the async loop's thread, while another step ran.
    """

    rollout_id: int
    rollout: Rollout
    data_refs: dict[str, list[ObjectRef[RolloutBatch]]]
    sample_indices: dict[str, list[list[int]]]
    data_state: dict[str, Any]
    weights_version: int
    counts: dict[str, float]
    seconds: dict[str, float]
    background: bool = False


def sampling_params(
    config: SamplingFields, *, eos_token_id: int | None, seed: int, eval_mode: bool = False
) -> SamplingParams:
    """The engines' sampling parameters for a training rollout, or for an eval (`eval_mode`)."""
    ignore_eos = config.rollout_ignore_eos and not eval_mode
    # With ignore_eos the responses run to their full length: EOS is then an ordinary token.
    eos = (eos_token_id,) if eos_token_id is not None and not ignore_eos else ()
    return SamplingParams(
        max_new_tokens=config.rollout_max_response_len,
        temperature=config.eval_temperature if eval_mode else config.temperature,
        top_p=1.0 if eval_mode else config.rollout_top_p,
        top_k=-1 if eval_mode else config.rollout_top_k,
        stop_token_ids=tuple(config.rollout_stop_token_ids) + eos,
        ignore_eos=ignore_eos,
        seed=seed,
    )
