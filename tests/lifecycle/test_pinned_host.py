"""PinnedHostBackend on CPU tensors: storages freed and restored bit-identically, views kept, errors clear."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.lifecycle import PinnedHostBackend


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of the storage behind `t` (NaN payloads included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _flat_model() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat parameter buffer and parameters viewing it, as Megatron's DDP lays them out."""
    flat = torch.randn(300)
    params = [flat[0:120].view(10, 12), flat[120:200].view(8, 10), flat[200:300]]
    return flat, params


def test_views_into_a_flat_buffer_see_the_restored_data_and_write_through() -> None:
    flat, params = _flat_model()
    before = [p.clone() for p in params]
    backend = PinnedHostBackend()
    backend.register("weights", params)

    backend.pause("weights")
    assert flat.untyped_storage().nbytes() == 0, "the storage is really freed"
    assert backend.paused_tags == {"weights"}
    backend.resume("weights")

    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    params[1][3, 4] = 123.0  # a view made before the sleep still aliases the buffer
    assert flat[120 + 3 * 10 + 4].item() == 123.0
    flat[0] = -7.0
    assert params[0][0, 0].item() == -7.0


def test_a_storage_seen_through_many_tensors_is_copied_once() -> None:
    flat, params = _flat_model()
    other = torch.randn(50)
    backend = PinnedHostBackend()
    backend.register("weights", [flat, *params, flat, other[:10], other])
    backend.register("weights", params)  # registered again under the same tag
    backend.pause("weights")
    # Two distinct storages, each on its own 4 KiB-aligned slot of the host buffer.
    assert backend.host_nbytes() == 4096 + 50 * 4
    backend.resume("weights")


def test_the_host_buffer_is_allocated_once_and_reused() -> None:
    flat, params = _flat_model()
    backend = PinnedHostBackend()
    backend.register("weights", params)
    pointers = set()
    for step in range(3):
        flat.add_(1.0)
        expected = _bytes(flat)
        backend.pause("weights")
        pointers.add(backend._buffers["weights"].tensor.data_ptr())
        backend.resume("weights")
        assert torch.equal(_bytes(flat), expected), f"cycle {step}"
    assert len(pointers) == 1


def test_a_scratch_tag_is_freed_without_a_copy_and_comes_back_as_zeros() -> None:
    flat, params = _flat_model()
    grads = torch.randn(300)
    grad_views = [grads[0:120].view(10, 12), grads[120:300]]
    backend = PinnedHostBackend()
    backend.register("weights", params)
    backend.register("grads", grad_views, keep=False)
    kept = _bytes(flat)

    backend.pause()
    assert flat.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    # Only the kept tag's bytes went to the host: a scratch tag has no host buffer.
    assert backend.host_nbytes() == 300 * 4 and "grads" not in backend._buffers
    backend.resume()

    assert torch.equal(_bytes(flat), kept)
    assert grads.untyped_storage().nbytes() == 300 * 4
    assert torch.equal(grads, torch.zeros(300))
    grad_views[1][5] = 2.5  # the views made before still alias the re-created storage
    assert grads[125].item() == 2.5
    # Pausing the scratch tag alone, again: freed, and back as zeros.
    backend.pause("grads")
    backend.resume("grads")
    assert torch.equal(grads, torch.zeros(300))


def test_a_background_resume_on_the_cpu_is_complete_when_it_returns() -> None:
    state = torch.randn(100)
    expected = state.clone()
    backend = PinnedHostBackend()
    backend.register("optimizer", [state], resume_in_background=True)
    backend.pause()
    backend.resume()
    assert torch.equal(state, expected) and not backend._in_flight
    backend.join("optimizer")  # nothing in flight: nothing to wait for
    backend.join()
    assert torch.equal(state, expected)


