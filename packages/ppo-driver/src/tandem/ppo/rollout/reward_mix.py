"""The run's reward as a weighted sum of named terms: a reward model's score and rule-based rewards.

`--reward-weights model=1.0,exact_match=0.5` makes each sample's reward
`1.0 * score + 0.5 * exact_match`, where `score` is the reward model's output for
prompt + response (`--rm-type model --reward-model PATH`) and `exact_match` the
built-in rule. The terms a run may name:

| term          | what it is                                                    |
|---------------|---------------------------------------------------------------|
| `model`       | the reward model of `--reward-model` (needs `--rm-type model`) |
| `exact_match` | the built-in rule: the response equals the label              |
| `math`        | the built-in rule: the final answer equals the label (math-verify) |
| `custom`      | the function of `--custom-rm-path`                            |

Without `--reward-weights` the run has one term of weight 1: `custom` when
`--custom-rm-path` is set, else `--rm-type`'s. Each term's unweighted mean is a
metric (`reward/<term>`) whenever a run has more than one term or a reward model,
next to `reward/mean`, the mean of the weighted sum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.ppo.rollout.rewards import RewardFunction, RewardInput, compute_rewards, load_reward

if TYPE_CHECKING:
    from tandem.ppo.rollout.data import PromptSample

MODEL_TERM = "model"
"""The term of the reward model's score."""

CUSTOM_TERM = "custom"
"""The term of the function of `--custom-rm-path`."""

RULE_TERMS = ("exact_match", "math")
"""Built-in rule rewards a term may name."""

TERMS = (MODEL_TERM, *RULE_TERMS, CUSTOM_TERM)
"""Every name `--reward-weights` accepts."""


@dataclass(frozen=True)
class ScoreRequest:
    """What the reward model is given of one sample: its prompt and the engine's response."""

    prompt: PromptSample
    """The prompt as the engine saw it (its record, token ids and text)."""
    response_ids: Sequence[int]
    """The response's token ids, as sampled (a final EOS included)."""
    response: str
    """The response decoded without special tokens (what the rule rewards see)."""


def parse_reward_weights(text: str) -> dict[str, float]:
    """`"model=1.0,exact_match=0.5"` -> `{"model": 1.0, "exact_match": 0.5}`, in the order written.

    Raises ValueError naming `--reward-weights` for an unknown term, a term named twice,
    a weight that is not a finite number, or all weights zero.
    """
    weights: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not name:
            raise ValueError(
                f"--reward-weights: {item!r} is not NAME=WEIGHT; write e.g. model=1.0,exact_match=0.5"
            )
        if name not in TERMS:
            raise ValueError(f"--reward-weights: unknown term {name!r}; choose among {', '.join(TERMS)}")
        if name in weights:
            raise ValueError(f"--reward-weights: the term {name!r} is given twice; give each term once")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--reward-weights: the weight of {name!r} is {value!r}, not a number") from None
        if not math.isfinite(weight):
            raise ValueError(f"--reward-weights: the weight of {name!r} is {weight}; give a finite number")
        weights[name] = weight
    if not weights:
        raise ValueError(
            "--reward-weights: no terms; write e.g. model=1.0,exact_match=0.5, or leave it unset"
        )
    if all(w == 0 for w in weights.values()):
        raise ValueError("--reward-weights: every weight is 0, so every reward would be 0; give one a weight")
    return weights


@dataclass
class MixedRewards:
    """The rewards of a batch of samples, the unweighted value of each term, and what the rule terms took."""

    rewards: list[float]
    terms: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """`reward`: the rule terms (the model term is the reward model's `score` turn, timed there)."""


@dataclass(frozen=True)
class RewardMix:
    """A weighted sum of reward terms, each one float per sample: the run's reward function.

    The `model` term's values are the reward model's scores, which the driver's `score`
    turn computes (the reward model wakes, scores and sleeps on the GPUs); `compute` is
    given them, and runs the rule terms itself.

    Args:
        weights: term name -> weight (`parse_reward_weights`), in the order terms are combined.
        rules: the rule terms' batched reward functions, by term name.
    """

    weights: Mapping[str, float]
    rules: Mapping[str, RewardFunction] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.weights:
            if name != MODEL_TERM and name not in self.rules:
                raise ValueError(f"RewardMix: the term {name!r} has no reward function in `rules`")

    @property
    def has_model(self) -> bool:
        """Whether the reward model's score is a term (the step then has a `score` turn)."""
        return MODEL_TERM in self.weights

    def compute(
        self, inputs: Sequence[RewardInput], model_scores: Sequence[float] | None = None
    ) -> MixedRewards:
        """Every term for every sample, then `sum(weight * term)` per sample (in float64).

        `inputs` feed the rule terms (through `compute_rewards`, which names a failing
        sample); `model_scores`, the reward model's score of each sample, are the model
        term (needed when it is one); both in the rollout's sample order.
        """
        terms: dict[str, list[float]] = {}
        seconds = {"reward": 0.0}
        for name in self.weights:
            if name == MODEL_TERM:
                if model_scores is None:
                    raise ValueError(
                        "RewardMix: the `model` term needs the reward model's scores; pass model_scores"
                    )
                scores = [float(s) for s in model_scores]
                if len(scores) != len(inputs) or not all(math.isfinite(s) for s in scores):
                    raise RuntimeError(
                        f"the reward model returned {len(scores)} scores for {len(inputs)} samples, or a "
                        "score that is not finite"
                    )
                terms[name] = scores
            else:
                start = time.perf_counter()
                terms[name] = compute_rewards(self.rules[name], inputs)
                seconds["reward"] += time.perf_counter() - start
        rewards = combine(self.weights, terms, len(inputs))
        return MixedRewards(rewards, terms, seconds)


def combine(weights: Mapping[str, float], terms: Mapping[str, Sequence[float]], n: int) -> list[float]:
    """Per sample, `sum(weights[t] * terms[t][i])` over the terms (float64, in `weights`' order)."""
    totals = [0.0] * n
    for name, weight in weights.items():
        values = terms[name]
        if len(values) != n:
            raise ValueError(f"the term {name!r} has {len(values)} values for {n} samples")
        for i, value in enumerate(values):
            totals[i] += weight * value
    return totals


class RewardFields(Protocol):
    """The fields of the run's config (`PPOConfig`) that say what its reward is."""

    @property
    def rm_type(self) -> str: ...

    @property
    def custom_rm_path(self) -> str | None: ...

    @property
    def reward_weights(self) -> str | None: ...


def reward_terms(config: RewardFields) -> dict[str, float]:
    """The run's terms and weights: `--reward-weights`, else one term (`custom` or `--rm-type`'s) of weight 1."""
    if config.reward_weights:
        return parse_reward_weights(config.reward_weights)
    if config.custom_rm_path:
        return {CUSTOM_TERM: 1.0}
    return {config.rm_type: 1.0}


def build_reward(config: RewardFields) -> RewardFunction | RewardMix:
    """The run's reward: the plain reward function of its one rule term (as before reward mixes),
    or a `RewardMix` when it has several terms or a reward model."""
    weights = reward_terms(config)
    rules = {
        name: load_reward(config.custom_rm_path if name == CUSTOM_TERM and config.custom_rm_path else name)
        for name in weights
        if name != MODEL_TERM
    }
    if len(weights) == 1 and MODEL_TERM not in weights and next(iter(weights.values())) == 1.0:
        return next(iter(rules.values()))
    return RewardMix(weights, rules)
