"""LoRA adapters into the embedded engine: `update_adapter_from_tensors`, merged into the base exactly.

`AdapterUpdates` is a mixin of `EmbeddedEngine` (which sets the attributes it
declares). With `EngineOptions.adapter_sync` the engine's weights are its base
model: their host copy (the weights tag of its pinned-host backend, registered
`frozen`) is made once, before the first merge, and never again, so a release
only frees the weights and a resume copies the base back. A LoRA actor then
sends its adapters alone (`TrainWorker.update_weights(..., adapters=True)`:
PEFT's names without its prefix, `model.layers.3.self_attn.q_proj.lora_A.weight`
and `...lora_B.weight`, and the scaling), and the engine sets each adapted weight
to `merge_lora(base, A, B, scaling)`, from the base every time: a weight that
holds an older merge gets its base bytes back from the host copy first
(`refresh`), so no sync ever adds to the rounding of the one before.

With `EngineOptions.count_weight_changes` a sync's merges are counted against
what the engine sampled with before it (`ChangeCounter.copy_in` over the older
merge, made again from the base when a release took it away); merging back
after a release changes nothing the engine samples with, and is not counted.

The last adapters received are kept (on the host, a few MB); after a release
and a resume the weights are the base again, and the adapters are merged back
before the next generation (or fingerprint), so the engine's weights are as they
were, as `resume_memory` promises.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tandem.megatron.models.lora_spec import merge_lora, split_adapter_name

from ._errors import EngineMemoryReleasedError
from ._weight_updates import WeightUpdates
from ._weights import as_named_tensors

if TYPE_CHECKING:
    from tandem.lifecycle import PinnedHostBackend

WEIGHTS_TAG = "weights"


class AdapterUpdates(WeightUpdates):
    """LoRA adapters merged into the engine's base weights; see the module docstring."""

    _base_copy: PinnedHostBackend | None
    _adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    _merged: set[str]

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Copy HF-named full tensors into the model (`WeightUpdates`); they are the base from then on."""
        with self._lock:
            super().update_weights_from_tensors(named_tensors)
            self._new_base()

    def weights_digest(self) -> list[float]:
        """The weights' fingerprints (`WeightUpdates`), the kept adapters merged in."""
        with self._lock:
            if not self._lifecycle.asleep:
                self._merge_kept_adapters()
            return super().weights_digest()

    def update_adapter_from_tensors(self, named_tensors: Any, scaling: float) -> None:
        """Merge LoRA adapters (A and B of each adapted weight, in one call) into the base weights."""
        start = time.perf_counter()
        with self._lock:
            if self._base_copy is None:
                raise ValueError(
                    "update_adapter_from_tensors: this engine was not started for adapters "
                    "(EngineOptions.adapter_sync); send whole weights with update_weights_from_tensors"
                )
            if self._lifecycle.asleep:
                raise EngineMemoryReleasedError(
                    "update_adapter_from_tensors: the engine's weights are released; "
                    "call resume_memory(['weights']) first (sync order: weights, sync, kv_cache)"
                )
            named, opened = as_named_tensors(named_tensors, self.device)
            try:
                pairs = self._adapter_pairs(named)
                # Before the first merge: the weights are the base, and their host copy is made now.
                self._base_copy.retain(WEIGHTS_TAG)
                for weight, (a, b) in pairs.items():
                    previous = self._adapters.get(weight)
                    self._adapters[weight] = (a.to("cpu", copy=True), b.to("cpu", copy=True), float(scaling))
                    self._merge(weight, counted=True, previous=previous)
            finally:
                named.clear()
                opened.clear()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
                torch.cuda.ipc_collect()
            self._update_seconds += time.perf_counter() - start

    def _adapter_pairs(
        self, named: list[tuple[str, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        found: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            weight, matrix = split_adapter_name(name)
            found.setdefault(weight, {})[matrix] = tensor
        pairs = {}
        for weight, ab in found.items():
            if weight not in self._params_by_name:
                raise ValueError(f"update_adapter_from_tensors: {weight} is not a weight of the model")
            if set(ab) != {"A", "B"}:
                raise ValueError(
                    f"update_adapter_from_tensors: {weight} got only lora_{''.join(ab)}; A and B of a weight "
                    "come in the same call"
                )
            target = self._params_by_name[weight]
            rank = ab["A"].shape[0]
            if tuple(ab["A"].shape) != (rank, target.shape[1]) or tuple(ab["B"].shape) != (
                target.shape[0],
                rank,
            ):
                raise ValueError(
                    f"update_adapter_from_tensors: {weight} {tuple(target.shape)} cannot take A "
                    f"{tuple(ab['A'].shape)} and B {tuple(ab['B'].shape)}"
                )
            pairs[weight] = (ab["A"], ab["B"])
        return pairs

    def _merge(
        self,
        weight: str,
        *,
        counted: bool = False,
        previous: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> None:
        """Set `weight` to its base with its kept adapter merged in (its base bytes back first if merged).

        `counted`: a sync's merge, counted by the change counter against what the engine sampled
        with, the merge of `previous` (the adapters before) when a release left only the base.
        """
        assert self._base_copy is not None
        target = self._params_by_name[weight]
        counter = self._changes if counted else None
        with torch.no_grad():
            sampled_with = None
            if weight in self._merged:
                if counter is not None:
                    sampled_with = target.clone()
                self._base_copy.refresh(WEIGHTS_TAG, [target])
            elif counter is not None and previous is not None:
                sampled_with = merge_lora(target, *previous)
            a, b, scaling = self._adapters[weight]
            merged = merge_lora(target, a, b, scaling)
            if counter is None:
                target.copy_(merged)
            else:
                if sampled_with is not None:
                    target.copy_(sampled_with)
                counter.copy_in(target, merged)
        self._merged.add(weight)

    def _merge_kept_adapters(self) -> None:
        """Merge back the kept adapters that a release took out of the weights (before the weights are read)."""
        for weight in self._adapters.keys() - self._merged:
            self._merge(weight)

    def _adapters_released(self) -> None:
        """The weights were released: they come back as the base, with no adapter merged."""
        self._merged.clear()

    def _new_base(self) -> None:
        """Whole weights were loaded (`update_weights_from_tensors`): they are the base from now on."""
        if self._base_copy is not None:
            self._base_copy.invalidate(WEIGHTS_TAG)
        self._adapters.clear()
        self._merged.clear()
