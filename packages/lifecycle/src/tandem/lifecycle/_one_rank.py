"""The collectives of a process group of one rank, answered in the process.

A reduction (sum, average, min, max, product, ...) of one contribution is that
contribution; a gather, scatter or all-to-all of one copies the one input to the
one output; a barrier of one returns. `OneRankCollectives` implements
`torch.distributed.ProcessGroup`'s collective methods that way (the list covers
the names of both the older and the newer torch releases), so a
`ReloadableProcessGroup` made with `local=True` never hands them to its backend,
and NCCL, which builds a communicator at a group's first collective, never
builds one. PREMUL_SUM scales even over one rank: it goes to the real group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Method = Callable[..., Any]


class DoneWork(dist.Work):
    """The handle of a collective that finished when it was called."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


def _tensors(x: torch.Tensor | Any) -> list[torch.Tensor]:
    """A tensor argument of `ProcessGroup`'s methods: one tensor or a sequence of them."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _firsts(lists: Any) -> list[torch.Tensor]:
    """`[[t], ...]` (one tensor per rank, one rank) or, in the convenience overloads, `[t, ...]`."""
    return [x if isinstance(x, torch.Tensor) else x[0] for x in lists]


def _copy(out: torch.Tensor, src: torch.Tensor) -> None:
    if out.data_ptr() != src.data_ptr():
        out.copy_(src.reshape(out.shape))


def _copy_each(outs: list[torch.Tensor], ins: list[torch.Tensor]) -> DoneWork:
    for out, inp in zip(outs, ins, strict=True):
        _copy(out, inp)
    return DoneWork(outs)


def _premul_sum(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a reduction's options (or op) ask for PREMUL_SUM, which scales even over one rank."""
    for a in (*args, *kwargs.values()):
        op = getattr(a, "reduceOp", a)
        if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)) and op == dist.ReduceOp.PREMUL_SUM:
            return True
    return False


# What each kind of collective does over one rank; the first arguments are those of
# the ProcessGroup method, the rest (options, op, root, timeout) change nothing.
def _identity(self: OneRankCollectives, tensors: Any, *args: Any, **kwargs: Any) -> DoneWork:
    return DoneWork(_tensors(tensors))


def _copy_one(
    self: OneRankCollectives, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any
) -> DoneWork:
    return _copy_each([output], [input])


def _copy_lists(self: OneRankCollectives, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> DoneWork:
    return _copy_each(list(outputs), list(inputs))


def _gather(self: OneRankCollectives, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> DoneWork:
    # outputs[i][rank] receives inputs[i] (or, in a convenience overload, [out] and inp)
    return _copy_each(_firsts(outputs), _tensors(inputs))


def _gather_coalesced(
    self: OneRankCollectives, output_lists: Any, inputs: Any, *args: Any, **kwargs: Any
) -> DoneWork:
    # output_lists[rank][i] receives rank's inputs[i]: one rank, one list
    (outs,) = output_lists
    return _copy_each(list(outs), list(inputs))


def _scatter(self: OneRankCollectives, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> DoneWork:
    # outputs[i] receives inputs[i][rank] (or, in a convenience overload, out and [inp])
    outs = _tensors(outputs)
    return _copy_each(outs, _firsts(inputs)[: len(outs)])


def _done(self: OneRankCollectives, *args: Any, **kwargs: Any) -> DoneWork:
    return DoneWork()


def _no_peer(self: OneRankCollectives, *args: Any, **kwargs: Any) -> DoneWork:
    raise ValueError("a process group of one rank has no other rank to send to or receive from")


def _unless_premul_sum(name: str, local: Method) -> Method:
    """A reduction `name`: `local` over one rank, the real group's own for PREMUL_SUM."""

    def method(self: OneRankCollectives, *args: Any, **kwargs: Any) -> Any:
        if _premul_sum(args, kwargs):
            return getattr(self._real(), name)(*args, **kwargs)
        return local(self, *args, **kwargs)

    method.__name__ = name
    return method


class OneRankCollectives:
    """`ProcessGroup`'s collectives for a group of one rank, in this process.

    `real` returns the real (inner) group, for what one rank cannot answer alone.
    """

    def __init__(self, real: Callable[[], Any]) -> None:
        self._real = real

    allreduce = _unless_premul_sum("allreduce", _identity)
    allreduce_coalesced = _unless_premul_sum("allreduce_coalesced", _identity)
    reduce = _unless_premul_sum("reduce", _identity)
    broadcast = _identity

    allgather = _gather
    gather = _gather
    allgather_coalesced = _gather_coalesced
    all_gather_single = _copy_one
    _allgather_base = _copy_one
    gather_single = _copy_one
    gather_into_tensor = _copy_one
    all_gather_single_coalesced = _copy_lists
    allgather_into_tensor_coalesced = _copy_lists

    scatter = _scatter
    reduce_scatter = _unless_premul_sum("reduce_scatter", _scatter)
    reduce_scatter_single = _unless_premul_sum("reduce_scatter_single", _copy_one)
    _reduce_scatter_base = _unless_premul_sum("_reduce_scatter_base", _copy_one)
    reduce_scatter_single_coalesced = _unless_premul_sum("reduce_scatter_single_coalesced", _copy_lists)
    reduce_scatter_tensor_coalesced = _unless_premul_sum("reduce_scatter_tensor_coalesced", _copy_lists)

    alltoall = _copy_lists
    all_to_all_single = _copy_one
    alltoall_base = _copy_one

    barrier = _done
    monitored_barrier = _done
    _start_coalescing = _done
    _end_coalescing = _done

    send = _no_peer
    recv = _no_peer
    recv_anysource = _no_peer


# The names a local ReloadableProcessGroup answers through OneRankCollectives.
COLLECTIVES = frozenset(
    name for name in vars(OneRankCollectives) if not name.startswith("__") and name != "_real"
)
