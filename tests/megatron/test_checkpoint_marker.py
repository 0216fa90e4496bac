"""The "latest" marker protocol: a crash at any step of a save leaves a usable checkpoint.

A hypothesis state machine saves rollouts into one folder, crashing some saves at
a chosen step (before the shards are complete, or at any rename of the commit),
and checks after every step that the folder's latest checkpoint is complete and
is the last save that finished (or, for a crashed re-save of that same rollout,
the crashed save's complete copy).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tandem.megatron.worker import checkpoint


class Crash(Exception):
    """A simulated crash of the saving process."""


def _write_shards(folder: Path, version: int, complete: bool) -> None:
    (folder / "__0_0.distcp").write_text(str(version))
    if complete:
        (folder / "metadata.json").write_text(json.dumps({"version": version}))


def _version_in(folder: Path) -> int:
    return int((folder / "__0_0.distcp").read_text())


class MarkerMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp())
        self.version = 0
        self.latest: int | None = None
        # Versions the latest checkpoint may hold: the last finished save, plus saves of the
        # same rollout that crashed after their folder was published but before the marker.
        self.acceptable: set[int] = set()

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(
        rollout_id=st.integers(0, 3),
        crash=st.sampled_from([None, "no_shards", "incomplete_shards", 1, 2, 3]),
    )
    def save(self, rollout_id: int, crash: str | int | None) -> None:
        self.version += 1
        staging = checkpoint.begin_save(self.root, rollout_id)
        if crash == "no_shards":
            return
        _write_shards(staging, self.version, complete=crash != "incomplete_shards")
        if crash == "incomplete_shards":
            return
        real_replace = os.replace
        calls = 0

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            nonlocal calls
            calls += 1
            if calls == crash:
                raise Crash(f"crash at rename {calls}: {src} -> {dst}")
            real_replace(src, dst)

        # Renames in a commit: [old folder aside,] staging -> final, marker; the last is the marker's.
        final_existed = checkpoint.iteration_dir(self.root, rollout_id).exists()
        marker_rename = 3 if final_existed else 2
        try:
            with mock.patch("os.replace", replace):
                checkpoint.commit_save(self.root, rollout_id)
        except Crash:
            if crash == marker_rename and self.latest == rollout_id:
                # The new complete copy of the marker's rollout is in place; either copy is usable.
                self.acceptable.add(self.version)
            return
        assert crash is None or calls < int(crash)
        self.latest = rollout_id
        self.acceptable = {self.version}

    @invariant()
    def latest_is_complete_and_last_finished(self) -> None:
        if not hasattr(self, "root"):
            return
        found = checkpoint.latest_dir(self.root)
        if self.latest is None:
            assert found is None
            return
        assert found is not None
        rollout_id, folder = found
        assert rollout_id == self.latest == checkpoint.read_latest(self.root)
        assert (folder / "metadata.json").is_file()
        assert _version_in(folder) in self.acceptable


MarkerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=12, deadline=None)
test_marker_protocol = MarkerMachine.TestCase


def test_commit_refuses_an_incomplete_staging_folder(tmp_path: Path) -> None:
    staging = checkpoint.begin_save(tmp_path, 5)
    _write_shards(staging, 1, complete=False)
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        checkpoint.commit_save(tmp_path, 5)
    assert checkpoint.read_latest(tmp_path) is None


def test_marker_pointing_at_a_missing_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / checkpoint.MARKER).write_text("3\n")
    with pytest.raises(RuntimeError, match="rollout 3"):
        checkpoint.latest_dir(tmp_path)
    assert checkpoint.latest_dir(None) is None
    assert checkpoint.latest_dir(tmp_path / "empty") is None
