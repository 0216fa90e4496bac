"""Why a run is not learning: one-line hints from each step's figures, each said once, never while it learns.

`RunHealth.observe` is given one step's figures at a time (`StepFigures`, read from the
step's metrics) and returns the hints that step brings. A hint names what was measured
and the flag to change (docs/troubleshooting.md has the table):

- `static_weights`: few of the sampling weights have changed since the start
  (`policy/changed_fraction_since_start`), with the learning rate's largest move over the
  steps so far against the spacing of the engine's dtype at this model's weights;
- `tied_groups`: most prompts' samples all got the same reward (`reward/tied_groups`), with
  two responses and their rewards;
- `critic`: the critic's explained variance stays below 0 after its window;
- `truncated`: most responses hit `--rollout-max-response-len` (`reward/truncated`).

No hint before `FIRST_HINT_STEP` steps, none while the run learns (`is_learning`: the mean
reward of the last `WINDOW` steps above that of the first `WINDOW`, beyond the steps'
spread), and each at most once a run. Everything here is pure: numbers in, strings out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CRITIC_EV_FLOOR",
    "FIRST_HINT_STEP",
    "LEARNING_T",
    "STATIC_WEIGHTS_FRACTION",
    "TIED_GROUPS_SHARE",
    "TRUNCATED_SHARE",
    "WINDOW",
    "Hint",
    "RunFacts",
    "RunHealth",
    "StepFigures",
    "WeightMagnitudes",
    "is_learning",
    "out_of_reach",
    "rise_t",
    "tied_examples",
]

WINDOW = 5
"""Steps that every judgement averages over: one step's figures are a draw of a few prompts, and a
hint should rest on a trend, not on one unlucky batch."""

FIRST_HINT_STEP = 15
"""No hint before this many steps: the first `WINDOW` steps are the baseline a rise is measured from,
and a run that learns shows it within this many (the demo's mean reward is about three `WINDOW`-step
spreads above its start by step 15; a pretrained model learning a task it can do, sooner)."""

LEARNING_T = 3.0
"""The run is learning when the last `WINDOW` steps' mean reward is above the first `WINDOW`'s by at least
this many standard errors of that difference (each window's spread of per-step means): a rise this
large comes from noise about once in a hundred flat runs (Welch's t with ~8 degrees of freedom)."""

STATIC_WEIGHTS_FRACTION = 0.10
"""Fewer than this share of the sampling weights changed since the start means the policy that samples
has barely moved. Adam moves each weight by at most about `lr` a step, and a bfloat16 weight changes
only once its fp32 master has moved half a spacing (2**-9 |w| or more): at the default `--lr` 1e-6 and
|w| near 0.02 that takes about 60 steps, so after 15 steps only the smallest weights (|w| < ~0.002, a
few percent of a pretrained model's) can have changed, while at 1e-5 most of them have."""

TIED_GROUPS_SHARE = 0.5
"""More than this share of prompts whose samples all got the same reward means most of the batch gives
no signal: with a group baseline (GRPO, RLOO) their advantages are 0, with a critic they carry only its
error. "Most", as in "the reward gives no signal for most prompts"."""

CRITIC_EV_FLOOR = -0.1
"""A critic whose explained variance stays below this after its window predicts the returns worse than
their mean: the advantages (returns minus values) then carry its error on top of the action's worth, and
whitening scales that up to the size of a real advantage. Below 0, not at it: where the reward depends
on the sampled answer and not on the prompt, the best a value of the prompt can do is the mean, and its
explained variance hovers at 0 (the demo's stays within ±0.002 of it); a tenth of the returns' variance
added is where its error starts to weigh."""

TRUNCATED_SHARE = 0.5
"""More than this share of responses cut at `--rollout-max-response-len` means most answers never end:
the reward sees unfinished text, and (with EOS unseen) the policy never learns to stop."""

_SPACING_SHARE = 0.5
"""The lr is named as the cause when at least this share of the weights sit where its largest move is
under half a spacing; below it the lr could move them, and the gradient is what is missing."""


@dataclass(frozen=True)
class WeightMagnitudes:
    """How large the engine's weights are (`EmbeddedEngine.weight_magnitudes`): per binary exponent `e`,
    the elements with `2**e <= |w| < 2**(e + 1)`; `zeros`, those equal to 0. A weight's spacing in the
    engine's dtype is `2**e * eps` (bfloat16: eps 2**-7)."""

    dtype: str
    eps: float
    exponents: Mapping[int, int]
    zeros: int = 0

    @staticmethod
    def of(figures: Mapping[str, Any] | None) -> WeightMagnitudes | None:
        """From the engine's dict (keys may have become strings on the way); None for None or empty."""
        if not figures:
            return None
        exponents = {int(e): int(n) for e, n in figures["exponents"].items()}
        return WeightMagnitudes(
            str(figures["dtype"]), float(figures["eps"]), exponents, int(figures["zeros"])
        )

    @property
    def total(self) -> int:
        return sum(self.exponents.values()) + self.zeros

    def half_spacing(self, exponent: int) -> float:
        """Half the dtype's spacing at weights of binary exponent `exponent`: the least move of an
        fp32 master on the dtype's grid that changes its rounded copy."""
        return 2.0**exponent * self.eps / 2

    def median_exponent(self) -> int | None:
        """The binary exponent of the median nonzero weight."""
        total = sum(self.exponents.values())
        seen = 0
        for exponent in sorted(self.exponents):
            seen += self.exponents[exponent]
            if 2 * seen >= total:
                return exponent
        return None


def out_of_reach(move: float, weights: WeightMagnitudes) -> tuple[float, int | None]:
    """The share of the weights whose half spacing exceeds `move`, and the least binary exponent where
    it does (None: no weight's does).

    A weight whose master moved less than half a spacing rounds to the value it had: those weights
    cannot have changed in the engine's dtype. Zeros are within reach (their spacing is the least).
    """
    if weights.total == 0:
        return 0.0, None
    reach = [e for e in weights.exponents if weights.half_spacing(e) > move]
    if not reach:
        return 0.0, None
    lowest = min(reach)
    beyond = sum(n for e, n in weights.exponents.items() if e >= lowest)
    return beyond / weights.total, lowest


@dataclass(frozen=True)
class RunFacts:
    """What the hints need to know of the run: its flags' values and what its engines said."""

    lr: float
    critic_lr: float
    num_critic_only_steps: int
    rollout_max_response_len: int
    n_samples_per_prompt: int
    optimizer_steps_per_rollout: int
    weights: WeightMagnitudes | None = None
    rewarded: bool = True
    """The run has a reward (`--rm-type none` has none: its samples all tie, and say nothing of it)."""


@dataclass(frozen=True)
class StepFigures:
    """One step's figures that the hints read (`from_metrics`: the step's metrics)."""

    step: int
    reward_mean: float | None = None
    tied_groups: float | None = None
    truncated: float | None = None
    explained_variance: float | None = None
    actor_trained: bool = False
    actor_lr: float | None = None
    actor_grad_norm: float | None = None
    changed_fraction_since_start: float | None = None

    @staticmethod
    def from_metrics(step: int, metrics: Mapping[str, Any]) -> StepFigures:
        def number(key: str) -> float | None:
            value = metrics.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                return None
            return float(value)

        return StepFigures(
            step=step,
            reward_mean=number("reward/mean"),
            tied_groups=number("reward/tied_groups"),
            truncated=number("reward/truncated"),
            explained_variance=number("critic/explained_variance"),
            actor_trained="actor/pg_loss" in metrics,
            actor_lr=number("actor/lr"),
            actor_grad_norm=number("actor/grad_norm"),
            changed_fraction_since_start=number("policy/changed_fraction_since_start"),
        )


@dataclass(frozen=True)
class Hint:
    """One hint: its name (`static_weights`, `tied_groups`, `critic`, `truncated`) and its one line."""

    name: str
    message: str


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def rise_t(rewards: Sequence[float], window: int = WINDOW) -> float | None:
    """How far the mean of the last `window` rewards is above the first `window`'s, in standard errors of
    that difference (Welch's t); None with fewer than two windows.

    Each window's spread is its per-step means' sample variance, so the statistic needs no sample count
    and is the same for any scale or offset of the reward. With no spread at all: ±inf for a rise or a
    fall, 0 for none.
    """
    if len(rewards) < 2 * window:
        return None
    first, last = rewards[:window], rewards[-window:]
    rise = _mean(last) - _mean(first)
    spread = math.sqrt((statistics.variance(first) + statistics.variance(last)) / window)
    if spread == 0 or not math.isfinite(rise / spread):
        return 0.0 if rise == 0 else math.copysign(math.inf, rise)
    return rise / spread


def is_learning(rewards: Sequence[float], window: int = WINDOW, t: float = LEARNING_T) -> bool:
    """Whether the mean of the last `window` rewards is above the first `window`'s by `t` standard errors."""
    value = rise_t(rewards, window)
    return value is not None and value >= t


def tied_examples(
    responses: Sequence[str], rewards: Sequence[float], n_samples_per_prompt: int, count: int = 2
) -> list[tuple[str, float]]:
    """Up to `count` responses with their rewards, each from another prompt whose samples all scored the same."""
    out: list[tuple[str, float]] = []
    n = n_samples_per_prompt
    for start in range(0, len(rewards) - n + 1, n):
        group = rewards[start : start + n]
        if max(group) == min(group):
            out.append((responses[start], float(rewards[start])))
            if len(out) == count:
                break
    return out


def _quote(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


def _percent(share: float) -> str:
    return f"{100 * share:.0f}%" if share >= 0.01 or share == 0 else f"{100 * share:.2f}%"


@dataclass
class RunHealth:
    """The hints of one run, from its steps' figures in order (`observe`)."""

    facts: RunFacts
    history: list[StepFigures] = field(default_factory=list)
    fired: set[str] = field(default_factory=set)
    examples: list[tuple[str, float]] = field(default_factory=list)

    def observe(self, figures: StepFigures, examples: Sequence[tuple[str, float]] = ()) -> list[Hint]:
        """Take one step's figures (and some responses of prompts whose samples tied); the hints they bring."""
        self.history.append(figures)
        if examples:
            self.examples = list(examples)
        if len(self.history) < FIRST_HINT_STEP or self.learning():
            return []
        hints = []
        for name, check in (
            ("static_weights", self._static_weights),
            ("tied_groups", self._tied_groups),
            ("critic", self._critic),
            ("truncated", self._truncated),
        ):
            if name in self.fired:
                continue
            message = check()
            if message is not None:
                self.fired.add(name)
                hints.append(Hint(name, message))
        return hints

    def replay(self, steps: Sequence[StepFigures]) -> None:
        """Take the steps of the run before a resume, quietly: the hints they brought were said then."""
        for figures in steps:
            self.observe(figures)

    def learning(self) -> bool:
        """Whether the run's reward is rising (`is_learning` over the steps so far)."""
        rewards = [f.reward_mean for f in self.history if f.reward_mean is not None]
        return is_learning(rewards)

    def window_metrics(self) -> dict[str, float]:
        """`critic/explained_variance_window`: the mean of the critic's explained variance over the last
        `WINDOW` steps that have one (absent before any)."""
        values = [v for v in self._recent("explained_variance") if v is not None]
        return {"critic/explained_variance_window": _mean(values)} if values else {}

    # --- the checks: each a message, or None ------------------------------------------------------
    def _recent(self, name: str) -> list[Any]:
        return [getattr(f, name) for f in self.history[-WINDOW:]]

    def _static_weights(self) -> str | None:
        facts = self.facts
        actor_steps = [f for f in self.history if f.actor_trained]
        known = [
            f.changed_fraction_since_start for f in actor_steps if f.changed_fraction_since_start is not None
        ]
        if len(known) < WINDOW or known[-1] >= STATIC_WEIGHTS_FRACTION:
            return None
        steps = len(actor_steps)
        lrs = [f.actor_lr if f.actor_lr is not None else facts.lr for f in actor_steps]
        move = sum(lrs) * facts.optimizer_steps_per_rollout
        head = (
            f"only {_percent(known[-1])} of the sampling weights changed in {steps} actor steps "
            "(policy/changed_fraction_since_start)"
        )
        weights = facts.weights
        if weights is None:
            return f"{head}: raise --lr (now {facts.lr:g})"
        share, exponent = out_of_reach(move, weights)
        adam_steps = steps * facts.optimizer_steps_per_rollout
        if share >= _SPACING_SHARE and exponent is not None:
            advice = f"raise --lr (now {facts.lr:g})"
            median = weights.median_exponent()
            if median is not None and adam_steps:
                advice += f": about {weights.half_spacing(median) / adam_steps:.0e} moves the median weight that far"
            return (
                f"{head}: --lr {facts.lr:g} moves a weight by at most about {move:.1e} in their {adam_steps} "
                f"Adam steps, under half a {weights.dtype} spacing (>= {weights.half_spacing(exponent):.1e} "
                f"for |w| >= 2^{exponent}) for {_percent(share)} of this model's weights; {advice}"
            )
        grad = self.history[-1].actor_grad_norm
        norm = f", actor/grad_norm {grad:.2g}" if grad is not None else ""
        return (
            f"{head} although --lr {facts.lr:g} could move most of them: the updates are near zero{norm}; "
            "check the advantages (reward/tied_groups, the critic) rather than --lr"
        )

    def _tied_groups(self) -> str | None:
        facts = self.facts
        shares = [v for v in self._recent("tied_groups") if v is not None]
        if not facts.rewarded or facts.n_samples_per_prompt < 2 or len(shares) < WINDOW:
            return None
        share = _mean(shares)
        if not share > TIED_GROUPS_SHARE:
            return None
        shown = ", ".join(f"{_quote(text)} -> {reward:g}" for text, reward in self.examples[:2])
        example = f" (e.g. {shown})" if shown else ""
        return (
            f"{_percent(share)} of prompts over the last {WINDOW} steps had all "
            f"{facts.n_samples_per_prompt} samples scored the same (reward/tied_groups){example}: the reward "
            "gives no signal (the task is too hard or too easy, or the reward is wrong); check the reward "
            "(--custom-rm-path, --rm-type) and the data, or raise --n-samples-per-prompt"
        )

    def _critic(self) -> str | None:
        facts = self.facts
        trained = [f.explained_variance for f in self.history if f.explained_variance is not None]
        if len(trained) < facts.num_critic_only_steps + WINDOW:
            return None
        window = trained[-WINDOW:]
        value = _mean(window)
        if not value < CRITIC_EV_FLOOR:
            return None
        return (
            f"critic/explained_variance averaged {value:.2f} over the last {WINDOW} steps: the critic "
            "predicts the returns worse than their mean, so the advantages are mostly its error; give it "
            f"warm-up steps (--num-critic-only-steps, now {facts.num_critic_only_steps}) or a higher "
            f"--critic-lr (now {facts.critic_lr:g})"
        )

    def _truncated(self) -> str | None:
        shares = [v for v in self._recent("truncated") if v is not None]
        if len(shares) < WINDOW:
            return None
        share = _mean(shares)
        if not share > TRUNCATED_SHARE:
            return None
        limit = self.facts.rollout_max_response_len
        return (
            f"{_percent(share)} of responses over the last {WINDOW} steps hit --rollout-max-response-len "
            f"{limit} (reward/truncated): they are cut before they end; raise --rollout-max-response-len "
            "or ask for shorter answers"
        )
