"""A save that finds the disk full: named in one line with what it needs and what is free, the last
complete checkpoint kept, the half-written one removed.

In process, the fault point `checkpoint.writing` with `TANDEM_FAULT_ACTION=enospc` raises the
OSError that a full disk raises. On a real full disk torch's writer says only `unexpected pos
704 vs 598`: one case saves with `torch.save` into a 1 MB tmpfs, mounted in a mount namespace of
its own (`unshare`), in a process of its own for that reason; it skips where unprivileged
namespaces are not allowed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.megatron.runtime.checkpoint_folder import DiskFull, read_latest, save_folder


def _writer(size: int):  # type: ignore[no-untyped-def]
    def write(staging: Path) -> None:
        (staging / "__0_0.distcp").write_bytes(bytes(size))
        (staging / "metadata.json").write_text(json.dumps({}))

    return write


def test_a_save_that_hits_enospc_names_the_folder_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_folder(tmp_path, 0, _writer(3_000_000))
    monkeypatch.setenv("TANDEM_FAULT_POINT", "checkpoint.writing:rollout_id=1")
    monkeypatch.setenv("TANDEM_FAULT_ACTION", "enospc")
    with pytest.raises(DiskFull) as info:
        save_folder(tmp_path, 1, _writer(3_000_000))
    free = shutil.disk_usage(tmp_path).free / 1e9
    assert str(info.value) == (
        f"no space left on device at {tmp_path}: the save needs about 3.0 MB, {free:.1f} GB free; the last "
        "complete checkpoint (rollout 0) is kept; free some space, then the same command resumes the run"
    )
    assert read_latest(tmp_path) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    # Raised in a worker, it reaches the driver through pickle (Ray), whole.
    import pickle

    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


_ON_A_FULL_TMPFS = """
import json, subprocess, sys
from pathlib import Path
import torch
from tandem.megatron.runtime.checkpoint_folder import DiskFull, read_latest, save_folder
root = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
def writer(numel):
    def write(staging):
        torch.save(torch.zeros(numel), staging / "__0_0.distcp")
        (staging / "metadata.json").write_text("{}")
    return write
save_folder(root, 0, writer(100_000))  # 400 kB
try:
    save_folder(root, 1, writer(200_000))  # 800 kB: no room beside the first
except DiskFull as exc:
    print(json.dumps({"message": str(exc), "cause": repr(exc.__cause__), "latest": read_latest(root),
                      "left": sorted(p.name for p in root.iterdir())}))
"""


def test_a_real_full_disk_is_named_whatever_torch_says(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    probe = [unshare, "--user", "--map-root-user", "--mount", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        pytest.skip("no unprivileged mount namespaces here (unshare), so no tmpfs to fill")
    root = tmp_path / "small"
    root.mkdir()
    proc = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", sys.executable, "-c", _ON_A_FULL_TMPFS, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["message"].startswith(f"no space left on device at {root}: the save needs about 0.4 MB, ")
    assert found["message"].endswith(
        " free; the last complete checkpoint (rollout 0) is kept; free some space, then the same command "
        "resumes the run"
    )
    assert "unexpected pos" in found["cause"] or "No space left" in found["cause"], found["cause"]
    assert found["latest"] == 0 and found["left"] == ["iter_0000000", "latest_checkpointed_iteration.txt"]
