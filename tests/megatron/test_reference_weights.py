"""`Trainee.reference_weights`: the reference weights are in the model inside the block, the trained ones
exactly after (also when the block raises), and the host keeps one copy, the reference's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.lifecycle import HostCopies, NoopBackend
from tandem.megatron.worker._trainee import Trainee


def _trainee(reference: bool = True) -> tuple[Trainee, torch.Tensor, list[torch.nn.Parameter]]:
    """A Trainee over a two-layer model whose weights view one flat buffer, as Megatron's DDP lays them out."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(module.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset : offset + n].copy_(p.detach().view(-1))
        p.data = flat[offset : offset + n].view(p.shape)
        offset += n
    buffer = SimpleNamespace(param_data=flat, params=params, grad_data=torch.zeros_like(flat))
    chunk = SimpleNamespace(module=module, buffers=[buffer], expert_parallel_buffers=[])
    refs = HostCopies(torch.full_like(p, float(i + 1)) for i, p in enumerate(params)) if reference else None
    trainee = Trainee(
        role="actor",
        config=None,  # type: ignore[arg-type]
        spec=None,  # type: ignore[arg-type]
        chunks=[chunk],
        optim=None,  # type: ignore[arg-type]
        device=torch.device("cpu"),
        backend=NoopBackend(),
        reference=refs,
    )
    return trainee, flat, params


def test_the_block_sees_the_reference_and_the_trained_weights_come_back_bit_identical() -> None:
    trainee, flat, params = _trainee()
    trained = flat.clone()
    x = torch.randn(5, 4)
    with trainee.reference_weights():
        for i, p in enumerate(params):
            assert torch.equal(p, torch.full_like(p, float(i + 1)))
        under_reference = trainee.module(x)
    assert torch.equal(flat, trained)
    # The forward inside the block ran the reference weights; the same forward now runs the trained ones.
    assert not torch.allclose(under_reference, trainee.module(x))
    # The reference copies are untouched by the swap: the next block sees them again.
    with trainee.reference_weights():
        assert torch.equal(params[0], torch.ones_like(params[0]))
    assert torch.equal(flat, trained)


def test_an_error_in_the_block_still_brings_the_trained_weights_back() -> None:
    trainee, flat, _ = _trainee()
    trained = flat.clone()
    with pytest.raises(ZeroDivisionError), trainee.reference_weights():
        raise ZeroDivisionError
    assert torch.equal(flat, trained)


def test_a_model_without_reference_weights_says_why() -> None:
    trainee, _, _ = _trainee(reference=False)
    with (
        pytest.raises(RuntimeError, match="use_kl_loss is off and kl_coef is 0"),
        trainee.reference_weights(),
    ):
        pass
