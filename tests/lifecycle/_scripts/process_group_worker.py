"""One rank of the reloadable-process-group test (gloo): run by test_process_groups.py in 2 processes.

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment; prints
`OK <rank>` at the end and exits non-zero on any failed check.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tandem.lifecycle import (
    Lifecycle,
    PinnedHostBackend,
    ProcessGroupTornDownError,
    ReloadableProcessGroup,
    destroy_all,
    forget_all,
    reload_all,
    reloadable_groups,
    reloadable_new_group,
    reloadable_process_groups,
)

CYCLES = 5


def create_group(ranks: list[int], desc: str, backend: str | None = None) -> Any:
    """Megatron's parallel_state.create_group: keyword arguments to torch.distributed.new_group."""
    return torch.distributed.new_group(
        ranks=ranks, timeout=None, backend=backend, pg_options=None,
        use_local_synchronization=False, group_desc=desc,
    )  # fmt: skip


def check_collectives(group: Any, rank: int, world: int, tag: float) -> None:
    t = torch.tensor([rank + tag])
    dist.all_reduce(t, group=group)
    assert t.item() == sum(r + tag for r in range(world)), t
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=world - 1, group=group)
    assert b.item() == world - 1
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=group)
    assert [g[0].item() for g in gathered] == list(range(world))
    objects: list[object] = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "tag": tag}, group=group)
    assert objects == [{"rank": r, "tag": tag} for r in range(world)], objects
    dist.barrier(group=group)
    assert dist.get_rank(group) == rank and dist.get_world_size(group) == world
    assert dist.get_process_group_ranks(group) == list(range(world))


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    plain_new_group = dist.new_group

    # What initialize_model_parallel does, inside the patch.
    with reloadable_groups():
        tp = create_group(list(range(world)), "TENSOR_MODEL_PARALLEL_GROUP")
        dp_groups = [create_group([r], "DATA_PARALLEL_GROUP") for r in range(world)]  # one is not ours
        dp_gloo = create_group(list(range(world)), "DATA_PARALLEL_GROUP_GLOO", backend="gloo")
    with reloadable_groups(local_single_rank=False):  # one-rank groups with a communicator of their own
        cp_groups = [create_group([r], "CONTEXT_PARALLEL_GROUP") for r in range(world)]
    assert dist.new_group is plain_new_group, "the patch is undone"
    direct = reloadable_new_group(list(range(world)))

    assert isinstance(tp, ReloadableProcessGroup) and isinstance(direct, ReloadableProcessGroup)
    assert not isinstance(dp_gloo, ReloadableProcessGroup), "explicit gloo groups stay plain"
    dp, cp = dp_groups[rank], cp_groups[rank]
    assert isinstance(dp, ReloadableProcessGroup) and isinstance(cp, ReloadableProcessGroup)
    assert dp.local and not cp.local and not tp.local, "one-rank groups are local by default"
    assert all(g is dist.GroupMember.NON_GROUP_MEMBER for r, g in enumerate(dp_groups) if r != rank)
    assert all(g is dist.GroupMember.NON_GROUP_MEMBER for r, g in enumerate(cp_groups) if r != rank)
    assert reloadable_process_groups() == (tp, dp, cp, direct)

    class Layer:  # a module that cached its group at construction, as Megatron's layers do
        def __init__(self, group: Any) -> None:
            self.tp_group = group

    layer = Layer(tp)
    check_collectives(layer.tp_group, rank, world, 0.0)
    check_collectives(direct, rank, world, 0.5)

    for cycle in range(CYCLES):
        keep = cycle % 3 != 0  # one-rank groups kept, or torn down too (the default)
        destroy_all(concurrent=cycle % 2 == 0, keep_single_rank=keep)  # threads at once, or one by one
        destroy_all(keep_single_rank=keep)  # idempotent
        assert not tp.alive and not direct.alive
        assert cp.alive == keep, (cycle, cp)
        assert dp.alive, "a local group has no communicator to tear down"
        try:
            dist.all_reduce(torch.zeros(1), group=layer.tp_group)
        except ProcessGroupTornDownError:
            pass
        else:
            raise AssertionError("a collective on a torn-down group must fail clearly")
        assert dist.get_rank(tp) == rank and tp.size() == world  # queries still answer
        check_collectives(dp_gloo, rank, world, 9.0)  # the plain group is untouched
        reload_all()
        reload_all()  # idempotent
        check_collectives(layer.tp_group, rank, world, float(cycle + 1))
        check_collectives(direct, rank, world, float(cycle) + 0.5)
        for one_rank in (dp, cp):
            t = torch.tensor([3.0])
            dist.all_reduce(t, group=one_rank)
            assert t.item() == 3.0
            gathered = [torch.zeros(2)]
            dist.all_gather(gathered, torch.full((2,), 5.0), group=one_rank)
            assert gathered[0].tolist() == [5.0, 5.0]

    # The whole lifecycle with real process groups: sleep, a failed collective, wake, training state intact.
    flat = torch.arange(32, dtype=torch.float32) + rank
    views = [flat[:10], flat[10:]]
    backend = PinnedHostBackend()
    backend.register("weights", views)
    lifecycle = Lifecycle(backend, destroy_process_groups=destroy_all, reload_process_groups=reload_all)
    for _ in range(3):
        lifecycle.sleep()
        assert not tp.alive and flat.untyped_storage().nbytes() == 0
        lifecycle.wake_up()
        lifecycle.wake_up()  # awake: reload only
        assert torch.equal(flat, torch.arange(32, dtype=torch.float32) + rank)
        dist.all_reduce(views[0], group=tp)
        flat.copy_(torch.arange(32, dtype=torch.float32) + rank)

    # Tearing the job down works with reloadable groups alive and torn down, destroyed one by one or all.
    dist.destroy_process_group(direct)
    assert not direct.alive
    destroy_all()
    assert not cp.alive, "destroy_all tears groups of one rank down too by default"
    assert dp.alive, "except local ones"
    dist.destroy_process_group(tp)  # already torn down
    reload_all()  # revives both
    check_collectives(direct, rank, world, 7.0)
    dist.destroy_process_group()
    forget_all()
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()
