"""One-rank reloadable groups answer their collectives in the process, exactly as a real one-rank group does.

A world of one gloo process: every collective of torch.distributed's API runs
on a local group (`local_single_rank=True`, the default) and on a real
one-rank gloo group with the same inputs; the outputs must be equal, and the
local group must never reach its inner group's backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.lifecycle import ReloadableProcessGroup, destroy_all, forget_all, reload_all, reloadable_new_group


@pytest.fixture(scope="module")
def groups() -> Iterator[tuple[ReloadableProcessGroup, ReloadableProcessGroup]]:
    """(local, real): two one-rank groups of a one-process gloo world."""
    assert not dist.is_initialized()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        local = reloadable_new_group([0])
        real = reloadable_new_group([0], local_single_rank=False)
        yield local, real
    finally:
        dist.destroy_process_group()
        forget_all()


def _no_backend(group: ReloadableProcessGroup) -> Callable[[], None]:
    """Make the inner group's collectives fail, so that a local group provably never reaches them."""
    inner = group.inner

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            if name in (
                "allreduce",
                "allgather",
                "broadcast",
                "barrier",
                "_allgather_base",
                "all_gather_single",
            ):
                raise AssertionError(f"the local group reached its inner group's {name}")
            return getattr(inner, name)

    object.__setattr__(group, "_rpg_inner", Refusing())

    def restore() -> None:
        object.__setattr__(group, "_rpg_inner", inner)

    return restore


# torch renamed the tensor gathers and reduce-scatters (the older names warn since 2.12).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=3)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.int64])


def _tensor(shape: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _collectives(group: Any, x: torch.Tensor) -> dict[str, Any]:
    """Every collective of torch.distributed's API on `group` (one rank), each on its own copy of `x`."""
    out: dict[str, Any] = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        t = x.clone()
        dist.all_reduce(t, op=op, group=group)
        out[f"all_reduce {op}"] = t
    t = x.clone()
    dist.all_reduce(t, group=group, async_op=True).wait()
    out["all_reduce async"] = t
    t = x.clone()
    dist.reduce(t, dst=0, group=group)
    out["reduce"] = t
    t = x.clone()
    dist.broadcast(t, src=0, group=group)
    out["broadcast"] = t
    gathered = [torch.zeros_like(x)]
    dist.all_gather(gathered, x, group=group)
    out["all_gather"] = gathered[0]
    flat = torch.zeros_like(x)
    _ALL_GATHER(flat, x, group=group)
    out["all_gather tensor"] = flat
    rs = torch.zeros_like(x)
    _REDUCE_SCATTER(rs, x, group=group)
    out["reduce_scatter tensor"] = rs
    a2a = torch.zeros_like(x)
    dist.all_to_all_single(a2a, x, group=group)
    out["all_to_all_single"] = a2a
    gathered = [torch.zeros_like(x)]
    dist.gather(x, gathered, dst=0, group=group)
    out["gather"] = gathered[0]
    scattered = torch.zeros_like(x)
    dist.scatter(scattered, [x], src=0, group=group)
    out["scatter"] = scattered
    ts = [x.clone(), x.clone() * 2]
    with dist._coalescing_manager(group, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=group, async_op=True)
    cm.wait()
    out["coalesced all_reduce"] = ts
    objects: list[Any] = [None]
    dist.all_gather_object(objects, {"x": x.tolist()}, group=group)
    out["all_gather_object"] = objects
    objs: list[Any] = [x.tolist()]
    dist.broadcast_object_list(objs, src=0, group=group)
    out["broadcast_object_list"] = objs
    dist.barrier(group=group)
    return out


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16))
def test_a_local_group_answers_every_collective_as_a_real_one_rank_group(
    groups: tuple[ReloadableProcessGroup, ReloadableProcessGroup],
    shape: list[int],
    dtype: torch.dtype,
    seed: int,
) -> None:
    local, real = groups
    assert local.local and not real.local
    x = _tensor(shape, dtype, seed)
    expected = _collectives(real, x)
    restore = _no_backend(local)
    try:
        got = _collectives(local, x)
    finally:
        restore()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
            assert torch.equal(value, x), f"{name}: one rank's collective is the identity"
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(got[name], value, strict=True)), name
        else:
            assert got[name] == value, name


def test_premul_sum_scales_and_sends_and_receives_have_no_peer(
    groups: tuple[ReloadableProcessGroup, ReloadableProcessGroup],
) -> None:
    local, _ = groups
    # PREMUL_SUM scales even over one rank: the local group hands it to the real backend.
    calls: list[str] = []
    inner = local.inner

    class Recording:
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            calls.append("allreduce")
            for t in tensors:
                t.mul_(3.0)  # what a premultiplied sum over one rank gives with the factor 3
            return Done()

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    class Done:
        def wait(self) -> bool:
            return True

    object.__setattr__(local, "_rpg_inner", Recording())
    try:
        t = torch.ones(3)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist._make_nccl_premul_sum(3.0)  # what a scaled gradient sum asks for
        local.allreduce([t], opts).wait()
        assert calls == ["allreduce"] and torch.equal(t, torch.full((3,), 3.0))
        t = torch.ones(3)
        local.allreduce([t], dist.AllreduceOptions()).wait()  # SUM: the identity, in the process
        assert calls == ["allreduce"] and torch.equal(t, torch.ones(3))
    finally:
        object.__setattr__(local, "_rpg_inner", inner)
    with pytest.raises(ValueError, match="no other rank"):
        local.send([torch.ones(1)], 0, 0)


def test_local_groups_stay_through_destroy_all_and_real_ones_are_torn_down(
    groups: tuple[ReloadableProcessGroup, ReloadableProcessGroup],
) -> None:
    local, real = groups
    destroy_all()
    try:
        assert local.alive and not real.alive
        t = torch.tensor([2.0])
        dist.all_reduce(t, group=local)  # still answers: it never had a communicator
        assert t.item() == 2.0
        destroy_all(keep_single_rank=True)  # nothing left to tear down
    finally:
        reload_all()
    assert local.alive and real.alive and local.local and not real.local
    assert "local" in repr(local) and "local" not in repr(real)


def test_local_needs_one_rank() -> None:
    class TwoRanks:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match="local=True needs a group of one rank"):
        ReloadableProcessGroup(TwoRanks(), local=True)  # type: ignore[arg-type]
