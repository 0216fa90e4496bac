"""One step's metrics, assembled: the roles' figures, the rollout's, the clock's and the counters.

The names are the run's contract (metrics.jsonl, TensorBoard, the trackers, the
plots): `critic/*` and `actor/*` as the workers report them, `alloc/<role>_train/*`,
`train_time/<role>/*` (where each train's seconds went), `policy/*` (what the weight sync changed
in the engines' weights), the aliases
`loss/policy`, `loss/value`, `actor/kl`, and `time/step` (the step's one wall clock)
with the throughput derived from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.megatron.algorithms.kl_control import adaptive_kl_coef

if TYPE_CHECKING:
    from tandem.megatron.config import WorkerFields
    from tandem.megatron.payloads import TrainResult
    from tandem.ppo.rollout.samples import Sampled

__all__ = [
    "ALIASES",
    "KL_COEF",
    "allocator_calls",
    "kl_coef_of_step",
    "policy_metrics",
    "role_metrics",
    "step_metrics",
    "train_time",
]

KL_COEF = "kl/reward_coef"
"""The reward-level KL coefficient a step used, logged when the adaptive KL controller steers it."""

ALIASES = {
    "loss/policy": "actor/pg_loss",
    "loss/value": "critic/value_loss",
    "actor/kl": "actor/approx_kl",
}
"""Short names of the figures that every PPO dashboard shows, and the metric each one copies."""


def allocator_calls(role: str, out: list[TrainResult]) -> dict[str, float]:
    """`alloc/<role>_train/device_mallocs` (and frees): the most any rank made in its train (GPU); and where the
    plan kept some of the role's tags asleep through the passes, `memory/<role>_step_wake_s` and
    `memory/<role>_step_sleep_s`: the most any rank's wakes and sleeps of them around the optimizer steps took
    (part of the train's time, not a phase of the step's clock), and `memory/<role>_step_moved_gib` what they
    moved both ways (beside `memory/moved_gib`, the plan's moves between turns)."""
    figures: dict[str, float] = {}
    for rank_out in out:
        for name, count in rank_out.allocator.items():
            key = f"alloc/{role}_train/{name.removeprefix('alloc/')}"
            figures[key] = max(figures.get(key, 0.0), float(count))
        for name, seconds in rank_out.step_moves.items():
            key = f"memory/{role}_{name}"
            figures[key] = max(figures.get(key, 0.0), float(seconds))
    return figures


def kl_coef_of_step(config: WorkerFields, metrics_so_far: list[dict[str, Any]]) -> float | None:
    """The reward-level KL coefficient of the next step under the adaptive KL controller (`kl_target`).

    Replayed from `kl_coef` over the KL of each step so far (`actor/reward_kl`, or the
    critic's in a critic-only step), so a resumed run, whose metrics come back with its
    state, continues with the coefficient it had. None without `kl_target` (the workers
    keep `kl_coef`).
    """
    if config.kl_target is None:
        return None
    kls = (float(m.get("actor/reward_kl", m.get("critic/reward_kl", float("nan")))) for m in metrics_so_far)
    return adaptive_kl_coef(
        config.kl_coef, config.kl_target, config.kl_horizon, config.samples_per_rollout, kls
    )


def train_time(role: str, out: list[TrainResult]) -> dict[str, float]:
    """`train_time/<role>/<part>`: the most any rank's train spent in each part (`TrainResult.train_time`:
    `old_log_probs`, `reference_log_probs`, `old_values`, `passes`, `optimizer_step`, `other`, and `total`,
    the train's own wall clock inside the step's `time/<role>_train`). Not phases of the step's clock."""
    figures: dict[str, float] = {}
    for rank_out in out:
        for part, seconds in rank_out.train_time.items():
            key = f"train_time/{role}/{part}"
            figures[key] = max(figures.get(key, 0.0), float(seconds))
    return figures


def role_metrics(role: str, out: list[TrainResult]) -> dict[str, float]:
    """A role's train figures under `<role>/` (the same on every rank: rank 0's), its allocator calls and
    where its train's seconds went (`train_time`)."""
    return (
        {f"{role}/{k}": v for k, v in out[0].metrics.items()}
        | allocator_calls(role, out)
        | train_time(role, out)
    )


def policy_metrics(changes: dict[str, float] | None) -> dict[str, float]:
    """What the step's weight sync changed in the engines' weights: `policy/changed_fraction` (in this
    sync) and `policy/changed_fraction_since_start` (ever, since the engines loaded their weights), and
    `time/engine_weight_update`, the engine's own seconds in the sync (count included)."""
    if changes is None:
        return {}
    metrics = {"time/engine_weight_update": float(changes["update_s"])}
    elements = changes.get("elements")
    if elements:
        metrics["policy/changed_fraction"] = changes["changed"] / elements
        metrics["policy/changed_fraction_since_start"] = changes["changed_since_start"] / elements
    return metrics


def step_metrics(
    trained: dict[str, Any],
    sampled: Sampled,
    *,
    seconds: float,
    clock: dict[str, float],
    rollout_id: int,
    critic_only: bool,
    accuracy_threshold: float,
    n_samples_per_prompt: int,
    dropped_prompts: int,
    restarts: int,
    restarts_total: int,
) -> dict[str, Any]:
    """All of one step's metrics: `trained` (the roles'), then the rollout's, the aliases, the clock's.

    `seconds`: the step's wall clock (`time/step`); `clock`: the phase clock's values;
    `restarts`: engines restarted during this step, `restarts_total` in the run so far.
    """
    metrics = dict(trained)
    rollout = sampled.rollout
    metrics.update(
        rollout.metrics(accuracy_threshold=accuracy_threshold, n_samples_per_prompt=n_samples_per_prompt)
    )
    metrics.update({alias: metrics[name] for alias, name in ALIASES.items() if name in metrics})
    metrics.update(sampled.seconds)
    metrics.update(clock)
    metrics.update(sampled.counts)
    metrics.update(
        {
            "time/step": seconds,
            "throughput/tokens_per_s": rollout.response_tokens() / seconds,
            "data/epoch": float(sampled.data_state.get("epoch", 0)),
            "data/dropped_prompts": float(dropped_prompts),
            "step/critic_only": float(critic_only),
            "async/staleness": float(rollout_id - sampled.weights_version),
            "engine/restarts": float(restarts),
            "engine/restarts_total": float(restarts_total),
        }
    )
    return metrics
