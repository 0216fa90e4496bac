"""The embedded engine's error, apart so that the engine's mixins raise it without importing the engine."""

from __future__ import annotations


class EngineMemoryReleasedError(RuntimeError):
    """The engine was asked to work while some of its memory is released."""
