"""Failed episodes: each one logged and counted; past `--max-env-failures` in a run, the run stops.

An episode fails when its environment (or a custom generate function) raises, returns the
wrong types, or does not answer within `--env-timeout`. The step goes on without it (it
trains nothing), the failure is written to `RUN_DIR/logs/episodes/` (the environment, the
sample, the exception with its traceback, the transcript so far) and counted
(`episodes/failed`). Once more episodes have failed in the run than `--max-env-failures`,
`TooManyEnvFailures` stops it, naming the environment, the last failed sample and its log.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tandem.ppo.rollout.episodes.environment import EpisodeSample
from tandem.ppo.rollout.episodes.trajectory import Episode

__all__ = ["EnvFailures", "TooManyEnvFailures"]


class TooManyEnvFailures(RuntimeError):
    """More episodes failed in the run than `--max-env-failures` allows."""


class EnvFailures:
    """Counts and logs the run's failed episodes (see the module docstring)."""

    def __init__(
        self, *, environment: str, limit: int, log_dir: Path | None, flag: str = "--env-path"
    ) -> None:
        self.environment = environment
        self.flag = flag
        self.limit = limit
        self.log_dir = log_dir
        self.total = 0

    def record(self, label: str, episodes: Sequence[Episode], samples: Sequence[EpisodeSample]) -> int:
        """Log and count the failed ones of `episodes` (of rollout `label`); their number. Raises
        `TooManyEnvFailures` once the run's failures exceed the limit."""
        failed = [(e, s) for e, s in zip(episodes, samples, strict=True) if e.failed]
        last_log: Path | None = None
        for episode, sample in failed:
            self.total += 1
            last_log = self._write(label, episode, sample)
        if failed and self.total > self.limit:
            episode, sample = failed[-1]
            where = f"; its log: {last_log}" if last_log is not None else ""
            first_line = (episode.failure or "").strip().splitlines()
            raise TooManyEnvFailures(
                f"{self.flag} {self.environment}: {self.total} episodes failed in this run, more than "
                f"--max-env-failures {self.limit}; the last: sample {sample.index} "
                f"(prompt {sample.prompt!r}, label {sample.label!r}){where}: "
                f"{first_line[-1] if first_line else 'no message'}"
            )
        return len(failed)

    def _write(self, label: str, episode: Episode, sample: EpisodeSample) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{label}_sample{sample.index}.log"
        described = {
            "environment": self.environment,
            "sample": {
                "index": sample.index,
                "seed": sample.seed,
                "prompt": sample.prompt,
                "messages": sample.messages,
                "label": sample.label,
                "metadata": sample.metadata,
            },
        }
        path.write_text(
            json.dumps(described, indent=2, default=repr)
            + "\n\n"
            + (episode.failure or "")
            + "\n\ntranscript:\n"
            + "\n".join(json.dumps(m, default=repr) for m in episode.transcript)
            + "\n"
        )
        return path
