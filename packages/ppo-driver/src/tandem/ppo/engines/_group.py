"""A group of rollout engines, one Ray actor per rollout bundle: prompts split across them, results in order.

An engine whose process dies (out of memory, killed) is started again on its own
bundle, up to `max_restarts` times per rank (`EngineGroup.restart`): the group
calls `on_restart(rank, handle)` (the driver sends it the current weights), puts
it back in the group's memory state (the tags released), and sends it again what
it lost: the prompts of its chunk, with the same seed, or the call it died in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from tandem.megatron.group.actors import ActorGroup, split_contiguous

from ._embedded import EmbeddedEngine
from ._options import EngineOptions
from ._protocol import MEMORY_TAGS, Generation, MemoryTag, SamplingParams
from ._sglang import SGLangEngine, require_sglang

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.exceptions import RayActorError

EngineKind = Literal["embedded", "sglang"]

# Seeds derived per rank stay below 2**62 (torch generators take 64-bit seeds).
_SEED_MOD = 2**62
_SEED_STRIDE = 1_000_003


logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine died, timed out, or failed; the message names its rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rollout engine rank {rank}: {message}")
        self.rank = rank


class EngineDied(EngineError):
    """An engine's process died (its Ray actor is gone): a restart can bring it back."""


def derive_seed(seed: int, rank: int) -> int:
    """Engine `rank`'s seed for a group-level `seed`: distinct per rank, the same on every run."""
    return (seed * _SEED_STRIDE + rank + 1) % _SEED_MOD


