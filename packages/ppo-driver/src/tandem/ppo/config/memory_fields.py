"""The fields of the step's memory plan: whether the train roles sleep as whole roles or by memory tag.

`MemoryFields` is a part of `RunFields` (every flag of `ppo-driver train`), kept apart so that each
module stays one concept. docs/design.md, "The memory plan".
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["MemoryFields"]


@dataclasses.dataclass(frozen=True)
class MemoryFields:
    """The flags of the memory plan: which of the actor's and the critic's tensors sleep at each turn."""

    memory_plan: Literal["auto", "whole", "fit"] = "auto"
    """How the actor and the critic sleep on shared GPUs (`--offload-train`). `whole`: each sleeps whole
    after its turns, as the step's schedule says. `fit`: from the first step's own figures (each model's
    bytes per memory tag, each phase's allocator peak, the engines' memory), each turn puts to sleep only
    the tags that the turn needs room for, optimizer moments before fp32 main parameters before
    weights, and keeps the rest resident; a plan that does not fit `--gpu-memory-gib` less
    `--memory-margin-gib` is refused with the numbers. The first step of each start runs `whole`, as does
    a step with a work no earlier step of the start ran (the actor's first train after a critic's
    warm-up). `auto` (the default): `fit` where the run can plan, `whole` elsewhere, said once in the log:
    it plans with `--offload-train` on a GPU run (not `--device cpu`) whose engines report the GPU's
    memory (the embedded engine; SGLang servers with `--gpu-memory-gib`), and where a plan is refused (the
    margin does not fit beside the models taking turns), then or at a later step, it runs `whole` from
    there on and says why."""

    gpu_memory_gib: float | None = None
    """The GPU memory the memory plan may fill, in GiB per GPU. None: the GPU's whole memory as the
    engines' allocator reports it (on a CPU run give it)."""

    memory_margin_gib: float = 4.0
    """GiB per GPU the memory plan keeps free of its figures: fragmentation, the allocator's rounding,
    the phases' peaks on rollouts longer than the first step's."""

    overlap_moves: bool = True
    """With a plan (`fit`, or `auto` where it plans): where a turn puts tags of one model to sleep and wakes tags of the other, and the GPU
    holds both meanwhile (the turn before's peak and what wakes fit the plan's budget), the two run at
    once: one model's copy to the host beside the other's copy back, timed as `time/handover`.
    `--no-overlap-moves`: sleeps first, then wakes, one model after the other."""

    prefetch_wakes: bool = True
    """With a plan (`fit`, or `auto` where it plans): a model's wakes for a turn start a turn early, in the background, where the turn before
    has room for them and the model does not compute in it: its copy back to the GPU runs beside the other
    model's work (the plan's `prefetch`; what is left to wait for is `time/<role>_wake`).
    `--no-prefetch-wakes`: each wake as its turn is entered."""
