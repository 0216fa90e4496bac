"""How a reward-model worker is built and run: the forward-only worker's options (`ForwardOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.ppo.rollout.forward import ForwardOptions


@dataclass(frozen=True)
class RewardModelOptions(ForwardOptions):
    """Options of a reward-model worker (`RewardModelWorker`) and of the group that drives them (`ForwardOptions`'
    fields: dtype, device, the token budget of a forward pass, where the sleeping weights go, the timeouts)."""
