"""One host copy of a frozen tag between processes (`SharedFrozen`), on CPU tensors.

The sharing is between processes by nature (a LoRA actor's and critic's workers), so these tests start
their own: small Python processes that import torch and tandem.lifecycle alone (about a second each), no
Ray. The first publishes its copy; a second with equal bytes (a subset of the first's storages, in order)
maps it and copies nothing, and its tensors come back right, also after the first has ended; a superset
copies only what the first's copy lacks; a process with other bytes, or one that comes after a dead
process's index, makes its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tandem.lifecycle import PinnedHostBackend, SharedFrozen

pytestmark = [
    pytest.mark.slow,  # five processes that import torch: about 10 s on two cores
    pytest.mark.skipif(sys.platform != "linux", reason="memfd and /proc/PID/fd are Linux's"),
]

PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    from tandem.lifecycle import PinnedHostBackend, SharedFrozen

    folder, seeds, wait, other = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "wait", sys.argv[4] == "other"
    device = sys.argv[5]
    tensors = [torch.randn(1000 + 100 * s, generator=torch.Generator().manual_seed(s)).to(device) for s in seeds]
    if other:
        tensors[0][7] += 1.0  # the same sizes, one value other
    expected = [t.clone() for t in tensors]
    backend = PinnedHostBackend()
    backend.register("base", tensors, frozen=True, share=SharedFrozen(folder, "base-tp0-pp0"))
    backend.pause("base")
    maps = open("/proc/self/maps").read()
    report = {"copied": backend.copied_to_host("base"), "memfd": "memfd:tandem-frozen" in maps}
    print(json.dumps(report), flush=True)
    if wait:
        sys.stdin.readline()  # the test says when this process may end (its copy stays published till then)
    for _ in range(2):
        backend.resume("base")
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected)), "the tensors came back changed"
        backend.pause("base")
    print("ok", flush=True)
    """
)


def _start(
    folder: Path, seeds: list[int], *, wait: bool, other: bool = False, device: str = "cpu"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            PROCESS,
            str(folder),
            json.dumps(seeds),
            "wait" if wait else "go",
            "other" if other else "same",
            device,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _report(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, process.stderr.read() if process.stderr else "no output"
    return json.loads(line)  # type: ignore[no-any-return]


def _finish(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    process.stdin.write("\n")
    process.stdin.close()
    out = process.stdout.read()  # the rest, through the same buffered reader as the report's line
    err = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert process.wait(timeout=60) == 0 and out.strip().endswith("ok"), err[-2000:]


def test_processes_with_the_same_bytes_keep_one_copy_and_others_their_own(tmp_path: Path) -> None:
    first = _start(tmp_path, [1, 3], wait=True)  # the critic's base, say
    assert _report(first) == {"copied": (1100 + 1300) * 4, "memfd": True}, "the first copies and publishes"
    index = json.loads((tmp_path / "base-tp0-pp0.json").read_text())
    assert index["pid"] == first.pid and [n for n, _ in index["places"]] == [4400, 5200]
    # A subset of its storages, in order, with the same bytes: mapped, nothing copied.
    subset = _start(tmp_path, [3], wait=True)
    assert _report(subset) == {"copied": 0, "memfd": True}
    # A superset (the actor's base with its output layer): only what the copy lacks is copied.
    superset = _start(tmp_path, [1, 2, 3], wait=True)
    assert _report(superset) == {"copied": 1200 * 4, "memfd": True}
    # The same sizes with one value other: a copy of its own.
    other = _start(tmp_path, [1, 3], wait=False, other=True)
    assert _report(other)["copied"] == (1100 + 1300) * 4
    _finish(other)
    _finish(first)  # the first ends: the memfd lives on while the others map it; their tensors come back
    _finish(subset)
    _finish(superset)
    after = _start(tmp_path, [1, 4], wait=False)  # the index names a dead process now
    assert _report(after)["copied"] == (1100 + 1400) * 4
    _finish(after)
    assert json.loads((tmp_path / "base-tp0-pp0.json").read_text())["pid"] == after.pid, (
        "a dead index is replaced"
    )


def test_share_is_for_frozen_tags_and_a_changed_tag_leaves_the_shared_copy(tmp_path: Path) -> None:
    backend = PinnedHostBackend()
    with pytest.raises(ValueError, match="only a frozen tag's host copy can be shared"):
        backend.register("weights", [torch.ones(4)], share=SharedFrozen(tmp_path, "k"))
    t = torch.arange(1000, dtype=torch.float32)
    backend.register("base", [t], frozen=True, share=SharedFrozen(tmp_path, "k"))
    backend.retain("base")  # published, as the first pause would
    shared = backend._buffers["base"]
    backend.invalidate("base")
    t.add_(1)  # changed on purpose: the next copy must not write the bytes others may map
    backend.pause("base")
    assert backend._buffers["base"] is not shared and torch.equal(
        shared.tensor[:4000].view(torch.float32)[:3], torch.tensor([0.0, 1.0, 2.0])
    )
    backend.resume("base")
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32) + 1)


@pytest.mark.gpu
def test_on_the_gpu_the_shared_copy_is_page_locked_and_the_bytes_come_back(tmp_path: Path) -> None:
    # CUDA tensors: the first's memfd is page-locked where it is made, the second's mapping of it too
    # (cudaHostRegister of another process's pages); both resume their tensors from it.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (marker `gpu`)")
    first = _start(tmp_path, [1, 3], wait=True, device="cuda")
    assert _report(first) == {"copied": (1100 + 1300) * 4, "memfd": True}
    second = _start(tmp_path, [1, 2, 3], wait=True, device="cuda")
    assert _report(second) == {"copied": 1200 * 4, "memfd": True}
    _finish(first)
    _finish(second)


def test_an_index_not_of_ours_or_a_folder_that_cannot_be_written_leaves_a_copy_of_its_own(
    tmp_path: Path,
) -> None:
    (tmp_path / "k.json").write_text(json.dumps({"pid": 1}))  # a living process, no buffer named
    (tmp_path / "a-file").write_text("")
    for folder in (tmp_path, tmp_path / "a-file"):  # the second cannot hold an index: it is a file
        t = torch.arange(1000, dtype=torch.float32)
        backend = PinnedHostBackend()
        backend.register("base", [t], frozen=True, share=SharedFrozen(folder, "k"))
        backend.pause("base")
        assert backend.copied_to_host("base") == 4000
        backend.resume("base")
        assert torch.equal(t, torch.arange(1000, dtype=torch.float32))
