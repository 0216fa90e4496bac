"""A checkpoint records each file's size and xxh3 checksum when its save completes, and is verified on load.

The save protocol (`checkpoint_folder.save_folder`) writes `tandem_manifest.json`
into the staging folder once every rank's shards are in it; `verify_checkpoint`
says, in words, what makes a folder unreadable: a file gone, of another size (a
shard truncated to 0 bytes), or of another checksum (asked for); a checkpoint saved
before manifests existed gets the checks that need none (no empty file, a
metadata.json that is JSON). No torch: these are the driver's checks before Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.megatron.runtime.checkpoint_folder import save_folder
from tandem.megatron.runtime.checkpoint_manifest import MANIFEST, checkpoint_bytes, verify_checkpoint


def _save(root: Path, rollout_id: int) -> Path:
    def write(staging: Path) -> None:
        (staging / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
        (staging / "common.pt").write_bytes(b"common")
        (staging / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))

    return save_folder(root, rollout_id, write)


def test_a_save_records_each_files_size_and_checksum(tmp_path: Path) -> None:
    import xxhash

    folder = _save(tmp_path, 3)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["checksum"] == "xxh3_64"
    assert manifest["files"]["__0_0.distcp"] == {
        "size": 10240,
        "xxh3_64": xxhash.xxh3_64_hexdigest(bytes(range(256)) * 40),
    }
    assert sorted(manifest["files"]) == ["__0_0.distcp", "common.pt", "metadata.json"]
    assert checkpoint_bytes(folder) == sum(f["size"] for f in manifest["files"].values())
    assert verify_checkpoint(folder) is None


def test_a_truncated_or_changed_or_missing_file_is_named(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    shard = folder / "__0_0.distcp"
    shard.write_bytes(b"")
    assert (
        verify_checkpoint(folder, checksums=False)
        == f"{shard} is 0 bytes; it had 10240 when its save completed"
    )
    shard.write_bytes(bytes(range(256)) * 39 + bytes(256))  # the same size, other bytes
    assert verify_checkpoint(folder, checksums=False) is None  # sizes only: not seen
    problem = verify_checkpoint(folder)
    assert problem is not None and problem.startswith(f"{shard}: its xxh3_64 checksum is ")
    assert problem.endswith("not the one recorded when its save completed")
    shard.unlink()
    assert verify_checkpoint(folder) == f"{shard} is missing; it had 10240 bytes when its save completed"


@pytest.mark.parametrize(
    ("broken", "expected"),
    [("__0_0.distcp", "is 0 bytes"), ("metadata.json", "is 0 bytes")],
)
def test_a_checkpoint_without_a_manifest_gets_the_checks_that_need_none(
    tmp_path: Path, broken: str, expected: str
) -> None:
    folder = _save(tmp_path, 1)
    (folder / MANIFEST).unlink()  # saved before manifests existed
    assert verify_checkpoint(folder) is None
    assert checkpoint_bytes(folder) == 10240 + 6 + len(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / broken).write_bytes(b"")
    assert verify_checkpoint(folder) == f"{folder / broken} {expected}"