class EngineGroup(ActorGroup):
    """The rollout engines of a run, in rank order; what the driver generates with.

    Every call waits at most `timeout_s` for each engine and raises an `EngineError` naming
    the rank of an engine that failed or did not answer in time. An engine that died is
    restarted (`restart`) when the group can start engines (`spawn`) and the rank has
    restarts left; else that too is an `EngineError` naming its rank.

    Args:
        handles: Ray actor handles of the engines (rank order), each serving `RolloutEngine`.
        max_context_len: the engines' context (prompt + response tokens).
        timeout_s: seconds to wait for an engine's answer.
        spawn: starts engine `rank` again on its bundle (returns the new handle); None: no restarts.
        max_restarts: restarts allowed per rank.
        startup_timeout_s: seconds to wait for a restarted engine to load its model.
    """

    TIMEOUT_OPTION = "EngineOptions.request_timeout_s"
    KIND: ClassVar[str] = "engine"

    def __init__(
        self,
        handles: Sequence[ActorHandle],
        *,
        max_context_len: int,
        timeout_s: float,
        spawn: Callable[[int], ActorHandle] | None = None,
        max_restarts: int = 0,
        startup_timeout_s: float = 900.0,
    ) -> None:
        super().__init__(handles, timeout_s=timeout_s)
        self.max_context_len = max_context_len
        self.spawn = spawn
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.restarts = [0] * len(self.handles)
        """Restarts so far, per rank."""
        self.on_restart: Callable[[int, ActorHandle], None] | None = None
        """Called with (rank, new handle) once a restarted engine is up, before it gets work again
        (the driver sends it the current weights there)."""
        self._released: list[MemoryTag] = []
        self._sessions: dict[str, int] = {}
        """The engine (rank) of each session (`generate(..., sessions=...)`)."""

    def error(self, rank: int, message: str) -> EngineError:
        """An `EngineError` naming rank `rank`."""
        return EngineError(rank, message)

    def died(self, rank: int, what: str, err: RayActorError) -> EngineDied:
        """An `EngineDied`: a restart can bring rank `rank` back."""
        return EngineDied(rank, f"{what} failed: the engine's actor died ({_one_line(err)})")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        sessions: Sequence[str | None] | None = None,
    ) -> list[Generation]:
        """One `Generation` per prompt, in input order; engine r gets the r-th contiguous chunk.

        With `params.seed`, engine r samples with `derive_seed(seed, r)`, so the same
        prompts, seed and number of engines reproduce the same samples. `sessions`: a session id
        per prompt (an episode's), whose KV its engine keeps for the next call; a session stays on
        the engine it first went to (the prompts of one engine keep their order).
        """
        for i, prompt in enumerate(prompts):
            if len(prompt) > self.max_context_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, longer than the engines' context of "
                    f"{self.max_context_len} tokens (EngineOptions.max_context_len)"
                )
        if sessions is None:
            chunks = split_contiguous(len(prompts), len(self.handles))
            assigned = [list(range(lo, hi)) for lo, hi in chunks]
        else:
            assigned = [[] for _ in self.handles]
            for i, session in enumerate(sessions):
                rank = self._session_rank(session, i)
                assigned[rank].append(i)
        pending: dict[int, tuple[Any, ...]] = {}
        for rank, indices in enumerate(assigned):
            if not indices:
                continue
            rank_params = params
            if params.seed is not None:
                rank_params = dataclasses.replace(params, seed=derive_seed(params.seed, rank))
            call: tuple[Any, ...] = ([list(prompts[i]) for i in indices], rank_params)
            if sessions is not None:
                call = (*call, [sessions[i] for i in indices])
            pending[rank] = call
        by_rank: dict[int, list[Generation]] = {}
        while pending:
            # An engine that died is restarted and given its chunk again, with the same seed.
            calls = [(r, self.handles[r].generate.remote(*pending[r])) for r in pending]
            done, died = self.gather(calls, "generate")
            for rank, chunk_results in done.items():
                by_rank[rank] = chunk_results
                del pending[rank]
            for rank, error in died.items():
                self.restart(rank, error)
        results: list[Generation | None] = [None] * len(prompts)
        for rank, generations in by_rank.items():
            for i, generation in zip(assigned[rank], generations, strict=True):
                results[i] = generation
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _session_rank(self, session: str | None, index: int) -> int:
        """The engine of `session`: the one it first went to (round robin), or by index without one."""
        if session is None:
            return index % len(self.handles)
        rank = self._sessions.get(session)
        if rank is None:
            rank = self._sessions[session] = len(self._sessions) % len(self.handles)
        return rank

    def end_sessions(self) -> None:
        """Every engine forgets its sessions' kept KV (a rollout of episodes is over)."""
        self._sessions.clear()
        self.all("end_sessions")

    def release_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Every engine frees the memory of `tags`; returns once all of it is free."""
        self.all("release_memory", list(tags))
        self._released = [t for t in MEMORY_TAGS if t in self._released or t in tags]

    def resume_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Every engine brings the memory of `tags` back."""
        self.all("resume_memory", list(tags))
        self._released = [t for t in self._released if t not in tags]

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Send one bucket of HF-named CPU tensors to every engine (the object store carries it once)."""
        import ray

        ref = ray.put(named_tensors)
        self.wait(
            [(r, h.update_weights_from_tensors.remote(ref)) for r, h in enumerate(self.handles)], "update"
        )

    def weights_digest(self) -> list[list[float]] | None:
        """Per rank, the engine's `weights_digest()`; None when the engines have none (e.g. SGLang's)."""
        if not all(hasattr(h, "weights_digest") for h in self.handles):
            return None
        return self.wait(
            [(r, h.weights_digest.remote()) for r, h in enumerate(self.handles)], "weights_digest"
        )

    def weight_changes(self) -> dict[str, float] | None:
        """Engine rank 0's `weight_changes()` (every engine receives the same weights); None when the
        engines do not count (SGLang's)."""
        if not hasattr(self.handles[0], "weight_changes"):
            return None
        return self.wait([(0, self.handles[0].weight_changes.remote())], "weight_changes")[0]

    def weight_magnitudes(self) -> dict[str, Any] | None:
        """Engine rank 0's `weight_magnitudes()` (how large the loaded weights are, for their dtype's
        spacing); None when the engines do not say (SGLang's) or do not count changes."""
        if not hasattr(self.handles[0], "weight_magnitudes"):
            return None
        magnitudes = self.wait([(0, self.handles[0].weight_magnitudes.remote())], "weight_magnitudes")[0]
        return magnitudes or None

    def flush_cache(self) -> None:
        """Every engine drops its cached prefixes."""
        self.all("flush_cache")

    def health(self) -> list[bool]:
        """Per rank: True when the engine answered its health check in time, False when dead or stuck."""
        import ray

        refs: list[ObjectRef[bool]] = [h.health.remote() for h in self.handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready_ids = set(ready)
        healthy = []
        for ref in refs:
            if ref not in ready_ids:
                healthy.append(False)
                continue
            try:
                healthy.append(bool(ray.get(ref)))
            except Exception:
                healthy.append(False)
        return healthy

    # --- restarts ---------------------------------------------------------------------------------
    def restart(self, rank: int, error: Exception) -> None:
        """Start engine `rank` again on its bundle after `error` (its death), as the group's state says.

        Raises `error` itself when the group cannot start engines, and an `EngineError` naming
        the rank when its `max_restarts` are used up.
        """
        import ray

        if self.spawn is None or self.max_restarts == 0:
            raise error
        if self.restarts[rank] >= self.max_restarts:
            raise EngineError(
                rank,
                f"died again after {self.restarts[rank]} restarts (--max-engine-restarts "
                f"{self.max_restarts}); stopping: {_cause(error)}",
            ) from error
        self.restarts[rank] += 1
        logger.warning(
            "rollout engine rank %d died (%s); restarting it on its bundle (restart %d of at most %d)",
            rank,
            _cause(error),
            self.restarts[rank],
            self.max_restarts,
        )
        with contextlib.suppress(Exception):  # gone already
            ray.kill(self.handles[rank])
        handle = self.spawn(rank)
        try:
            ray.get(handle.max_context_len.remote(), timeout=self.startup_timeout_s)
        except Exception as exc:
            raise EngineError(rank, f"did not come back after a restart: {exc!r}") from exc
        self.handles[rank] = handle
        if self.on_restart is not None:
            self.on_restart(rank, handle)
        if self._released:
            self.wait([(rank, handle.release_memory.remote(list(self._released)))], "release_memory")

    def all(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every engine, an engine that died restarted and asked again; the answers in rank order."""
        results: dict[int, Any] = {}
        ranks = list(range(len(self.handles)))
        while ranks:
            calls = [(r, getattr(self.handles[r], method).remote(*args)) for r in ranks]
            done, died = self.gather(calls, method)
            results.update(done)
            for rank, error in died.items():
                self.restart(rank, error)
            ranks = sorted(died)
        return [results[r] for r in range(len(self.handles))]


def _one_line(err: BaseException) -> str:
    """Ray's reason for an actor's death in one line (its last line, without Ray's list of common causes)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = " ".join(" ".join(lines[-1:]).split()) if lines else type(err).__name__
    return reason.split(" Some common causes include:", 1)[0]


def _cause(error: Exception) -> str:
    return str(error).split(": ", 1)[-1]


def create_engine_group(
    hf_dir: str,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_engine: float,
    num_cpus_per_engine: float = 0.25,
    engine: EngineKind = "embedded",
    options: EngineOptions | None = None,
    max_restarts: int = 0,
) -> EngineGroup:
    """Start one engine actor per bundle of `placement_group` (rank r on `bundle_indices[r]`).

    `num_gpus_per_engine` is the engine's share of its bundle's GPU (e.g. 0.2 next to an
    actor rank and a critic rank). Waits until every engine has loaded its model
    (`options.startup_timeout_s`); a failing engine is named by rank and all are killed.
    `max_restarts`: how often each engine that dies later is started again on its bundle.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = options or EngineOptions()
    if not bundle_indices:
        raise ValueError("create_engine_group: bundle_indices is empty; give one bundle per engine")
    if engine == "embedded":
        engine_cls: Any = EmbeddedEngine
    elif engine == "sglang":
        if not options.sglang_urls:
            require_sglang()
        elif len(options.sglang_urls) != len(bundle_indices):
            raise ValueError(
                f"EngineOptions.sglang_urls has {len(options.sglang_urls)} URLs for {len(bundle_indices)} "
                "rollout bundles; give one URL per bundle"
            )
        engine_cls = SGLangEngine
    else:
        raise ValueError(f"engine={engine!r}: choose 'embedded' or 'sglang'")

    remote_cls = ray.remote(engine_cls)

    def spawn(rank: int) -> Any:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_indices[rank]
        )
        actor_options: dict[str, Any] = {
            "num_gpus": num_gpus_per_engine,
            "num_cpus": num_cpus_per_engine,
            "scheduling_strategy": strategy,
        }
        if engine == "embedded" and options.kv_cache_backend == "torch_memory_saver":
            from tandem.lifecycle import torch_memory_saver_env  # its LD_PRELOAD hook, from the start

            actor_options["runtime_env"] = {"env_vars": torch_memory_saver_env()}
        if engine == "embedded":
            return remote_cls.options(**actor_options).remote(hf_dir, options)
        return remote_cls.options(**actor_options).remote(hf_dir, options, rank=rank)

    handles = [spawn(rank) for rank in range(len(bundle_indices))]
    group = EngineGroup(
        handles,
        max_context_len=0,
        timeout_s=options.startup_timeout_s,
        spawn=spawn,
        max_restarts=0,  # an engine that dies while starting is named, not restarted
        startup_timeout_s=options.startup_timeout_s,
    )
    try:
        lengths = group.all("max_context_len")
    except BaseException:
        group.shutdown()
        raise
    group.timeout_s = options.request_timeout_s
    group.max_context_len = min(int(n) for n in lengths)
    group.max_restarts = max_restarts
    return group
