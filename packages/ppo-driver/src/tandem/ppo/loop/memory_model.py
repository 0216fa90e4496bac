"""The memory of one step on one GPU, as data: per role and memory tag the bytes it holds, per phase its
transient peak, and the GPU's budget (`memory_plan` plans with them).

The figures come from the workers' own reports, measured in the first step: a train worker's
`state_nbytes()` per tag (`RoleMemory.from_ranks`), an engine's `memory_stats()` (`RoleMemory.from_engine_stats`),
each worker's CUDA context from `gpu_memory()` (`fixed_from_gpu_memory`), and each phase's allocator peak
less what was allocated as it began. `MemoryModel.to_dict` / `from_dict` keep them as JSON. Pure: no Ray,
no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from tandem.megatron.choices import memory_tag_kind
from tandem.ppo.loop.schedule import Role, Work

__all__ = [
    "DROPPED_TAGS",
    "EVICTION_ORDER",
    "STEP_KINDS",
    "WEIGHT_TAGS",
    "GpuBudget",
    "MemoryModel",
    "RoleMemory",
    "TagRef",
    "TrainSplit",
    "fixed_from_gpu_memory",
    "format_bytes",
]

TagRef = tuple[Role, str]
"""One memory tag of one role: ("actor", "optimizer")."""

EVICTION_ORDER: tuple[str, ...] = (
    "grads",
    "kv_cache",
    "optimizer_moments",
    "main_params",
    "optimizer",
    "base",
    "weights",
)
"""The memory tags a role may have, in the order the plan puts them to sleep (among the tags the next turn
does not touch, then among those it does). Gradients (zeroed before every minibatch; copied only with
`offload_grads`) and the engines' KV cache (empty between rollouts) are dropped, not copied; then the
optimizer's moments, its fp32 main parameters, the two together (`optimizer`, one tag today), a LoRA model's
frozen base (copied to the host once, so it only comes back), and the weights last. A tag may be one piece
of its kind (`optimizer_moments.2`: a worker's `optimizer_pieces`), which sleeps as its kind does
(`memory_tag_kind`)."""

DROPPED_TAGS: frozenset[str] = frozenset({"grads", "kv_cache"})
"""The tags a sleep drops instead of copying (`EVICTION_ORDER`): they cost no copy either way, so the plan
sleeps them before any other, even where the next turn needs them back."""

WEIGHT_TAGS: frozenset[str] = frozenset({"base", "weights"})
"""The tags a forward pass reads (the actor's log-probs, a weight export)."""

STEP_KINDS: tuple[str, ...] = ("optimizer_moments", "main_params", "optimizer")
"""The kinds of tag that only a train's optimizer step reads (the optimizer's state), in the order a plan keeps
them asleep through the forward and backward passes (`memory_plan.PlannedTurn.at_step`): the moments before the
fp32 main parameters, as `EVICTION_ORDER` has them."""


@dataclass(frozen=True)
class TrainSplit:
    """A train's transient in its two parts, each the allocator's peak above what the train began with: its
    forward and backward passes' (`passes`: activations, logits) and its optimizer steps' (`step`: the
    optimizer's temporaries), measured apart (the worker's `train/passes` and `train/optimizer_step`)."""

    passes: int
    step: int

    def __post_init__(self) -> None:
        for name, nbytes in (("passes", self.passes), ("step", self.step)):
            if nbytes < 0:
                raise ValueError(f"TrainSplit.{name}={nbytes}: give a count of bytes >= 0")


@dataclass(frozen=True)
class RoleMemory:
    """What one role holds on one GPU, in bytes (each figure the largest over the role's ranks).

    Attributes:
        tags: bytes per memory tag (`EVICTION_ORDER`'s names, or pieces of them), the part a sleep can hand back: a train
            worker's `state_nbytes()`, an engine's weights and `kv_cache`.
        fixed: bytes that stay while the role sleeps (CUDA context, communicators).
        cache: bytes its allocator keeps cached after its work (reserved, not allocated: a train worker's
            `phase_peaks()[CACHED]`), which the process goes on holding unless it hands them back
            (`empty_cache`); a plan counts them at every turn for a role it lets keep them
            (`MemoryPlan.keeps_cache`).
    """

    tags: Mapping[str, int]
    fixed: int = 0
    cache: int = 0

    def __post_init__(self) -> None:
        for tag, nbytes in self.tags.items():
            if memory_tag_kind(tag) not in EVICTION_ORDER:
                raise ValueError(
                    f"memory tag {tag!r}: choose among {list(EVICTION_ORDER)}, or a piece of one "
                    f"({EVICTION_ORDER[2]}.0 …)"
                )
            if nbytes < 0:
                raise ValueError(f"memory tag {tag!r}: {nbytes} bytes; give a count of bytes >= 0")
        for name, nbytes in (("fixed", self.fixed), ("cache", self.cache)):
            if nbytes < 0:
                raise ValueError(f"{name}={nbytes}: give a count of bytes >= 0")

    @classmethod
    def from_ranks(cls, per_rank: Iterable[Mapping[str, int]], fixed: int = 0) -> RoleMemory:
        """A role's figures from each rank's report (a train worker's `state_nbytes()`), the largest of each tag."""
        tags: dict[str, int] = {}
        for report in per_rank:
            for tag, nbytes in report.items():
                tags[tag] = max(tags.get(tag, 0), int(nbytes))
        return cls(tags, fixed)

    @classmethod
    def from_engine_stats(cls, per_engine: Iterable[Mapping[str, float]], fixed: int = 0) -> RoleMemory:
        """The engines' figures from each engine's `memory_stats()` (GiB), taken once a rollout has built the
        KV cache: `kv_cache` the cache and the kept sessions' KV (released together), `weights` the rest of
        what the engine's allocator holds; the largest engine's of each. What its allocator keeps cached
        beside them (`reserved_gib` less `allocated_gib`: a generation's temporaries) adds to `fixed`: an
        engine that keeps its memory keeps it too. So does what its process holds outside its allocator
        (`process_gib`, the driver's figure for the process, less `reserved_gib`: the CUDA context, the
        libraries' own buffers), which no release gives back."""
        kv_cache = weights = cached = outside = 0
        for stats in per_engine:
            if "allocated_gib" not in stats:
                raise ValueError(
                    f"engine memory_stats {dict(stats)}: no allocated_gib; measure the engines on a GPU "
                    "(the figures come from torch's CUDA allocator)"
                )
            kv = (stats.get("kv_cache_gib", 0.0) + stats.get("sessions_gib", 0.0)) * 2**30
            kv_cache = max(kv_cache, round(kv))
            weights = max(weights, round(stats["allocated_gib"] * 2**30 - kv))
            reserved = stats.get("reserved_gib", stats["allocated_gib"])
            cached = max(cached, round((reserved - stats["allocated_gib"]) * 2**30))
            if stats.get("process_gib") is not None:
                outside = max(outside, round((stats["process_gib"] - reserved) * 2**30))
        return cls({"weights": weights, "kv_cache": kv_cache}, fixed + cached + outside)


def fixed_from_gpu_memory(per_rank: Iterable[Mapping[str, int | None]]) -> int:
    """The bytes a role's process holds whatever sleeps, from each rank's `gpu_memory()`: its CUDA context
    (`context`), the largest rank's; 0 where nvidia-smi could not tell (a container's view)."""
    return max((r["context"] or 0 for r in per_rank if "context" in r), default=0)


@dataclass(frozen=True)
class MemoryModel:
    """The memory of one step on one GPU: each role's tags, and each phase's transient peak.

    Attributes:
        roles: each role's `RoleMemory`.
        phases: bytes a phase allocates above the resident tags while it runs (activations, logits, a
            weight sync's buckets), by (role, work): the allocator's peak in the phase less what was
            allocated when it began. The async loop's background generation holds its `start_next`
            figure until `await_next`.
        train_splits: a train role's `train` transient in its passes' part and its optimizer steps' part
            (`TrainSplit`), where measured: a plan may then keep the role's optimizer state asleep through
            the passes (`memory_plan.PlannedTurn.at_step`).
    """

    roles: Mapping[Role, RoleMemory]
    phases: Mapping[tuple[Role, Work], int] = field(default_factory=dict)
    train_splits: Mapping[Role, TrainSplit] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (role, work), nbytes in self.phases.items():
            if nbytes < 0:
                raise ValueError(f"phases[{role}/{work}]: {nbytes} bytes; give a count of bytes >= 0")

    def nbytes(self, ref: TagRef) -> int:
        """Bytes of one tag."""
        return self.roles[ref[0]].tags[ref[1]]

    def tags(self) -> list[TagRef]:
        """Every (role, tag) of the model."""
        return [(role, tag) for role, memory in self.roles.items() for tag in memory.tags]

    def transient(self, role: Role, work: Work | None) -> int:
        """The phase's transient bytes; ValueError naming the phase when the model lacks its figure."""
        if work is None:
            return 0
        key: tuple[Role, Work] = (role, "start_next" if work == "await_next" else work)
        if key not in self.phases:
            raise ValueError(f"phases: no figure for {key[0]}/{key[1]}; measure its peak in the first step")
        return self.phases[key]

    def kept_cache(self, role: Role) -> int:
        """What `role`'s process holds beside its tags when it keeps its allocator's cache: its `cache` figure,
        or its largest phase's transient where that is larger (the allocator keeps what a phase allocated)."""
        largest = max((n for (r, _), n in self.phases.items() if r == role), default=0)
        return max(self.roles[role].cache, largest)

    def to_dict(self) -> dict[str, Any]:
        """The model as JSON-ready data (`from_dict` reads it back)."""
        return {
            "roles": {
                role: {"tags": dict(m.tags), "fixed": m.fixed, "cache": m.cache}
                for role, m in self.roles.items()
            },
            "phases": {f"{role}/{work}": nbytes for (role, work), nbytes in self.phases.items()},
            "train_splits": {
                role: {"passes": split.passes, "step": split.step}
                for role, split in self.train_splits.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryModel:
        """The model from `to_dict`'s data: {"roles": {role: {"tags": {...}, "fixed": n, "cache": n}}, "phases":
        {"role/work": n}, "train_splits": {role: {"passes": n, "step": n}}} (a role without "cache" keeps none;
        without "train_splits" no role's is known)."""
        roles: dict[Role, RoleMemory] = {}
        for role, entry in data.get("roles", {}).items():
            roles[_role(role)] = RoleMemory(
                dict(entry.get("tags", {})), int(entry.get("fixed", 0)), int(entry.get("cache", 0))
            )
        phases: dict[tuple[Role, Work], int] = {}
        for key, nbytes in data.get("phases", {}).items():
            role, _, work = key.partition("/")
            if work not in get_args(Work):
                raise ValueError(
                    f"phases[{key!r}]: name a phase as role/work, the work one of {get_args(Work)}"
                )
            phases[(_role(role), work)] = int(nbytes)
        splits = {
            _role(role): TrainSplit(int(entry["passes"]), int(entry["step"]))
            for role, entry in data.get("train_splits", {}).items()
        }
        return cls(roles, phases, splits)


def _role(name: str) -> Role:
    if name not in get_args(Role):
        raise ValueError(f"role {name!r}: choose among {get_args(Role)}")
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class GpuBudget:
    """What a turn may use on one GPU: `capacity` bytes less a `margin` kept free (fragmentation, the
    allocator's rounding, what the figures missed)."""

    capacity: int
    margin: int = 0

    def __post_init__(self) -> None:
        if self.capacity <= 0 or self.margin < 0 or self.margin >= self.capacity:
            raise ValueError(
                f"capacity={self.capacity}, margin={self.margin}: give a capacity > 0 and 0 <= margin < capacity"
            )

    @property
    def available(self) -> int:
        """Bytes a turn's peak may reach."""
        return self.capacity - self.margin


def format_bytes(nbytes: int) -> str:
    """`nbytes` for people: "10.0 GiB", or in MiB below a GiB ("9.6 MiB")."""
    return f"{nbytes / 2**30:.1f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
