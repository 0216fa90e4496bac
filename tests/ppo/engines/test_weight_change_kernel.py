"""The weight sync's counting copy as one Triton launch for many tensors (`_weight_change_kernel`)
against the torch path, and the change counter and the engine that use it.

On a CUDA host the kernel is compiled and runs on the GPU (a `gpu` test); elsewhere it runs in
Triton's interpreter, in the subprocess of tests/test_kernels_interpreted.py (here it skips).
The interpreter is slow: sizes stay small and hypothesis draws few examples.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from tandem.ppo.engines import EmbeddedEngine, EngineOptions
from tandem.ppo.engines._weight_changes import ChangeCounter, count_and_copy

from ..._triton_interpreter import INTERPRETED, patch_interpreter_numerics
from .test_weight_changes import assert_counts_of_hand_edits

pytestmark = [
    pytest.mark.triton_kernels,
    pytest.mark.gpu
    if torch.cuda.is_available() and not INTERPRETED
    else pytest.mark.skipif(
        not INTERPRETED, reason="no GPU: run in Triton's interpreter by tests/test_kernels_interpreted.py"
    ),
]

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
# No shrinking: in the interpreter it takes minutes; a failure reports the example as drawn.
FEW = settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
SIZES = [1, 3, 7, 8, 9, 64, 1000, 8193]  # 8193: two programs, the second with one element
WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _gpu_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETED:
        patch_interpreter_numerics(monkeypatch)  # fp32 -> bf16 rounds to nearest even, as on the GPU


def _carve(sizes: list[int], dtypes: list[torch.dtype], g: torch.Generator) -> list[torch.Tensor]:
    """Random tensors as views of one flat buffer a dtype, one after the other (as an IPC payload's):
    a size that is no multiple of 8 leaves the next one off 16-byte alignment."""
    flats = {
        d: torch.randn(sum(n for n, e in zip(sizes, dtypes, strict=True) if e == d), generator=g)
        for d in dtypes
    }
    buffers = {d: flat.to(d).to(DEVICE) for d, flat in flats.items()}
    offsets = dict.fromkeys(buffers, 0)
    views = []
    for n, d in zip(sizes, dtypes, strict=True):
        views.append(buffers[d][offsets[d] : offsets[d] + n])
        offsets[d] += n
    return views


def _moved(
    targets: list[torch.Tensor], source_dtypes: list[torch.dtype], g: torch.Generator
) -> list[torch.Tensor]:
    """Sources for the next sync: each target's values in its source dtype, about 30 % of them moved."""
    sources = []
    for target, dtype in zip(targets, source_dtypes, strict=True):
        source = target.to(dtype).clone()
        moved = torch.rand(target.numel(), generator=g) < 0.3
        source[moved.to(DEVICE)] += torch.randn(int(moved.sum()), generator=g).to(DEVICE, dtype)
        sources.append(source)
    return sources


@FEW
@given(
    layout=st.lists(
        st.tuples(
            st.sampled_from(SIZES), st.sampled_from(WEIGHT_DTYPES), st.sampled_from([None, torch.float32])
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**16),
)
@example(  # three dtype pairs (three launches), a size-1 tensor, a two-program one, both alignments
    layout=[
        (1, torch.bfloat16, None),
        (7, torch.bfloat16, torch.float32),
        (8193, torch.bfloat16, None),
        (64, torch.float32, None),
        (9, torch.bfloat16, None),
    ],
    seed=1,
)
def test_one_launch_copies_and_counts_as_the_torch_path_tensor_by_tensor(
    layout: list[tuple[int, torch.dtype, torch.dtype | None]], seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    targets = _as_one_buffer([torch.randn(n, generator=g).to(DEVICE, d) for n, d, _ in layout])
    # Two syncs: the second meets bits already set.
    _assert_one_launch_as_tensor_by_tensor(targets, [[s or d for _, d, s in layout]] * 2, g)


def _assert_one_launch_as_tensor_by_tensor(
    targets: list[torch.Tensor], syncs: list[list[torch.dtype]], g: torch.Generator
) -> None:
    """`copy_and_count` over all `targets` against `count_and_copy` on their clones one by one, after each
    sync (its sources' dtypes; the sources in one buffer a dtype): the values, the bitmask, the counts."""
    from tandem.ppo.engines._weight_change_kernel import copy_and_count

    reference = [t.clone() for t in targets]
    offsets = [
        0,
        *itertools.accumulate(math.ceil(t.numel() / 8) for t in targets),
    ]  # one bitmask, as the counter's
    bits = torch.zeros(offsets[-1], dtype=torch.uint8, device=DEVICE)
    ref_bits = bits.clone()
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    ref_counts = counts.clone()
    for dtypes in syncs:
        sources = _as_one_buffer(_moved(targets, dtypes, g))
        copy_and_count(list(zip(targets, sources, offsets[:-1], strict=True)), bits, counts)
        for i, (target, source) in enumerate(zip(reference, sources, strict=True)):
            count_and_copy(target, source, ref_bits[offsets[i] : offsets[i + 1]], ref_counts)
        for got, expected in zip(targets, reference, strict=True):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(bits, ref_bits)
        assert counts.tolist() == ref_counts.tolist()


def _as_one_buffer(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values as views of one flat buffer a dtype, in order (as an IPC payload holds them, and
    the fused decode the engine's q/k/v): a size that is no multiple of 8 leaves the next view off
    16-byte alignment, for the kernel's unaligned variant."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    views = list(tensors)
    for members in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in members])
        start = 0
        for i in members:
            views[i] = flat[start : start + tensors[i].numel()].view(tensors[i].shape)
            start += tensors[i].numel()
    return views


def _moved(targets: list[torch.Tensor], dtypes: list[torch.dtype], g: torch.Generator) -> list[torch.Tensor]:
    """Sources for the next sync: each target's values in `dtypes`, about 30 % of them moved."""
    sources = []
    for target, dtype in zip(targets, dtypes, strict=True):
        source = target.to(dtype, copy=True)
        moved = torch.rand(target.shape, generator=g) < 0.3
        source[moved.to(DEVICE)] += torch.randn(int(moved.sum()), generator=g).to(DEVICE, dtype)
        sources.append(source)
    return sources


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Weights of every kind the counter meets: two dtypes, a tied name, an integer buffer and a strided
    view (the last two counted by `count_and_copy`, one by one)."""
    g = torch.Generator().manual_seed(seed)
    embedding = torch.randn(5, 7, generator=g).to(DEVICE, torch.bfloat16)
    return {
        "embed": embedding,
        "head": embedding,
        "norm": torch.randn(9, generator=g).to(DEVICE),
        "steps": torch.arange(4, device=DEVICE),
        "strided": torch.randn(6, 4, generator=g).to(DEVICE, torch.bfloat16).t(),
        "one": torch.randn(1, generator=g).to(DEVICE, torch.float16),
    }


def test_the_counter_counts_with_one_launch_as_tensor_by_tensor() -> None:
    fused, plain = _weights(0), _weights(0)
    counters = [ChangeCounter(fused, DEVICE, fused=True), ChangeCounter(plain, DEVICE, fused=False)]
    names = ["embed", "norm", "steps", "strided", "one"]  # "head" is "embed"
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        sources = _moved(
            [fused[n] for n in names],
            [torch.float32, torch.float32, torch.int64, torch.bfloat16, torch.float16],
            g,
        )
        sources[1] = sources[1].cpu()  # a host tensor: moved to the device first
        for counter, weights in zip(counters, (fused, plain), strict=True):
            counter.copy_in_many([(weights[n], s) for n, s in zip(names, sources, strict=True)])
        assert counters[0].take() == counters[1].take()
        assert torch.equal(counters[0].bits, counters[1].bits)
        for name in names:
            assert torch.equal(
                fused[name].contiguous().view(torch.uint8), plain[name].contiguous().view(torch.uint8)
            ), name
    assert counters[0].take().changed_since_start > 0  # the syncs changed something to count


def test_the_engine_counts_with_the_kernel_as_by_hand(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.ppo.engines import _embedded

    monkeypatch.setattr(_embedded, "ChangeCounter", functools.partial(ChangeCounter, fused=True))
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device=DEVICE.type))
    assert engine._changes is not None and engine._changes._kernel is not None
    # On the CPU through an IPC payload (shared memory), as a sync from another process sends it; a CUDA
    # IPC payload cannot be opened by the process that made it, so on a GPU the tensors go as they are.
    assert_counts_of_hand_edits(engine, DEVICE.type, as_ipc=DEVICE.type == "cpu")


# On the GPU only: in the interpreter it takes half a minute (and the interpreted run allows no skip).
if not INTERPRETED:

    def test_one_launch_over_a_models_tensors_counts_as_the_torch_path() -> None:
        """Sizes of a small model's layers (many programs a tensor, hundreds in all), the targets apart and
        the sources in one buffer, in bfloat16 from bfloat16 and from float32: on the GPU, one launch each."""
        g = torch.Generator().manual_seed(0)
        shapes = [(151, 896), (896,), (128, 896), (4864, 896), (896, 4864), (3,), (257, 33)] * 4
        targets = [torch.randn(s, generator=g).to(DEVICE, torch.bfloat16) for s in shapes]
        syncs = [[torch.bfloat16] * len(targets), [torch.float32, torch.bfloat16] * (len(targets) // 2)]
        _assert_one_launch_as_tensor_by_tensor(targets, syncs, g)
