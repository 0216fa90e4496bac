"""`worker.memory.storage_piece`: an optimizer tag's tensors cut in pieces that a memory plan sleeps apart.

Hypothesis draws tensors (some of them views of one storage) and a count of pieces: the pieces
partition the distinct storages (each whole, in one piece), each holds at most its share of the bytes
plus one storage, and the cuts stay where they were while any pieces are asleep (their storages
resized to 0). Then the pieces as tags of a `PinnedHostBackend` on CPU tensors: put to sleep one
after the other in any order, every storage is freed, and every byte comes back. In-process: the
module imports no megatron-core.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.lifecycle import PinnedHostBackend
from tandem.megatron.choices import memory_tag_kind, memory_tag_pieces
from tandem.megatron.worker.memory import storage_piece

Shapes = list[tuple[int, bool]]
"""Each storage's element count, and whether a view of it follows the tensor itself."""

shapes: st.SearchStrategy[Shapes] = st.lists(
    st.tuples(st.integers(1, 300), st.booleans()), min_size=1, max_size=12
)


def tensors_of(spec: Shapes) -> list[torch.Tensor]:
    """Tensors of `spec`'s sizes, each followed by a view of its storage where `spec` says so (a storage counted
    once). Drawn as sizes, built here: a failing example is then printed without reading freed storages."""
    out: list[torch.Tensor] = []
    for size, view in spec:
        t = torch.arange(size, dtype=torch.float32) + 1000.0 * len(out)
        out.append(t)
        if view and size > 1:
            out.append(t[1:])
    return out


def key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 6), st.data())
def test_the_pieces_partition_the_storages_evenly_and_stay_put_while_some_sleep(
    spec: Shapes, pieces: int, data: st.DataObject
) -> None:
    tensors = tensors_of(spec)
    storages = {key(t): t.untyped_storage().nbytes() for t in tensors}
    total, largest = sum(storages.values()), max(storages.values())
    cut = [storage_piece(lambda: tensors, i, pieces) for i in range(pieces)]
    owners = [{key(t) for t in piece} for piece in cut]
    assert sum(len(o) for o in owners) == len(storages) and set().union(*owners) == set(storages)
    for piece, owned in zip(cut, owners, strict=True):
        assert [t for t in tensors if key(t) in owned] == piece, "every view of a storage, in order"
        assert sum(storages[k] for k in owned) <= total / pieces + largest
    # Some pieces asleep: their storages hold 0 bytes now, and every piece is still the same.
    asleep = data.draw(st.sets(st.integers(0, pieces - 1)))
    for i in asleep:
        for t in cut[i]:
            t.untyped_storage().resize_(0)
    again = [{key(t) for t in storage_piece(lambda: tensors, i, pieces)} for i in range(pieces)]
    assert again == owners


@settings(max_examples=50, deadline=None)
@given(shapes, st.integers(1, 4), st.randoms(use_true_random=False))
def test_pieces_as_tags_sleep_in_any_order_and_every_byte_comes_back(
    spec: Shapes, pieces: int, rng: object
) -> None:
    tensors = tensors_of(spec)
    expected = [t.clone() for t in tensors]
    backend = PinnedHostBackend()
    tags = memory_tag_pieces("optimizer_moments", pieces)
    assert {memory_tag_kind(t) for t in tags} == {"optimizer_moments"}
    for i, tag in enumerate(tags):
        backend.register(tag, lambda i=i: storage_piece(lambda: tensors, i, pieces))
    order = list(tags)
    rng.shuffle(order)  # type: ignore[attr-defined]
    for tag in order:
        backend.pause(tag)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors), "every storage freed"
    rng.shuffle(order)  # type: ignore[attr-defined]
    for tag in order:
        backend.resume(tag)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))


def test_piece_names() -> None:
    assert memory_tag_pieces("main_params", 1) == ("main_params",)
    assert memory_tag_pieces("main_params", 3) == ("main_params.0", "main_params.1", "main_params.2")
    assert memory_tag_kind("main_params.2") == memory_tag_kind("main_params") == "main_params"


def test_the_state_is_measured_after_the_first_train_only() -> None:
    """`WorkerMemory.record_state_after_train`: the first train's end measures the state (its optimizer
    moments now exist); later trains change no size, and a measure walks every storage, so they keep it;
    `state_nbytes` asleep answers with the figures recorded."""
    from types import SimpleNamespace

    from tandem.megatron.worker.memory import WorkerMemory

    sizes = iter([{"weights": 4}, {"weights": 4, "moments": 8}, {"weights": 99, "moments": 99}])
    measured: list[dict[str, int]] = []

    def measure() -> dict[str, int]:
        measured.append(next(sizes))
        return measured[-1]

    lifecycle = SimpleNamespace(paused_tags=set())
    memory = WorkerMemory(lifecycle, ["weights", "moments"], ["weights"], measure)  # type: ignore[arg-type]
    memory.record_state()  # init
    for _ in range(3):
        memory.record_state_after_train()
    assert len(measured) == 2, "init and the first train"
    lifecycle.paused_tags = {"weights", "moments"}
    assert memory.state_nbytes() == {"weights": 4, "moments": 8}