def test_a_tag_is_kept_or_scratch_once_and_for_all() -> None:
    backend = PinnedHostBackend()
    backend.register("grads", [torch.zeros(4)], keep=False)
    backend.register("grads", [torch.zeros(3)], keep=False)
    with pytest.raises(
        ValueError, match=r"register\('grads', keep=True\): the tag was registered with keep=False"
    ):
        backend.register("grads", [torch.zeros(2)])


def test_a_callable_source_is_evaluated_at_every_pause() -> None:
    state: dict[str, torch.Tensor] = {}
    calls = []

    def optimizer_state() -> list[torch.Tensor]:
        calls.append(1)
        return list(state.values())

    backend = PinnedHostBackend()
    backend.register("optimizer", optimizer_state)
    backend.pause("optimizer")  # nothing exists yet
    backend.resume("optimizer")
    state["exp_avg"] = torch.randn(64)  # created lazily by the first optimizer step
    expected = state["exp_avg"].clone()
    backend.pause("optimizer")
    assert state["exp_avg"].untyped_storage().nbytes() == 0
    backend.resume("optimizer")
    assert torch.equal(state["exp_avg"], expected)
    assert len(calls) == 2


def test_pause_and_resume_refuse_to_repeat_and_name_unknown_tags() -> None:
    backend = PinnedHostBackend()
    backend.register("weights", [torch.randn(8)])
    with pytest.raises(RuntimeError, match="already awake"):
        backend.resume("weights")
    backend.pause("weights")
    with pytest.raises(RuntimeError, match="already paused"):
        backend.pause("weights")
    with pytest.raises(RuntimeError, match="already paused"):
        backend.pause()
    with pytest.raises(ValueError, match="'grads' is not registered"):
        backend.pause("grads")
    backend.resume()


def test_tags_move_separately() -> None:
    weights, grads = torch.randn(16), torch.randn(16)
    backend = PinnedHostBackend()
    backend.register("weights", [weights])
    backend.register("grads", [grads])
    backend.pause("grads")
    assert grads.untyped_storage().nbytes() == 0
    assert weights.untyped_storage().nbytes() == 64
    backend.pause("weights")
    backend.resume("grads")
    assert grads.untyped_storage().nbytes() == 64
    assert weights.untyped_storage().nbytes() == 0
    backend.resume("weights")


def test_a_storage_shared_by_two_tags_is_refused_and_nothing_moves() -> None:
    _flat, params = _flat_model()
    backend = PinnedHostBackend()
    backend.register("weights", params[:1])
    backend.register("grads", params[1:])
    backend.pause("weights")
    with pytest.raises(ValueError, match="share a storage"):
        backend.pause("grads")
    assert backend.paused_tags == {"weights"}
    backend.resume("weights")


def test_pause_of_all_tags_is_all_or_nothing() -> None:
    weights = torch.randn(32)
    expected = weights.clone()

    def broken() -> list[torch.Tensor]:
        raise OSError("state not readable")

    backend = PinnedHostBackend()
    backend.register("weights", [weights])
    backend.register("optimizer", broken)
    with pytest.raises(OSError, match="not readable"):
        backend.pause()
    assert backend.paused_tags == frozenset()
    assert torch.equal(weights, expected), "the tag paused first was brought back"


@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_a_failed_copy_leaves_the_memory_where_it_was(
    direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = [torch.randn(32), torch.randn(16), torch.randn(8)]
    expected = [t.clone() for t in tensors]
    backend = PinnedHostBackend()
    backend.register("weights", tensors)
    if direction == "to_device":
        backend.pause("weights")
    real_copy = backend._copier.copy
    copies = []

    def copy(s, buffer, to_host, *, non_blocking):  # type: ignore[no-untyped-def]
        copies.append(to_host)
        if to_host == (direction == "to_host") and len(copies) == 2:
            raise MemoryError("injected")  # the second storage fails, after the first one moved
        return real_copy(s, buffer, to_host, non_blocking=non_blocking)

    monkeypatch.setattr(backend._copier, "copy", copy)
    with pytest.raises(MemoryError):
        backend.pause("weights") if direction == "to_host" else backend.resume("weights")
    if direction == "to_host":
        assert backend.paused_tags == frozenset()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    else:
        assert backend.paused_tags == {"weights"}
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors), "the re-created one is freed again"
        monkeypatch.undo()
        backend.resume("weights")  # the retry works
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


