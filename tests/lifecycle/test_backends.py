"""make_backend, the no-op backend, torch_memory_saver's refusal without CUDA, and the offload plan."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.lifecycle import (
    BACKEND_NAMES,
    MemoryBackend,
    NoopBackend,
    PinnedHostBackend,
    clear_torch_caches,
    make_backend,
    torch_memory_saver_env,
)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def test_make_backend_builds_each_usable_backend() -> None:
    assert isinstance(make_backend("none"), NoopBackend)
    pinned = make_backend("pinned_host", chunk_bytes=1 << 20)
    assert isinstance(pinned, PinnedHostBackend)
    assert isinstance(pinned, MemoryBackend)
    assert set(BACKEND_NAMES) == {"torch_memory_saver", "pinned_host", "none"}


def test_make_backend_names_the_flag_for_an_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"offload_backend='cuda_ipc'.*pinned_host"):
        make_backend("cuda_ipc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offload_backend='none' takes no options"):
        make_backend("none", device="cpu")


def test_the_noop_backend_moves_nothing() -> None:
    backend = NoopBackend()
    with backend.region("weights"):
        # Allocated inside the tag's region, as a worker's weights are: a backend that
        # moves memory would take this storage away on pause (pinned_host resizes it to 0).
        t = torch.ones(4)
    backend.pause("weights")
    backend.pause()
    assert t.untyped_storage().nbytes() == 16
    assert torch.equal(t, torch.ones(4))  # still readable while "paused"
    backend.resume()
    assert torch.equal(t, torch.ones(4))


@needs_no_cuda
def test_torch_memory_saver_is_refused_without_cuda_and_never_imported() -> None:
    # A fresh interpreter: the refusal must come before any import of torch_memory_saver.
    code = (
        "import sys\n"
        "from tandem.lifecycle import make_backend, torch_memory_saver_env\n"
        "for call in (lambda: make_backend('torch_memory_saver'), torch_memory_saver_env):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as err:\n"
        "        print(err)\n"
        "print('imported' if 'torch_memory_saver' in sys.modules else 'not imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[-1] == "not imported"
    assert "offload_backend='torch_memory_saver'" in lines[0] and "CUDA" in lines[0]
    assert "torch_memory_saver_env()" in lines[1] and "pinned_host" in lines[1]


@needs_no_cuda
def test_torch_memory_saver_env_is_refused_in_process_too() -> None:
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        torch_memory_saver_env()


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _frozen(obj: object) -> bool:
    import gc

    return not any(o is obj for o in gc.get_objects())  # the permanent generation is not listed


def test_clear_torch_caches_collects_cycles_and_can_freeze_the_survivors() -> None:
    import gc
    import weakref

    gc.unfreeze()
    try:
        garbage = _Cycle()
        gone = weakref.ref(garbage)
        del garbage
        survivor = _Cycle()
        clear_torch_caches()
        assert gone() is None
        assert not _frozen(survivor)  # not asked to freeze

        clear_torch_caches(freeze_survivors=True)
        assert _frozen(survivor)
        # What is made after the freeze is still collected.
        later = _Cycle()
        gone = weakref.ref(later)
        del later
        clear_torch_caches(freeze_survivors=True)
        assert gone() is None
    finally:
        gc.unfreeze()
