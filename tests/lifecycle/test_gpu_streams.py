"""On a CUDA host: a pinned-host tag resumed in the background is joined before it is read, and a
scratch tag comes back as zeros (the two ways a wake moves less than the whole state)."""

from __future__ import annotations

import pytest
import torch

from tandem.lifecycle import PinnedHostBackend

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (marker `gpu`)", allow_module_level=True)


def test_a_background_resume_is_complete_once_joined_and_overlaps_compute() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.randn(4096, 4096, device="cuda", generator=g)
    optimizer = torch.randn(256 * 2**20, device="cuda", generator=g)  # 1 GiB
    grads = torch.randn(2**20, device="cuda", generator=g)
    expected_weights, expected_optimizer = weights.clone(), optimizer.clone()
    backend = PinnedHostBackend()
    backend.register("weights", [weights])
    backend.register("grads", [grads], keep=False)
    backend.register("optimizer", [optimizer], resume_in_background=True)
    for cycle in range(3):
        backend.pause()
        assert optimizer.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
        backend.resume()
        # Queued, not waited for: the resume returned with the copy in flight.
        assert "optimizer" in backend._in_flight, cycle
        out = weights @ weights  # compute that does not read the optimizer state runs meanwhile
        backend.join("optimizer")
        assert "optimizer" not in backend._in_flight
        assert torch.equal(optimizer, expected_optimizer), cycle
        assert torch.equal(weights, expected_weights), cycle
        assert torch.equal(grads, torch.zeros_like(grads)), cycle
        assert torch.isfinite(out).all()
        optimizer.add_(1.0)  # the next cycle moves new bytes
        expected_optimizer.add_(1.0)
        grads.fill_(3.0)


def test_a_pause_joins_a_background_resume_first() -> None:
    optimizer = torch.arange(64 * 2**20, device="cuda", dtype=torch.float32)
    expected = optimizer.clone()
    backend = PinnedHostBackend()
    backend.register("optimizer", [optimizer], resume_in_background=True)
    backend.pause()
    backend.resume()
    backend.pause()  # without a join in between: the copy back must not be lost
    backend.resume()
    backend.join()
    assert torch.equal(optimizer, expected)


def test_a_frozen_tag_is_copied_to_the_host_once_and_freed_at_every_pause() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(256 * 2**20, device="cuda", generator=g)  # 1 GiB
    merged_view = base[: 2**20]
    expected = base.clone()
    backend = PinnedHostBackend()
    backend.register("base", [base], frozen=True)
    for cycle in range(3):
        allocated = torch.cuda.memory_allocated()
        backend.pause("base")
        assert base.untyped_storage().nbytes() == 0
        assert torch.cuda.memory_allocated() <= allocated - base.numel() * 4, cycle
        backend.resume("base")
        assert torch.equal(base, expected), cycle
        assert backend.copied_to_host("base") == base.numel() * 4, cycle
        merged_view.add_(1.0)  # a merge while awake: refreshed back from the host copy
        backend.refresh("base", [merged_view])
        assert torch.equal(base, expected), cycle
