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


# --- checkpoints that do not read ----------------------------------------------------------------


def save_rollouts(run_dir: Path, rollouts: range) -> None:
    """Rollouts saved as a run saves them (`save_run_checkpoint`, `save_folder`: each with its manifest)."""
    from tandem.megatron.runtime.checkpoint_folder import save_folder
    from tandem.ppo.run.checkpoint import save_run_checkpoint
    from tandem.ppo.run.state import DriverState

    def model_save(role: str, k: int) -> None:
        def write(staging: Path) -> None:
            (staging / "__0_0.distcp").write_text(f"{role} {k}\n" * 100)
            (staging / "metadata.json").write_text("{}\n")

        save_folder(run_dir / role, k, write)

    for k in rollouts:
        state = DriverState(k, {"epoch": 0, "cursor": k}, metrics=[{"step": i} for i in range(k + 1)])
        save_run_checkpoint(run_dir, state, [(r, lambda r=r, k=k: model_save(r, k)) for r in ROLES])


def test_a_checkpoint_that_does_not_read_is_set_aside_and_the_run_resumes_from_the_newest_that_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_rollouts(tmp_path, range(4))
    shard = tmp_path / "critic" / "iter_0000003" / "__0_0.distcp"
    shard.write_bytes(b"")  # truncated to 0 bytes
    (tmp_path / "driver" / "iter_0000002.json").write_text("")  # emptied
    point = find_resume_point(tmp_path, models(tmp_path))
    assert point.rollout_id == 1
    assert point.unreadable == {
        shard.parent: f"{shard} is 0 bytes; it had 900 when its save completed",
        tmp_path / "driver" / "iter_0000002.json": (
            f"{tmp_path / 'driver' / 'iter_0000002.json'} does not read as the driver's state (not JSON: "
            "Expecting value: line 1 column 1 (char 0))"
        ),
    }
    set_aside(tmp_path, point, models(tmp_path))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("resuming after rollout 1; set aside in ")
    assert f"does not read: {shard} is 0 bytes; it had 900 when its save completed" in line
    assert "driver/iter_0000002.json" in line and "critic/iter_0000003" in line
    for role in ROLES:
        assert read_latest(tmp_path / role) == 1
    assert (tmp_path / "set_aside").is_dir() and not (tmp_path / "critic" / "iter_0000003").exists()


def test_a_requested_rollout_that_does_not_read_names_the_file_and_the_rollouts_that_do(
    tmp_path: Path,
) -> None:
    save_rollouts(tmp_path, range(3))
    shard = tmp_path / "actor" / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ValueError) as info:
        find_resume_point(tmp_path, models(tmp_path), requested=2)
    assert str(info.value) == (
        f"--load-rollout-id: rollout 2 does not read ({shard} is 10 bytes; it had 800 when its save completed); "
        "--load-rollout-id 1 would work (the newest that reads), or leave it unset to resume from there"
    )


def test_where_no_checkpoint_reads_the_message_names_each_file(tmp_path: Path) -> None:
    save_rollouts(tmp_path, range(2))
    for k in (0, 1):
        (tmp_path / "critic" / f"iter_{k:07d}" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ValueError) as info:
        find_resume_point(tmp_path, models(tmp_path))
    message = str(info.value)
    assert message.startswith(
        f"--run-dir: no checkpoint in {tmp_path} reads, so no --load-rollout-id would work: "
    )
    for k in (0, 1):
        assert f"rollout {k}: {tmp_path / 'critic' / f'iter_{k:07d}' / '__0_0.distcp'} is 0 bytes" in message
    assert message.endswith(
        "restore those files, or move the checkpoints away (or give another --run-dir) to start from the "
        "Hugging Face weights"
    )


def test_checksums_are_verified_when_asked(tmp_path: Path) -> None:
    save_rollouts(tmp_path, range(2))
    shard = tmp_path / "critic" / "iter_0000001" / "__0_0.distcp"
    shard.write_text(shard.read_text().replace("critic", "CRITIC"))  # the same size
    assert find_resume_point(tmp_path, models(tmp_path), checksums=False).rollout_id == 1
    point = find_resume_point(tmp_path, models(tmp_path))
    assert point.rollout_id == 0 and list(point.unreadable) == [shard.parent]


