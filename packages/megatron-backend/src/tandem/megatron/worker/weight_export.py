"""The actor's weights to the rollout engines: what an engine takes, and one rank's share of the sending.

`TrainWorker.update_weights` brings the weights back when they sleep and calls
`send_weights` on every rank (the export gathers over TP and PP); this module only
exports and sends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from tandem.megatron.models.hf_weights import export_hf_weights, export_lora_adapters, send_chunk
from tandem.megatron.worker._trainee import Trainee

__all__ = ["WeightReceiver", "send_weights"]


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout engine that takes HF-named weights in chunks (`update_weights`'s target; with
    `adapters=True` it also needs `update_adapter_from_tensors(named_tensors, scaling=...)`).

    A Ray actor handle whose class has this method works too (the worker calls
    `.remote` and waits); it then receives CPU tensors.
    """

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> Any:
        """Load these tensors (full, HF-named) into the engine's model."""
        ...


def send_weights(
    trainee: Trainee,
    engines: Sequence[Any],
    pack: Callable[[Any], Any] | None,
    *,
    rank: int,
    chunk_bytes: int,
    adapters: bool = False,
) -> int:
    """Export the model's weights HF-named in chunks (with `adapters`, a LoRA model's adapters alone) and
    send this rank's share: with `pack`, `pack(chunk)` to engine `rank`; without, rank 0 sends CPU copies
    to every engine. Every rank of the model calls it. Returns the number of chunks."""
    if adapters:
        assert trainee.lora is not None
        exported = export_lora_adapters(trainee.module, trainee.spec, trainee.lora, chunk_bytes)
        how: dict[str, Any] = {"method": "update_adapter_from_tensors", "scaling": trainee.lora.scaling}
    else:
        exported = export_hf_weights(trainee.module, trainee.spec, chunk_bytes)
        how = {}
    chunks = 0
    for named in exported:
        if pack is not None:
            send_chunk(engines[rank], named, pack, **how)
        elif rank == 0:
            for target in engines:
                send_chunk(target, named, **how)
        chunks += 1
    return chunks