def test_bad_input_is_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="host_memory"):
        PinnedHostBackend(host_memory="cheap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        PinnedHostBackend(chunk_bytes=0)
    backend = PinnedHostBackend()
    with pytest.raises(ValueError, match="tag"):
        backend.register("", [torch.zeros(1)])
    with pytest.raises(ValueError, match="expected tensors"):
        backend.register("weights", [np.zeros(3)])  # type: ignore[list-item]
    backend.register("external", [torch.from_numpy(np.zeros(3))])
    with pytest.raises(ValueError, match="cannot be resized"):
        backend.pause("external")
    on_meta = PinnedHostBackend(device="meta")
    on_meta.register("weights", [torch.zeros(3)])
    with pytest.raises(ValueError, match="lives on cpu"):
        on_meta.pause("weights")


def test_small_chunks_move_the_same_bytes() -> None:
    flat, params = _flat_model()
    expected = _bytes(flat)
    backend = PinnedHostBackend(chunk_bytes=100)  # 1200 bytes in 12 pieces
    backend.register("weights", params)
    backend.pause("weights")
    backend.resume("weights")
    assert torch.equal(_bytes(flat), expected)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@st.composite
def _tensor_sets(draw: st.DrawFn) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    """Tags holding tensors and views of them (duplicates included); returns (by tag, all bases)."""
    n_tags = draw(st.integers(1, 3))
    by_tag: dict[str, list[torch.Tensor]] = {}
    bases = []
    for i in range(n_tags):
        tensors = []
        for _ in range(draw(st.integers(0, 4))):
            dtype = draw(st.sampled_from(_DTYPES))
            n = draw(st.integers(1, 200))
            seed = draw(st.integers(0, 2**31 - 1))
            raw = torch.randint(
                0,
                256,
                (n * torch.empty(0, dtype=dtype).element_size(),),
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(seed),
            )
            base = raw.view(dtype) if dtype != torch.bool else raw % 2 == 1
            bases.append(base)
            tensors.append(base)
            if n > 2:
                start = draw(st.integers(0, n - 2))
                tensors.append(base[start:])  # a view of the same storage
            if draw(st.booleans()):
                tensors.append(base)  # the same tensor twice
        by_tag[f"tag{i}"] = tensors
    return by_tag, bases


@settings(max_examples=40, deadline=None)
@given(sets=_tensor_sets(), cycles=st.integers(1, 3), one_by_one=st.booleans())
def test_any_tensors_come_back_bit_identical(
    sets: tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]], cycles: int, one_by_one: bool
) -> None:
    by_tag, bases = sets
    expected = [_bytes(b) for b in bases]
    backend = PinnedHostBackend()
    for tag, tensors in by_tag.items():
        backend.register(tag, tensors)
    for _ in range(cycles):
        if one_by_one:
            for tag in by_tag:
                backend.pause(tag)
        else:
            backend.pause()
        assert all(b.untyped_storage().nbytes() == 0 for b in bases)
        if one_by_one:
            for tag in reversed(list(by_tag)):
                backend.resume(tag)
        else:
            backend.resume()
        for b, e in zip(bases, expected, strict=True):
            assert torch.equal(_bytes(b), e)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 5000), threads=st.one_of(st.none(), st.integers(1, 9)))
def test_prefault_zeroes_every_byte_whatever_the_split(numel: int, threads: int | None) -> None:
    from tandem.lifecycle._host_buffers import prefault

    tensor = torch.full((numel,), 7, dtype=torch.uint8)
    prefault(tensor, threads)
    assert int(tensor.count_nonzero()) == 0