def test_keep_checkpoints_removes_the_older_complete_rollouts_of_this_runs_own_folders(
    tmp_path: Path,
) -> None:
    """`--keep-checkpoints 2`: once a save completes, the run's complete rollouts beyond its newest two go
    (every part: both models and the driver's state), and a load folder of another run is never touched.
    Without the option every checkpoint stays (a 0.5B actor and critic take about 14 GB a save)."""
    from tandem.ppo.run.checkpoint import prune_checkpoints

    save_rollouts(tmp_path, range(5))
    write_checkpoint(tmp_path / "critic", 7, complete=False, suffix=".partial")  # a crashed save: left alone
    other = tmp_path / "other"
    write_checkpoint(other / "actor", 0)
    folders = [ModelFolders("critic", tmp_path / "critic", tmp_path / "critic"),
               ModelFolders("actor", other / "actor", tmp_path / "actor")]  # fmt: skip
    prune_checkpoints(tmp_path, folders, keep=None)
    assert len(list((tmp_path / "actor").glob("iter_*"))) == 5
    removed = prune_checkpoints(tmp_path, folders, keep=2)
    assert sorted(p.name for p in (tmp_path / "actor").glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert sorted(p.name for p in (tmp_path / "critic").glob("iter_*")) == [
        "iter_0000003", "iter_0000004", "iter_0000007.partial"
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "driver").iterdir()) == [
        "iter_0000003.json",
        "iter_0000004.json",
    ]
    assert len(removed) == 9 and (other / "actor" / "iter_0000000").is_dir()
    assert find_resume_point(tmp_path, models(tmp_path)).rollout_id == 4
    for role in ROLES:
        assert read_latest(tmp_path / role) == 4


def test_a_save_is_refused_before_it_writes_where_the_last_checkpoints_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Known after the first save: the next needs about as much as the last took (both models and the
    driver's state, on one device here); with less free, it is refused before anything is written."""
    from tandem.megatron.runtime.checkpoint_folder import DiskFull
    from tandem.megatron.runtime.checkpoint_manifest import checkpoint_bytes
    from tandem.ppo.run import checkpoint as run_checkpoint
    from tandem.ppo.run.checkpoint import check_free_space
    from tandem.ppo.run.state import state_dir

    folders = [tmp_path / "critic", tmp_path / "actor", state_dir(tmp_path)]
    check_free_space(folders)  # nothing saved yet: nothing known
    save_rollouts(tmp_path, range(2))
    needed = sum(checkpoint_bytes(tmp_path / role / "iter_0000001") for role in ROLES)
    needed += (tmp_path / "driver" / "iter_0000001.json").stat().st_size
    real = shutil.disk_usage

    def free(bytes_free: int):  # type: ignore[no-untyped-def]
        return lambda path: real(path)._replace(free=bytes_free)

    monkeypatch.setattr(run_checkpoint.shutil, "disk_usage", free(needed))
    check_free_space(folders)
    monkeypatch.setattr(run_checkpoint.shutil, "disk_usage", free(needed - 1))
    with pytest.raises(DiskFull) as info:
        check_free_space(folders)
    assert str(info.value) == (
        f"no space left on device at {tmp_path / 'critic'}: the save needs about {needed / 1e6:.1f} MB, "
        f"{(needed - 1) / 1e6:.1f} MB free; the last complete checkpoint (rollout 1) is kept; free some space, "
        "then the same command resumes the run"
    )


def test_a_driver_state_that_hits_enospc_is_a_full_disk_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.megatron.runtime.checkpoint_folder import DiskFull

    save_rollouts(tmp_path, range(1))
    monkeypatch.setenv("TANDEM_FAULT_POINT", "driver_state.written:rollout_id=1")
    monkeypatch.setenv("TANDEM_FAULT_ACTION", "enospc")
    with pytest.raises(
        DiskFull, match=rf"^no space left on device at {tmp_path / 'driver'}: the save needs about "
    ):
        save_rollouts(tmp_path, range(1, 2))
    assert sorted(p.name for p in (tmp_path / "driver").iterdir()) == ["iter_0000000.json"]
    assert "the last complete checkpoint (rollout 0) is kept" in str(
        DiskFull(tmp_path, 1, 1, 0, estimate=True)
    )


def test_a_full_disk_is_one_line_and_exit_1() -> None:
    from tandem.megatron.runtime.checkpoint_folder import DiskFull
    from tandem.ppo.run.errors import failure_line

    full = DiskFull(Path("/run/critic"), 3_000_000_000, 1_000_000_000, 4, estimate=True)
    assert failure_line(full) == (1, str(full))
    assert str(full).startswith(
        "no space left on device at /run/critic: the save needs about 3.0 GB, 1.0 GB free"
    )


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
