"""A group of rollout engines, one Ray actor per rollout bundle: prompts split across them, results in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from ._options import EngineOptions
from ._protocol import MEMORY_TAGS, Generation, MemoryTag, SamplingParams

EngineKind = Literal["embedded", "sglang"]

# Seeds derived per rank stay below 2**62 (torch generators take 64-bit seeds).
_SEED_MOD = 2**62
_SEED_STRIDE = 1_000_003


class EngineError(RuntimeError):
    """An engine died, timed out, or failed; the message names its rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rollout engine rank {rank}: {message}")
        self.rank = rank


def derive_seed(seed: int, rank: int) -> int:
    """Engine `rank`'s seed for a group-level `seed`: distinct per rank, the same on every run."""
    return (seed * _SEED_STRIDE + rank + 1) % _SEED_MOD


def split_contiguous(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous `(lo, hi)` slices of `range(n)`, sizes differing by at most one, larger first."""
    base, extra = divmod(n, parts)
    slices, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        slices.append((lo, hi))
        lo = hi
    return slices


class EngineGroup:
    """The rollout engines of a run, in rank order; what the driver generates with.

    Every call waits at most `timeout_s` for each engine and raises an `EngineError`
    naming the rank of an engine that died, failed or did not answer in time.

    Args:
        handles: Ray actor handles of the engines (rank order), each serving `RolloutEngine`.
        max_context_len: the engines' context (prompt + response tokens).
        timeout_s: seconds to wait for an engine's answer.
    """

    def __init__(self, handles: Sequence[Any], *, max_context_len: int, timeout_s: float) -> None:
        if not handles:
            raise ValueError("EngineGroup needs at least one engine handle")
        self.handles: list[Any] = list(handles)
        self.max_context_len = max_context_len
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        return len(self.handles)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One `Generation` per prompt, in input order; engine r gets the r-th contiguous chunk.

        With `params.seed`, engine r samples with `derive_seed(seed, r)`, so the same
        prompts, seed and number of engines reproduce the same samples.
        """
        for i, prompt in enumerate(prompts):
            if len(prompt) > self.max_context_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, longer than the engines' context of "
                    f"{self.max_context_len} tokens (EngineOptions.max_context_len)"
                )
        chunks = split_contiguous(len(prompts), len(self.handles))
        calls = []
        for rank, (lo, hi) in enumerate(chunks):
            if hi == lo:
                continue
            rank_params = params
            if params.seed is not None:
                rank_params = dataclasses.replace(params, seed=derive_seed(params.seed, rank))
            chunk = [list(p) for p in prompts[lo:hi]]
            calls.append((rank, self.handles[rank].generate.remote(chunk, rank_params)))
        results: list[Generation] = []
        for chunk_results in self._wait(calls, "generate"):
            results.extend(chunk_results)
        return results

    def release_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Every engine frees the memory of `tags`; returns once all of it is free."""
        self._all("release_memory", list(tags))

    def resume_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Every engine brings the memory of `tags` back."""
        self._all("resume_memory", list(tags))

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Send one bucket of HF-named CPU tensors to every engine (the object store carries it once)."""
        import ray

        ref = ray.put(named_tensors)
        self._wait(
            [(r, h.update_weights_from_tensors.remote(ref)) for r, h in enumerate(self.handles)], "update"
        )

    def weights_digest(self) -> list[list[float]] | None:
        """Per rank, the engine's `weights_digest()`; None when the engines have none (e.g. SGLang's)."""
        if not all(hasattr(h, "weights_digest") for h in self.handles):
            return None
        return self._wait(
            [(r, h.weights_digest.remote()) for r, h in enumerate(self.handles)], "weights_digest"
        )

    def flush_cache(self) -> None:
        """Every engine drops its cached prefixes."""
        self._all("flush_cache")

    def health(self) -> list[bool]:
        """Per rank: True when the engine answered its health check in time, False when dead or stuck."""
        import ray

        refs = [h.health.remote() for h in self.handles]
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

    def shutdown(self) -> None:
        """Stop every engine (shutdown hook first, when it answers in time), then kill its actor."""
        import ray

        refs = []
        for h in self.handles:
            try:
                refs.append(h.shutdown.remote())
            except Exception:  # the handle's class has no shutdown, or the actor is gone
                continue
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, 30.0))
        for h in self.handles:
            try:
                ray.kill(h)
            except Exception:  # already dead
                continue

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._wait([(r, getattr(h, method).remote(*args)) for r, h in enumerate(self.handles)], method)

    def _wait(self, calls: list[tuple[int, Any]], what: str) -> list[Any]:
        """The results of `calls` ((rank, ref) pairs) in order; an `EngineError` naming the first failed rank."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready_ids = set(ready)
        # An error from a finished engine says more than a timeout of another: report those first.
        results: list[Any] = []
        late: list[int] = []
        for rank, ref in calls:
            if ref not in ready_ids:
                late.append(rank)
                results.append(None)
                continue
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
            except RayActorError as err:
                raise EngineError(rank, f"{what} failed: the engine's actor died ({err})") from err
            except RayTaskError as err:
                cause = err.cause if err.cause is not None else err
                raise EngineError(rank, f"{what} failed: {cause!r}") from err
            except GetTimeoutError as err:
                raise EngineError(rank, f"{what} did not answer within {self.timeout_s:g} s") from err
        if late:
            raise EngineError(
                late[0],
                f"{what} did not answer within {self.timeout_s:g} s (EngineOptions.request_timeout_s); "
                f"ranks not answering: {late}",
            )
        return results


def create_engine_group(
    hf_dir: str,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_engine: float,
    num_cpus_per_engine: float = 0.25,
    engine: EngineKind = "embedded",
    options: EngineOptions | None = None,
) -> EngineGroup:
    """Start one engine actor per bundle of `placement_group` (rank r on `bundle_indices[r]`).

    `num_gpus_per_engine` is the engine's share of its bundle's GPU (e.g. 0.2 next to an
    actor rank and a critic rank). Waits until every engine has loaded its model
    (`options.startup_timeout_s`); a failing engine is named by rank and all are killed.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = options or EngineOptions()
    if not bundle_indices:
        raise ValueError("create_engine_group: bundle_indices is empty; give one bundle per engine")
    if engine == "embedded":
        from ._embedded import EmbeddedEngine

        engine_cls: Any = EmbeddedEngine
    elif engine == "sglang":
        from ._sglang import SGLangEngine, require_sglang

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
    handles = []
    for rank, bundle in enumerate(bundle_indices):
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle
        )
        actor_options: dict[str, Any] = {
            "num_gpus": num_gpus_per_engine,
            "num_cpus": num_cpus_per_engine,
            "scheduling_strategy": strategy,
        }
        if engine == "embedded":
            handles.append(remote_cls.options(**actor_options).remote(hf_dir, options))
        else:
            handles.append(remote_cls.options(**actor_options).remote(hf_dir, options, rank=rank))
    group = EngineGroup(handles, max_context_len=0, timeout_s=options.startup_timeout_s)
    try:
        lengths = group._all("max_context_len")
    except BaseException:
        group.shutdown()
        raise
    group.timeout_s = options.request_timeout_s
    group.max_context_len = min(int(n) for n in lengths)
    return group
