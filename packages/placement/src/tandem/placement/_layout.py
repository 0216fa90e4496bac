"""GPU layout math: how many bundles a run needs and which of them each role gets.

Pure Python on purpose: the driver validates a config (and tests run) without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ._arguments import count, type_name
from ._spec import PlacementSpec

LayoutCase = Literal[
    "debug_train_only",
    "external_debug_rollout_only",
    "rollout_external",
    "debug_rollout_only",
    "colocate",
    "separate",
]


@dataclass(frozen=True, slots=True)
class Layout:
    """Bundle counts and offsets of one placement group: training at 0, rollout at `rollout_offset`.

    Bundle positions are indices into the group's bundles *after* they are ordered by
    (node IP, GPU id); training always starts at position 0.
    """

    case: LayoutCase
    """Which row of the layout table matched (see docs/design.md, "Layout rules")."""
    num_gpus: int
    """Bundles (one GPU each) in the placement group; 0 means no group at all."""
    rollout_offset: int
    """Position of the first rollout bundle."""
    train_num_gpus: int
    """Training bundles (actor, and the critic on the same ones), at positions `[0, train_num_gpus)`."""
    rollout_num_gpus: int
    """Rollout-engine bundles, at `[rollout_offset, rollout_offset + rollout_num_gpus)`; 0 for none or external."""
    eval_num_gpus: int
    """Evaluation-engine bundles, right after the rollout bundles."""

    def __post_init__(self) -> None:
        if self.case not in get_args(LayoutCase):
            raise ValueError(f"case={self.case!r} is not a layout case; one of {list(get_args(LayoutCase))}")
        for name in ("num_gpus", "rollout_offset", "train_num_gpus", "rollout_num_gpus", "eval_num_gpus"):
            count(name, getattr(self, name))
        needed = max(self.train_num_gpus, self.eval_offset + self.eval_num_gpus)
        if needed > self.num_gpus:
            raise ValueError(
                f"num_gpus={self.num_gpus} is fewer bundles than the roles' positions need ({needed}: "
                f"train_num_gpus={self.train_num_gpus}, rollout_offset={self.rollout_offset} + "
                f"rollout_num_gpus={self.rollout_num_gpus} + eval_num_gpus={self.eval_num_gpus}); "
                "make layouts with compute_layout(spec)"
            )

    @property
    def colocated(self) -> bool:
        """Whether training and rollout share bundles."""
        return self.case == "colocate"

    @property
    def train_gpus(self) -> range:
        """Positions of the training bundles."""
        return range(0, self.train_num_gpus)

    @property
    def rollout_gpus(self) -> range:
        """Positions of the rollout bundles."""
        return range(self.rollout_offset, self.rollout_offset + self.rollout_num_gpus)

    @property
    def eval_offset(self) -> int:
        """Position of the first evaluation bundle."""
        return self.rollout_offset + self.rollout_num_gpus

    @property
    def eval_gpus(self) -> range:
        """Positions of the evaluation bundles."""
        return range(self.eval_offset, self.eval_offset + self.eval_num_gpus)


def compute_layout(spec: PlacementSpec) -> Layout:
    """Turn a spec into bundle counts and offsets; the first matching row of the table wins.

    | case | num_gpus | rollout_offset |
    |---|---|---|
    | debug_train_only | A | 0 |
    | rollout_external and debug_rollout_only | 0 | 0 |
    | rollout_external | A | A |
    | debug_rollout_only | rollout_num_gpus | 0 |
    | colocate | max(A, rollout_num_gpus) | 0 |
    | otherwise | A + rollout_num_gpus + eval_num_gpus | A |

    with `A = actor_num_nodes × actor_num_gpus_per_node`. `use_critic` changes nothing.
    """
    if not isinstance(spec, PlacementSpec):
        hint = "PlacementSpec(**spec)" if isinstance(spec, dict) else "PlacementSpec(...)"
        raise TypeError(f"spec must be a PlacementSpec, got {type_name(spec)}; build one with {hint}")
    train = spec.train_num_gpus
    if spec.debug_train_only:
        return Layout("debug_train_only", train, 0, train, 0, 0)
    if spec.rollout_external and spec.debug_rollout_only:
        return Layout("external_debug_rollout_only", 0, 0, 0, 0, 0)
    if spec.rollout_external:
        return Layout("rollout_external", train, train, train, 0, 0)
    # PlacementSpec guarantees rollout_num_gpus >= 1 in every remaining case.
    rollout = spec.rollout_num_gpus
    assert rollout is not None
    if spec.debug_rollout_only:
        return Layout("debug_rollout_only", rollout, 0, 0, rollout, 0)
    if spec.colocate:
        return Layout("colocate", max(train, rollout), 0, train, rollout, 0)
    return Layout("separate", train + rollout + spec.eval_num_gpus, train, train, rollout, spec.eval_num_gpus)
