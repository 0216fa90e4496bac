"""Many episodes in flight on the engines: their turns go out in batches, finished episodes leave.

Each episode is a coroutine of one event loop; when it needs the model's next turn it awaits
`TurnBatcher.generate`. A batch goes to the engines once every episode still running waits
for its turn (an episode in an environment step or a tool call holds the batch back until it
asks or ends; the environment's and the tools' timeouts bound that), so the engines see as
many sequences at once as there are episodes left, and an episode that ends simply stops
asking. Requests of one batch with different token budgets go out as one call per budget.
The engines' call runs on a thread, so the environments of other episodes are not held up
by it. Seeds: the `k`-th engine call of a rollout samples with `seed + 7919 k`, so a rollout
whose episodes ask in the same order samples the same tokens.

With `keep_kv`, each request names its episode as a session: the engine keeps the episode's KV
cache between its turns and prefills only what is new (`engines._sessions`; `--keep-episode-kv`),
and `close` has the engines forget them once the rollout is over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

from tandem.ppo.engines import Generation, SamplingParams

__all__ = ["TurnBatcher"]

_SEED_MOD = 2**62


class Generator(Protocol):
    """What samples the turns: the engine group (`EngineGroup.generate`)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]: ...


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future[Generation]
    session: str | None = None


class TurnBatcher:
    """Batches the model turns of `episodes` episodes running in one event loop (see the module docstring)."""

    def __init__(
        self, engines: Generator, params: SamplingParams, *, episodes: int, keep_kv: bool = False
    ) -> None:
        self.engines = engines
        self.keep_kv = keep_kv
        self.params = params
        self.live = episodes
        """Episodes that have not ended."""
        self.pending: list[_Request] = []
        self._flushing = False
        self.calls = 0
        """Engine calls so far."""
        self.seconds = 0.0
        """Wall seconds spent in the engines' calls."""
        self.batch_sizes: list[int] = []

    async def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, session: str | None = None
    ) -> Generation:
        """The model's next turn after `prompt_ids`, at most `max_new_tokens` tokens; `session`: the
        episode's, whose KV the engine keeps for its next turn (with `keep_kv`)."""
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(list(prompt_ids), int(max_new_tokens), future, session))
        self._maybe_flush()
        return await future

    def leave(self) -> None:
        """An episode ended: the batch no longer waits for it."""
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self.pending and not self._flushing and len(self.pending) >= self.live:
            self._flushing = True
            batch, self.pending = self.pending, []
            asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[_Request]) -> None:
        """Send `batch` to the engines; an engine's error reaches every episode of the batch."""
        try:
            for budget in sorted({r.max_new_tokens for r in batch}):
                requests = [r for r in batch if r.max_new_tokens == budget]
                params = dataclasses.replace(self.params, max_new_tokens=budget, seed=self._next_seed())
                start = time.perf_counter()
                prompts = [r.prompt_ids for r in requests]
                try:
                    if self.keep_kv:
                        sessions = [r.session for r in requests]
                        generations = await asyncio.to_thread(
                            self.engines.generate,  # type: ignore[call-arg]
                            prompts,
                            params,
                            sessions,
                        )
                    else:
                        generations = await asyncio.to_thread(self.engines.generate, prompts, params)
                finally:
                    self.seconds += time.perf_counter() - start
                self.batch_sizes.append(len(requests))
                for request, generation in zip(requests, generations, strict=True):
                    request.future.set_result(generation)
        except Exception as exc:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
        finally:
            self._flushing = False
            self._maybe_flush()

    async def close(self) -> None:
        """The rollout is over: with `keep_kv`, the engines forget its sessions."""
        end = getattr(self.engines, "end_sessions", None)
        if self.keep_kv and callable(end):
            await asyncio.to_thread(end)

    def _next_seed(self) -> int | None:
        self.calls += 1
        if self.params.seed is None:
            return None
        return (self.params.seed + 7919 * self.calls) % _SEED_MOD
