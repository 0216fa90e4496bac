"""A run's checkpoint is a step of the whole run: resume from the newest rollout every part completed.

- Layouts drawn by hypothesis (each model's complete and incomplete checkpoints,
  the driver's states): the resume point is the newest rollout complete for all,
  the parts newer or incomplete are set aside, nothing is deleted, and each model's
  marker points at the resumed rollout.
- `--load-rollout-id`, and a `--load` folder of another run, which is never touched.
- A save killed with SIGKILL at each of its stages (`_scripts/run_save.py`: the
  driver's order of parts and Megatron's save protocol with its fault points):
  the next start resumes from the last complete rollout with that rollout's data
  cursor, and saves again from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.runtime.checkpoint_folder import MARKER, iteration_dir, read_latest
from tandem.ppo.run.checkpoint import ModelFolders, find_resume_point, set_aside
from tandem.ppo.run.state import load_state

SCRIPTS = Path(__file__).parent / "_scripts"
ROLES = ("critic", "actor")


def models(run_dir: Path) -> list[ModelFolders]:
    return [ModelFolders(role, run_dir / role, run_dir / role) for role in ROLES]


def write_checkpoint(root: Path, rollout_id: int, *, complete: bool = True, suffix: str = "") -> None:
    folder = (
        iteration_dir(root, rollout_id).with_suffix(suffix) if suffix else iteration_dir(root, rollout_id)
    )
    folder.mkdir(parents=True)
    (folder / "shard_0.distcp").write_text(f"{root.name} {rollout_id}{suffix}\n")
    if complete:
        (folder / "metadata.json").write_text("{}\n")


def write_state(run_dir: Path, rollout_id: int) -> None:
    folder = run_dir / "driver"
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "rollout_id": rollout_id,
        "data": {"epoch": 0, "cursor": rollout_id},
        "python_rng": [],
        "metrics": [],
    }
    (folder / f"iter_{rollout_id:07d}.json").write_text(json.dumps(data))


def all_files(root: Path) -> Counter[tuple[str, str]]:
    """(name, contents) of every file under `root` but the markers, counted (where they live may change)."""
    return Counter((p.name, p.read_text()) for p in root.rglob("*") if p.is_file() and p.name != MARKER)


ROLLOUTS = st.sets(st.integers(0, 5), max_size=6)


@settings(max_examples=80, deadline=None)
@given(
    critic=ROLLOUTS,
    actor=ROLLOUTS,
    driver=ROLLOUTS,
    critic_partial=st.sets(st.integers(0, 6), max_size=2),
    actor_partial=st.sets(st.integers(0, 6), max_size=2),
)
def test_the_resume_point_is_the_newest_rollout_complete_for_all(
    critic: set[int], actor: set[int], driver: set[int], critic_partial: set[int], actor_partial: set[int]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        for role, complete, partial in (("critic", critic, critic_partial), ("actor", actor, actor_partial)):
            for k in complete:
                write_checkpoint(run_dir / role, k)
            for k in partial:
                write_checkpoint(run_dir / role, k, complete=False, suffix=".partial")
            if complete:
                (run_dir / role / MARKER).write_text(f"{max(complete)}\n")
        for k in driver:
            write_state(run_dir, k)
        before = all_files(run_dir)

        point = find_resume_point(run_dir, models(run_dir))
        common = critic & actor & driver
        expected = max(common) if common else None
        assert point.rollout_id == expected
        assert all_files(run_dir) == before  # finding changes nothing

        def newer(k: int) -> bool:
            return expected is None or k > expected

        expected_aside = (
            {f"critic/iter_{k:07d}" for k in critic if newer(k)}
            | {f"actor/iter_{k:07d}" for k in actor if newer(k)}
            | {f"driver/iter_{k:07d}.json" for k in driver if newer(k)}
            | {f"critic/iter_{k:07d}.partial" for k in critic_partial}
            | {f"actor/iter_{k:07d}.partial" for k in actor_partial}
        )
        assert {f"{p.parent.name}/{p.name}" for p in point.set_aside} == expected_aside

        target = set_aside(run_dir, point, models(run_dir))
        assert all_files(run_dir) == before  # moved, never deleted
        assert (target is None) == (not expected_aside)
        for role, complete in (("critic", critic), ("actor", actor)):
            kept = (
                sorted(p.name for p in (run_dir / role).glob("iter_*")) if (run_dir / role).is_dir() else []
            )
            assert kept == [f"iter_{k:07d}" for k in sorted(complete) if not newer(k)]
            assert read_latest(run_dir / role) == expected
        if expected is not None:
            assert load_state(run_dir, expected).data == {"epoch": 0, "cursor": expected}
        again = find_resume_point(run_dir, models(run_dir))
        assert again.rollout_id == expected and again.set_aside == ()


def test_a_requested_rollout_must_be_complete_for_all(tmp_path: Path) -> None:
    for k in (0, 1, 2):
        write_checkpoint(tmp_path / "actor", k)
        write_state(tmp_path, k)
    for k in (0, 1):
        write_checkpoint(tmp_path / "critic", k)
    with pytest.raises(
        ValueError, match=r"^--load-rollout-id: rollout 2 is not complete .* pick one of \[0, 1\]"
    ):
        find_resume_point(tmp_path, models(tmp_path), requested=2)
    point = find_resume_point(tmp_path, models(tmp_path), requested=0)
    assert point.rollout_id == 0 and point.next_rollout_id == 1
    assert {f"{p.parent.name}/{p.name}" for p in point.set_aside} == {
        "actor/iter_0000001", "actor/iter_0000002", "critic/iter_0000001",
        "driver/iter_0000001.json", "driver/iter_0000002.json",
    }  # fmt: skip


def test_a_load_folder_of_another_run_is_read_never_moved(tmp_path: Path) -> None:
    other, run_dir = tmp_path / "other", tmp_path / "run"
    for k in (0, 1):
        write_checkpoint(other / "actor", k)
        write_checkpoint(run_dir / "critic", k)
        write_state(run_dir, k)
    write_checkpoint(other / "actor", 2)  # newer than the run can continue, but not the run's own
    folders = [ModelFolders("critic", run_dir / "critic", run_dir / "critic"),
               ModelFolders("actor", other / "actor", run_dir / "actor")]  # fmt: skip
    point = find_resume_point(run_dir, folders)
    assert point.rollout_id == 1 and point.set_aside == ()
    set_aside(run_dir, point, folders)
    assert (other / "actor" / "iter_0000002" / "metadata.json").is_file()

    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match=r"^--load: .*other/actor holds checkpoints of rollouts \[0, 1, 2\]"):
        find_resume_point(fresh, [ModelFolders("actor", other / "actor", fresh / "actor")])


def test_a_rollout_left_only_as_its_old_folder_is_complete_and_renamed_back(tmp_path: Path) -> None:
    for role in ROLES:
        write_checkpoint(tmp_path / role, 0)
        (tmp_path / role / MARKER).write_text("0\n")
    write_state(tmp_path, 0)
    shutil.move(tmp_path / "critic" / "iter_0000000", tmp_path / "critic" / "iter_0000000.old")
    write_checkpoint(tmp_path / "critic", 0, complete=False)  # the re-save's half-published folder
    point = find_resume_point(tmp_path, models(tmp_path))
    assert point.rollout_id == 0
    set_aside(tmp_path, point, models(tmp_path))
    assert (tmp_path / "critic" / "iter_0000000" / "metadata.json").is_file()
    assert not (tmp_path / "critic" / "iter_0000000.old").exists()
    assert read_latest(tmp_path / "critic") == 0


# --- SIGKILL at each stage of a save ----------------------------------------------------------

KILL_POINTS = [
    # (fault point, the rollout a start resumes after)
    ("driver_state.written", 1),  # the state's temporary file written, not yet renamed
    ("run_save.driver_state", 1),
    ("checkpoint.staged:role=critic", 1),
    ("checkpoint.written:role=critic", 1),
    ("checkpoint.published:role=critic", 1),
    ("checkpoint.marked:role=critic", 1),
    ("run_save.model:role=critic", 1),  # the critic one checkpoint ahead of the actor
    ("checkpoint.staged:role=actor", 1),
    ("checkpoint.written:role=actor", 1),
    ("checkpoint.published:role=actor", 2),  # published: complete, even before the marker moves
    ("checkpoint.marked:role=actor", 2),
    ("run_save.model:role=actor", 2),
]


def _save(run_dir: Path, first: int, last: int, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_FAULT_POINT"}
    if fault is not None:
        env["TANDEM_FAULT_POINT"] = fault
    command = [sys.executable, str(SCRIPTS / "run_save.py"), str(run_dir), str(first), str(last)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def two_saved_rollouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    proc = _save(run_dir, 0, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _check_resume(run_dir: Path, expected: int, killed_at: str) -> None:
    point = find_resume_point(run_dir, models(run_dir))
    assert point.rollout_id == expected, (killed_at, point)
    # The same data cursor as the save of that rollout wrote (run_save.cursor).
    assert load_state(run_dir, expected).data == {"epoch": 0, "cursor": 3 * (expected + 1)}
    before = all_files(run_dir)
    set_aside(run_dir, point, models(run_dir))
    assert all_files(run_dir) == before, killed_at
    for role in ROLES:
        assert read_latest(run_dir / role) == expected, (killed_at, role)
    # The next start saves on from there.
    proc = _save(run_dir, expected + 1, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert find_resume_point(run_dir, models(run_dir)).rollout_id == 2


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "expected"), KILL_POINTS, ids=[p for p, _ in KILL_POINTS])
def test_a_save_killed_at_each_stage_resumes_from_the_last_complete_rollout(
    two_saved_rollouts: Path, tmp_path: Path, fault: str, expected: int
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(two_saved_rollouts, run_dir)
    proc = _save(run_dir, 2, 2, fault)
    assert proc.returncode == -9, (fault, proc.returncode, proc.stderr[-3000:])  # killed there, not before
    _check_resume(run_dir, expected, fault)


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_a_re_save_killed_between_its_renames_resumes_from_that_rollout(
    two_saved_rollouts: Path, tmp_path: Path, role: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(two_saved_rollouts, run_dir)
    proc = _save(run_dir, 1, 1, f"checkpoint.moved_aside:role={role}")  # rollout 1 saved again
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert not (run_dir / role / "iter_0000001").exists()
    _check_resume(run_dir, 1, role)