def test_a_frozen_tag_is_copied_to_the_host_once_and_comes_back_from_that_copy() -> None:
    flat, params = _flat_model()
    base = [p.clone() for p in params]
    backend = PinnedHostBackend()
    backend.register("base", params, frozen=True)
    backend.pause("base")
    assert flat.untyped_storage().nbytes() == 0
    assert backend.copied_to_host("base") == 300 * 4
    for _ in range(3):
        backend.resume("base")
        assert all(torch.equal(p, b) for p, b in zip(params, base, strict=True))
        backend.pause("base")
    assert backend.copied_to_host("base") == 300 * 4  # no device-to-host copy after the first
    backend.resume("base")
    # What is written while awake is lost at the next pause: the kept copy is what comes back.
    params[0].fill_(9.0)
    backend.pause("base")
    backend.resume("base")
    assert torch.equal(params[0], base[0])


def test_a_frozen_tags_copy_serves_awake_retain_refresh_and_invalidate() -> None:
    flat, params = _flat_model()
    base = [p.clone() for p in params]
    backend = PinnedHostBackend()
    backend.register("base", params, frozen=True)
    with pytest.raises(RuntimeError, match=r"refresh\('base'\): the tag has no host copy yet"):
        backend.refresh("base", [params[1]])
    backend.retain("base")
    backend.retain("base")  # a copy exists: nothing more
    assert backend.copied_to_host("base") == 300 * 4 and flat.untyped_storage().nbytes() == 1200
    params[1].add_(1.0)  # e.g. a merge into one weight
    params[2].add_(2.0)
    backend.refresh("base", [params[1]])  # exactly that tensor's bytes come back, the others keep theirs
    assert torch.equal(params[1], base[1]) and torch.equal(params[2], base[2] + 2.0)
    backend.pause("base")  # the kept copy: no second copy, and the write into params[2] is dropped
    backend.resume("base")
    assert backend.copied_to_host("base") == 300 * 4 and torch.equal(params[2], base[2])
    params[0].fill_(5.0)  # a deliberate change of the frozen tensors
    backend.invalidate("base")
    backend.pause("base")
    backend.resume("base")
    assert backend.copied_to_host("base") == 2 * 300 * 4 and torch.equal(
        params[0], torch.full_like(params[0], 5.0)
    )


def test_a_frozen_tag_whose_storages_changed_is_copied_again() -> None:
    tensors: list[torch.Tensor] = [torch.randn(10)]
    backend = PinnedHostBackend()
    backend.register("base", lambda: list(tensors), frozen=True)
    backend.pause("base")
    backend.resume("base")
    tensors.append(torch.randn(20))  # another storage: the copy no longer covers the tag
    expected = [t.clone() for t in tensors]
    backend.pause("base")
    backend.resume("base")
    assert backend.copied_to_host("base") == 10 * 4 + 30 * 4
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


def test_frozen_is_refused_where_it_cannot_hold() -> None:
    backend = PinnedHostBackend()
    with pytest.raises(ValueError, match=r"keep=False, frozen=True\): a frozen tag's bytes are kept"):
        backend.register("base", [torch.zeros(3)], keep=False, frozen=True)
    backend.register("weights", [torch.zeros(3)])
    with pytest.raises(ValueError, match=r"registered with frozen=False"):
        backend.register("weights", [torch.zeros(3)], frozen=True)
    with pytest.raises(ValueError, match=r"retain\('weights'\): not a frozen tag"):
        backend.retain("weights")
    backend.register("base", [torch.zeros(3)], frozen=True)
    backend.pause("base")
    with pytest.raises(RuntimeError, match=r"invalidate\('base'\): the tag is paused"):
        backend.invalidate("base")
    view = torch.zeros(4, 4)
    backend.register("more", [view], frozen=True)
    backend.retain("more")
    with pytest.raises(ValueError, match="not a contiguous tensor of the tag"):
        backend.refresh("more", [view.t()])
