"""The distributed optimizer's state around a checkpoint (CPU, megatron-core's own `state_dict`).

On the GPU a model trains with megatron-core's `DistributedOptimizer`, whose loading template comes from its
own `state_dict()`: without Apex or Transformer Engine that reads the one step count of the torch
optimizer's per-parameter states and asserts there is exactly one. A process that has taken no step (every
resumed run) has none, so a stepped checkpoint did not load at all on the GPU; the CPU's plain optimizer
initialises its state itself. `allocate_optimizer_state` gives a fresh distributed optimizer zeroed state at
step 0 before the template is built, and leaves a stepped one as it is; a model that has not stepped saves
no optimizer state (`optimizer_has_state`). The GPU test of a fresh worker resuming is
tests/megatron/test_worker_gpu.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models._megatron_core import import_megatron_core
from tandem.megatron.worker.checkpoint import allocate_optimizer_state, optimizer_has_state

shapes = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=4)


def _adam_moments(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """megatron-core's `init_state_fn` for Adam: zeroed moments for each parameter without state."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def _distributed(params: list[torch.Tensor]) -> Any:
    """A megatron-core DistributedOptimizer around a torch Adam, with what `state_dict()` reads (its buffers
    and process groups, which only a GPU run builds, are not needed for it)."""
    import_megatron_core()
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if HAVE_APEX_OR_TE:
        pytest.skip("megatron-core found Apex or Transformer Engine: its state_dict reads no per-state step")
    optimizer = object.__new__(DistributedOptimizer)
    optimizer.optimizer = torch.optim.Adam(params, lr=1e-2)
    optimizer.config, optimizer.grad_scaler, optimizer.init_state_fn = None, None, _adam_moments
    return optimizer


@settings(max_examples=20, deadline=None)
@given(shapes=shapes)
def test_a_fresh_distributed_optimizer_gets_zeroed_state_at_step_0(shapes: list[list[int]]) -> None:
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    optimizer = _distributed(params)
    assert not optimizer_has_state(optimizer)
    with pytest.raises(AssertionError):  # what a resumed run met: megatron-core asserts one step count
        optimizer.state_dict()

    allocate_optimizer_state(optimizer)
    assert optimizer_has_state(optimizer)
    assert [g["step"] for g in optimizer.state_dict()["optimizer"]["param_groups"]] == [0.0]
    for p in params:
        state = optimizer.optimizer.state[p]
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == p.shape
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert state["step"].dim() == 0 and float(state["step"]) == 0.0


@settings(max_examples=10, deadline=None)
@given(shapes=shapes, steps=st.integers(1, 3))
def test_a_stepped_optimizer_is_left_as_it_is(shapes: list[list[int]], steps: int) -> None:
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    optimizer = _distributed(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.optimizer.step()
    before = {id(p): {k: v.clone() for k, v in optimizer.optimizer.state[p].items()} for p in params}
    tensors = {id(p): dict(optimizer.optimizer.state[p]) for p in params}

    allocate_optimizer_state(optimizer)
    for p in params:
        state = optimizer.optimizer.state[p]
        assert all(state[k] is tensors[id(p)][k] for k in state)  # the same tensors
        assert all(torch.equal(state[k], before[id(p)][k]) for k in state)  # with the same values
    assert [g["step"] for g in optimizer.state_dict()["optimizer"]["param_groups"]] == [float(steps)]


def test_the_plain_optimizer_is_left_to_initialise_itself() -> None:
    """The CPU's optimizer (not a distributed one) loads into empty state on its own: nothing is added."""

    class Plain:
        def __init__(self) -> None:
            self.optimizer = torch.optim.Adam([torch.randn(3, requires_grad=True)])
            self.init_state_fn = _adam_moments

    import_megatron_core()
    plain = Plain()
    allocate_optimizer_state(plain)
    assert not optimizer_has_state(plain)
