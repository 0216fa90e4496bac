"""The run's one typed config: `RunFields` (every flag of `ppo-driver train`) with its checks.

Construction never validates (so that a YAML file and flags can be merged first);
`validate()` (`checks`) checks the whole config before Ray starts, the workers'
rules by building their configs, and raises a `ValueError` that names the flag and
the fix.
"""

from __future__ import annotations

import dataclasses

from tandem.ppo.config.checks import check_config
from tandem.ppo.config.fields import RunFields

__all__ = ["PPOConfig"]


@dataclasses.dataclass(frozen=True)
class PPOConfig(RunFields):
    """Everything one PPO run needs: the train workers' fields plus the driver's (`RunFields`), and its checks."""

    def validate(self) -> None:
        """Check the whole config; a ValueError naming the flag and the fix otherwise (`checks`)."""
        check_config(self)
