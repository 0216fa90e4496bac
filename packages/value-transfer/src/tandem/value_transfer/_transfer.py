"""Packing a rank's values into the object store and unpacking them on another rank."""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch
from torch import Tensor

from tandem.value_transfer import _arguments as arguments
from tandem.value_transfer._box import Box
from tandem.value_transfer._packed import PackedValues, assemble
from tandem.value_transfer._sample_routing import IndexedValues, SampleGather


def pack_values(values: Sequence[Tensor]) -> Box[PackedValues]:
    """Put one rank's per-sample values into the object store, for another rank to unpack.

    Detaches the tensors, moves them to CPU in one copy and makes one `ray.put`.
    Tensors may have different lengths (and shapes); they must share a dtype. An
    empty sequence (a rank with no samples) is fine.
    """
    return Box.put(PackedValues.from_tensors(values))


def pack_indexed_values(values: Sequence[Tensor], sample_indices: Sequence[int]) -> IndexedValues:
    """`pack_values`, keyed by the global sample index of each value (for `route_by_sample`)."""
    values = arguments.tensor_list("values", values)
    indices = arguments.index_list("sample_indices", sample_indices, unique=True)
    if len(values) != len(sample_indices):
        raise ValueError(
            f"values has {len(values)} tensors but sample_indices has {len(sample_indices)} "
            "entries; give one global sample index per value"
        )
    return IndexedValues(values=pack_values(values), sample_indices=indices)


def unpack_values(
    payload: Box[PackedValues] | SampleGather,
    device: torch.device | str,
    *,
    sample_indices: Sequence[int] | None = None,
) -> list[Tensor]:
    """Fetch this rank's values (one `ray.get`) and copy them to `device`, one tensor per sample.

    Args:
        payload: what `route_per_rank` (a `Box` from `pack_values`) or `route_by_sample`
            (a `SampleGather`) gave this rank. A `Box` of a plain list of tensors (the
            form `Box(ray.put([v.cpu() for v in values]))`) is accepted too, though
            slower to pickle.
        device: where the values are needed. To a CUDA device the copy is one
            non-blocking transfer on the current stream.
        sample_indices: this rank's global sample indices in its order, to check the
            payload against: the count for a `Box`, the indices for a `SampleGather`.

    Returns:
        The values in the payload's order; tensors share one buffer on `device`.

    Raises:
        ValueError: `sample_indices` does not match the payload, or `device` is not
            'cpu' or an available CUDA device.
        TypeError: an argument (or the boxed object) has the wrong type.
    """
    if not isinstance(payload, Box | SampleGather):
        raise TypeError(
            f"payload must be a Box (from pack_values) or a SampleGather (from route_by_sample), "
            f"got {arguments.type_name(payload)}"
        )
    device = arguments.device("device", device)
    if sample_indices is not None:
        sample_indices = arguments.index_list("sample_indices", sample_indices)
    if isinstance(payload, SampleGather):
        if sample_indices is not None and tuple(sample_indices) != payload.sample_indices:
            raise ValueError(
                f"sample_indices: this rank's batch has samples {list(sample_indices)[:10]} "
                f"({len(sample_indices)}) but the values were routed for {list(payload.sample_indices)[:10]} "
                f"({len(payload.sample_indices)}); route_by_sample must get the actor's own split"
            )
        sources = ray.get([box.ref for box in payload.sources]) if payload.sources else []
        for packed in sources:
            _check_packed(packed)
        for i, (s, p) in enumerate(payload.picks):
            if p >= len(sources[s]):
                raise ValueError(
                    f"payload: pick {i} asks for sample {p} of source {s}, which holds {len(sources[s])}; "
                    "build the SampleGather with route_by_sample"
                )
        return assemble(sources, payload.picks, device)

    content = payload.get()
    if isinstance(content, list | tuple):  # a Box of plain CPU tensors
        tensors = arguments.tensor_list("payload (the boxed list)", content)
        values = [t.to(device, non_blocking=True) for t in tensors]
    else:
        _check_packed(content)
        values = assemble([content], [(0, p) for p in range(len(content))], device)
    if sample_indices is not None and len(values) != len(sample_indices):
        raise ValueError(
            f"sample_indices: this rank's batch has {len(sample_indices)} samples but the payload "
            f"carries {len(values)} values; critic and actor must split the batch alike "
            "(else route with route_by_sample)"
        )
    return values


def _check_packed(content: object) -> None:
    if not isinstance(content, PackedValues):
        raise TypeError(
            f"payload: the boxed object is a {type(content).__name__}, not PackedValues; box values with pack_values"
        )
