"""User code that is not `async` (environments, tools, custom generate functions), run off the
event loop on daemon threads of our own.

Not on asyncio's default executor, for two reasons. Its threads are few (`min(32, cores + 4)`):
plain custom generate functions, each blocked in `generate_blocking` until a batch of every live
episode goes out, would fill it and wait forever for episodes that never got a thread. And
they are joined at the end: `asyncio.run` waits up to five minutes for a tool that never
returns, and the interpreter's exit waits for it forever. A call past its timeout is left
behind on its daemon thread; whatever it returns later is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DaemonWorker", "in_daemon_thread"]


class DaemonWorker:
    """One daemon thread that runs the calls given to it in order (an environment's calls stay on
    one thread, as libraries that keep per-thread state expect), until `stop`."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any, Any] | None]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the thread, after the calls before it; its result, or its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._calls.put((fn, args, loop, future))
        return await future

    def stop(self) -> None:
        """The thread ends after the calls already given (a call that hangs keeps it, as a daemon)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args, loop, future = call
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except Exception as exc:
                error = exc
            except BaseException as exc:  # SystemExit and the like: the call's failure, not the run's
                error = RuntimeError(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(RuntimeError):  # the event loop closed: nobody waits for this call
                loop.call_soon_threadsafe(_settle, future, result, error)


async def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "tandem-call") -> Any:
    """`fn(*args)` on a daemon thread of its own; its result, or its exception."""
    worker = DaemonWorker(name)
    try:
        return await worker.run(fn, *args)
    finally:
        worker.stop()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled: its caller timed out
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
