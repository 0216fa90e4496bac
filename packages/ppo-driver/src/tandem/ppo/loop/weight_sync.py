"""Step 5, the weights to the engines: the actor's weights into every engine, an engine that died restarted.

The engines' weights come back first (when they released their memory), the
asleep actor sends its weights (CUDA IPC where actor rank r and engine r share a
GPU, else CPU copies; a LoRA actor with `adapters` its adapters alone, which the
engines merge into their base), the engines flush their prefix caches and say what they
hold (`weights_received`) and what the sync changed in their weights (`weight_changes`, counted on
their device as they copied), and their KV cache comes back last.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tandem.ppo.engines import EngineDied

if TYPE_CHECKING:
    from tandem.megatron.group import TrainGroup
    from tandem.ppo.engines import EngineGroup
    from tandem.ppo.run.log import EventLog, PhaseClock

__all__ = ["check_engines_agree", "restart_dead_engines", "send_to_restarted", "sync_weights"]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.weight_sync")


def sync_weights(
    actor: TrainGroup,
    engines: EngineGroup,
    *,
    pack: Any,
    release_engines: bool,
    events: EventLog,
    clock: PhaseClock,
    adapters: bool = False,
) -> dict[str, float] | None:
    """Engines' weights back -> the actor's weights (or LoRA adapters) into them -> KV cache back; what the
    sync changed in the engines' weights (`EngineGroup.weight_changes`; None where the engines do not say)."""
    if release_engines:
        with clock.phase("engine_resume_weights"):
            engines.resume_memory(["weights"])
    with clock.phase("weight_sync"):
        events.record("weight_sync", path="ipc" if pack is not None else "cpu", adapters=adapters)
        try:
            actor.update_weights(engines.handles, pack, adapters=adapters)
        except Exception as exc:
            # An engine that died during the sync is restarted (with these weights), then all
            # engines get them again; any other failure is the sync's own.
            if not restart_dead_engines(engines, exc):
                raise
            actor.update_weights(engines.handles, pack, adapters=adapters)
        engines.flush_cache()
        check_engines_agree(engines, events)
        changes = engines.weight_changes()
    if release_engines:
        with clock.phase("engine_resume_kv_cache"):
            engines.resume_memory(["kv_cache"])
    return changes


def send_to_restarted(
    actor: TrainGroup,
    engines: EngineGroup,
    rank: int,
    handle: Any,
    *,
    weights_version: int,
    events: EventLog,
    adapters: bool = False,
) -> None:
    """A restarted engine (`EngineGroup.restart`) starts from the HF folder: give it the actor's weights."""
    import ray

    digest = getattr(handle, "weights_digest", None)
    before = ray.get(digest.remote()) if digest is not None else None
    if weights_version > 0:
        actor.update_weights([handle], adapters=adapters)  # CPU copies: to this engine alone
    after = ray.get(digest.remote()) if digest is not None else None
    events.record(
        "engine_restart",
        rank=rank,
        restarts=engines.restarts[rank],
        weights_version=weights_version,
        digest_before=before,
        digest_after=after,
    )


def restart_dead_engines(engines: EngineGroup, exc: BaseException) -> bool:
    """Restart the engines that no longer answer after `exc`; whether there were any."""

    dead = [rank for rank, alive in enumerate(engines.health()) if not alive]
    for rank in dead:
        engines.restart(rank, EngineDied(rank, f"weight sync failed: {' '.join(str(exc).split())[:300]}"))
    return bool(dead)


def check_engines_agree(engines: EngineGroup, events: EventLog) -> None:
    """Every engine's weight fingerprints, into events.jsonl; a warning when they differ."""
    digests = engines.weights_digest()
    if digests is None:
        return
    agree = all(d == digests[0] for d in digests)
    events.record("weights_received", digests=digests, agree=agree)
    if not agree:
        logger.warning("after the weight sync the engines hold different weights: %s", digests)
