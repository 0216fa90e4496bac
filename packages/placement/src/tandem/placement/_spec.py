"""What a PPO run asks of the GPUs: the placement spec and its validation."""

from __future__ import annotations

from dataclasses import dataclass, fields

_COUNT_FIELDS = ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "eval_num_gpus")
_FLAG_FIELDS = ("colocate", "debug_train_only", "debug_rollout_only", "rollout_external", "use_critic")


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """Which GPUs a PPO run needs for training (actor and critic), rollout and evaluation.

    The critic never adds GPUs: it time-shares the actor's bundles. Every field is
    checked when the spec is built; a bad one raises `ValueError` naming the field
    and the fix. `compute_layout` turns a spec into GPU counts and offsets.
    """

    actor_num_nodes: int = 1
    """Nodes that train; `actor_num_nodes × actor_num_gpus_per_node` training GPUs (ignored with `debug_rollout_only`)."""
    actor_num_gpus_per_node: int = 1
    """Training GPUs on each of those nodes."""
    rollout_num_gpus: int | None = None
    """GPUs of the rollout engine; needed unless `debug_train_only` or `rollout_external`."""
    colocate: bool = False
    """Rollout engine on the training GPUs (time-shared), instead of GPUs of its own."""
    debug_train_only: bool = False
    """Train without a rollout engine (debugging); rollout and eval fields are then ignored."""
    debug_rollout_only: bool = False
    """Run the rollout engine without training (debugging); actor fields are then ignored."""
    rollout_external: bool = False
    """The rollout engine runs outside this Ray cluster; it gets no GPUs here."""
    eval_num_gpus: int = 0
    """GPUs of a separate evaluation engine, after the rollout GPUs (only without colocate / external rollout)."""
    use_critic: bool = False
    """Train a critic (PPO); it shares the actor's GPUs, so the layout does not change."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_combinations(self)
        _check_counts(self)

    @property
    def train_num_gpus(self) -> int:
        """Training GPUs asked for: `actor_num_nodes × actor_num_gpus_per_node`."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


def _check_types(spec: PlacementSpec) -> None:
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name in _FLAG_FIELDS:
            if not isinstance(value, bool):
                raise ValueError(f"{f.name}={value!r} must be True or False")
            continue
        if f.name == "rollout_num_gpus" and value is None:
            continue
        # bool is an int in Python; `actor_num_nodes=True` is a mistake, not a count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{f.name}={value!r} must be a whole number of GPUs or nodes (an int)")
        if value < 0:
            raise ValueError(f"{f.name}={value} is negative; give a count >= 0")


def _check_combinations(spec: PlacementSpec) -> None:
    if spec.debug_train_only and spec.debug_rollout_only:
        raise ValueError(
            "debug_train_only and debug_rollout_only are both set; set at most one of them "
            "(both off for a normal run)"
        )
    if spec.colocate and spec.rollout_external:
        raise ValueError(
            "colocate=True with rollout_external=True: an external engine cannot share the training GPUs; "
            "set colocate=False, or rollout_external=False to run the engine on the training GPUs"
        )


def _check_counts(spec: PlacementSpec) -> None:
    trains = not spec.debug_rollout_only
    if trains:
        for name in ("actor_num_nodes", "actor_num_gpus_per_node"):
            if getattr(spec, name) < 1:
                raise ValueError(
                    f"{name}={getattr(spec, name)} but training needs at least 1; set {name} >= 1"
                )
    if spec.debug_train_only:
        return  # no rollout engine: its counts are not used
    if spec.rollout_external:
        if spec.eval_num_gpus > 0 and not spec.debug_rollout_only:
            raise ValueError(
                f"eval_num_gpus={spec.eval_num_gpus} with rollout_external=True: the evaluation engine "
                "is external too and gets no GPUs here; set eval_num_gpus=0"
            )
        return
    if spec.rollout_num_gpus is None or spec.rollout_num_gpus < 1:
        why = (
            "debug_rollout_only=True"
            if spec.debug_rollout_only
            else "the rollout engine runs in this cluster"
        )
        raise ValueError(
            f"rollout_num_gpus={spec.rollout_num_gpus} but {why} and needs GPUs; set rollout_num_gpus >= 1"
            + ("" if spec.debug_rollout_only else ", or debug_train_only=True to train without an engine")
        )
    if spec.colocate and spec.eval_num_gpus > 0 and not spec.debug_rollout_only:
        raise ValueError(
            f"eval_num_gpus={spec.eval_num_gpus} with colocate=True: a colocated layout has no GPUs "
            "for a separate evaluation engine; set eval_num_gpus=0 (evaluate with the rollout engine)"
        )
