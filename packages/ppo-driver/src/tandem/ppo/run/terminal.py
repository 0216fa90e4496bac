"""What a command prints on the terminal: the `tandem` loggers' lines, passed through tqdm.

Only the `tandem` logger is configured (INFO, to stderr): third-party libraries keep
their own levels, so a run's terminal holds Tandem's lines, the progress bar and the
summary. While a command runs, log lines go through tqdm (`logging_redirect_tqdm`),
which writes them above the bar instead of through it, so the bar stays one line and
its last state is printed once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

__all__ = ["LOGGER_NAME", "configure_logging", "terminal_output"]

LOGGER_NAME = "tandem"
"""The logger every Tandem module logs under (`tandem.ppo.driver`, `tandem.megatron.worker`, ...)."""

LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"
"""One line per record: the time, the module, the message."""

DATE_FORMAT = "%H:%M:%S"
"""The time of day only: a run's lines are read while it runs."""


def configure_logging(level: int = logging.INFO) -> logging.Handler:
    """Give the `tandem` logger one stderr handler at `level` (idempotent); the handler.

    The root logger is left alone, so other libraries' INFO lines stay off the terminal.
    """
    tandem = logging.getLogger(LOGGER_NAME)
    for handler in tandem.handlers:
        if getattr(handler, "_tandem_terminal", False):
            tandem.setLevel(level)
            return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler._tandem_terminal = True  # type: ignore[attr-defined]
    tandem.addHandler(handler)
    tandem.setLevel(level)
    return handler


@contextlib.contextmanager
def terminal_output() -> Iterator[None]:
    """The `tandem` logger configured, and its lines written through tqdm while the block runs."""
    from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]

    configure_logging()
    with logging_redirect_tqdm(loggers=[logging.getLogger(LOGGER_NAME)]):
        yield
