"""bench/ppo_gpu_bench.py's A/B of the weight sync's count of changed weights, without a run: the
shared_no_count mode's config, the report's cost by hand, the flags (the quick run in
test_ppo_gpu_bench.py checks the figures exist; the real A/B is on an H200)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ppo_gpu_bench  # noqa: E402
import ppo_modes  # noqa: E402
import ppo_report  # noqa: E402


def _mode_values(tmp_path: Path, flag: str, *modes: str) -> list[dict[str, Any]]:
    """The PPOConfig fields of each of `modes` in a `--quick` bench run with the A/B `flag`."""
    args = ppo_gpu_bench.parse_args(["--quick", "--out", str(tmp_path), flag])
    args.stop_token_ids = ()  # main's, from the shape and the lengths
    paths = (tmp_path / "hf", tmp_path / "data.jsonl", tmp_path / "reward.py", tmp_path / "run")
    return [ppo_modes.ppo_values(args, mode, *paths) for mode in modes]


def test_the_no_count_mode_is_the_shared_mode_with_the_count_off(tmp_path: Path) -> None:
    args = ppo_gpu_bench.parse_args(["--quick", "--out", str(tmp_path), "--ab-policy-change-count"])
    args.stop_token_ids = ()  # main's, from the shape and the lengths
    paths = (tmp_path / "hf", tmp_path / "data.jsonl", tmp_path / "reward.py", tmp_path / "run")
    shared = ppo_modes.ppo_values(args, "shared", *paths)
    off = ppo_modes.ppo_values(args, ppo_modes.NO_COUNT_MODE, *paths)
    assert off == {**shared, "policy_change_count": False}
    assert "policy_change_count" not in shared  # the run's default: on


def test_no_count_everywhere_and_the_ab_exclude_each_other(tmp_path: Path) -> None:
    args = ppo_gpu_bench.parse_args(["--quick", "--out", str(tmp_path), "--no-policy-change-count"])
    assert args.overrides == {"policy_change_count": False}
    with pytest.raises(SystemExit):
        ppo_gpu_bench.parse_args(
            ["--out", str(tmp_path), "--no-policy-change-count", "--ab-policy-change-count"]
        )


def test_the_counts_cost_is_the_syncs_seconds_with_against_without() -> None:
    counted = {"phase_s_mean": {"weight_sync": 0.105}, "engine_weight_update_s": 0.012}
    uncounted = {"phase_s_mean": {"weight_sync": 0.100}, "engine_weight_update_s": 0.008}
    cost = ppo_report.count_cost(counted, uncounted)
    assert cost is not None
    # 0.105 / 0.100 - 1 = 5 % of the sync; the engine's own part: (0.012 - 0.008) / 0.100 = 4 %.
    assert cost["count_share_of_sync"] == pytest.approx(0.05)
    assert cost["engine_count_share_of_sync"] == pytest.approx(0.04)
    assert ppo_report.count_cost(counted, {}) is None


def test_the_fit_mode_is_the_shared_mode_with_the_memory_plan_and_its_cost_against_both(
    tmp_path: Path,
) -> None:
    """`--ab-memory-plan`: the shared_fit mode's config, and the report's figures by hand."""
    args = ppo_gpu_bench.parse_args(["--quick", "--out", str(tmp_path), "--ab-memory-plan"])
    assert args.ab_memory_plan
    args.stop_token_ids = ()
    paths = (tmp_path / "hf", tmp_path / "data.jsonl", tmp_path / "reward.py", tmp_path / "run")
    shared = ppo_modes.ppo_values(args, "shared", *paths)
    fit = ppo_modes.ppo_values(args, ppo_modes.FIT_MODE, *paths)
    assert fit == {
        **shared,
        "memory_plan": "fit",
        "overlap_moves": True,
        "gpu_memory_gib": 64.0,
        "memory_margin_gib": 0.0,
    }
    assert fit["offload_train"], "the plan's mode shares the GPU"
    cost = ppo_report.plan_cost(
        {"step_s_mean": 6.3},
        {"step_s_mean": 5.4},
        {"step_s_mean": 5.5, "moved_gib": [None, 3.0, 1.5], "gpu_peak_gib": {"overall": 40.0}},
    )
    assert cost is not None
    assert cost["fit_over_resident"] == pytest.approx(5.5 / 5.4 - 1)
    assert cost["fit_over_shared"] == pytest.approx(5.5 / 6.3 - 1)
    assert cost["moved_gib"] == [None, 3.0, 1.5] and cost["gpu_peak_gib"] == 40.0
    assert ppo_report.plan_cost({"step_s_mean": 6.3}, {"step_s_mean": 5.4}, {}) is None


def test_the_serial_fit_mode_is_the_fit_mode_with_its_moves_one_after_the_other(tmp_path: Path) -> None:
    """`--ab-overlap-moves`: shared_fit_serial's config, and the report's figures by hand."""
    fit, serial = _mode_values(tmp_path, "--ab-overlap-moves", ppo_modes.FIT_MODE, ppo_modes.FIT_SERIAL_MODE)
    assert serial == {**fit, "overlap_moves": False}
    assert "handover" in ppo_modes.SHARING_PHASES, "the moves at once count as what sharing adds"
    at_once = {
        "step_s_mean": 9.0,
        "phase_s_mean": {"handover": 0.4, "actor_wake": 0.1, "critic_train": 2.0},
        "moved_gib": [None, 8.0],
    }
    one_by_one = {
        "step_s_mean": 9.5,
        "phase_s_mean": {"actor_sleep": 0.3, "actor_wake": 0.3, "critic_sleep": 0.2, "critic_wake": 0.1},
        "moved_gib": [None, 8.0],
    }
    cost = ppo_report.overlap_cost(at_once, one_by_one)
    assert cost is not None
    assert cost["moves_s"] == {"at_once": pytest.approx(0.5), "serial": pytest.approx(0.9)}
    assert cost["at_once_over_serial"] == pytest.approx(9.0 / 9.5 - 1)
    assert cost["handover_s"] == 0.4 and cost["moved_gib"]["serial"] == [None, 8.0]
    assert ppo_report.overlap_cost(at_once, {}) is None


def test_the_whole_tags_fit_mode_is_the_fit_mode_with_one_piece_a_tag(tmp_path: Path) -> None:
    """`--ab-optimizer-pieces`: shared_fit_whole_tags' config, and the report's figures by hand."""
    fit, whole = _mode_values(
        tmp_path, "--ab-optimizer-pieces", ppo_modes.FIT_MODE, ppo_modes.FIT_WHOLE_TAGS_MODE
    )
    assert whole == {**fit, "optimizer_pieces": 1} and "optimizer_pieces" not in fit  # fit's default: 4
    cost = ppo_report.pieces_cost(
        {"step_s_mean": 9.0, "moved_gib": [None, 6.0]}, {"step_s_mean": 9.6, "moved_gib": [None, 8.0]}
    )
    assert cost is not None
    assert cost["pieces_over_whole_tags"] == pytest.approx(9.0 / 9.6 - 1)
    assert cost["moved_gib"] == {"pieces": [None, 6.0], "whole_tags": [None, 8.0]}
    assert ppo_report.pieces_cost({}, {"step_s_mean": 9.6}) is None


def test_the_no_prefetch_fit_mode_is_the_fit_mode_with_each_wake_at_its_turn(tmp_path: Path) -> None:
    """`--ab-prefetch`: shared_fit_no_prefetch's config, and the report's figures by hand."""
    fit, at_turn = _mode_values(tmp_path, "--ab-prefetch", ppo_modes.FIT_MODE, ppo_modes.FIT_NO_PREFETCH_MODE)
    assert at_turn == {**fit, "prefetch_wakes": False} and "prefetch_wakes" not in fit  # fit's default: on
    cost = ppo_report.prefetch_cost(
        {
            "step_s_mean": 9.0,
            "phase_s_mean": {"actor_wake": 0.1, "critic_wake": 0.05},
            "moved_gib": [None, 6.0],
        },
        {
            "step_s_mean": 9.8,
            "phase_s_mean": {"actor_wake": 0.6, "critic_wake": 0.3},
            "moved_gib": [None, 6.0],
        },
    )
    assert cost is not None
    assert cost["wakes_s"] == {"prefetch": pytest.approx(0.15), "at_turn": pytest.approx(0.9)}
    assert cost["prefetch_over_at_turn"] == pytest.approx(9.0 / 9.8 - 1)
    assert cost["moved_gib"] == {"prefetch": [None, 6.0], "at_turn": [None, 6.0]}
    assert ppo_report.prefetch_cost({"step_s_mean": 9.0}, {}) is None


def test_the_kv_saver_fit_mode_is_the_fit_mode_with_the_kv_cache_in_a_saver_region(tmp_path: Path) -> None:
    """`--ab-kv-saver`: shared_fit_kv_saver's config, and the report's figures by hand."""
    fit, saver = _mode_values(tmp_path, "--ab-kv-saver", ppo_modes.FIT_MODE, ppo_modes.FIT_KV_SAVER_MODE)
    assert saver == {**fit, "rollout_kv_cache_backend": "torch_memory_saver"}
    assert "rollout_kv_cache_backend" not in fit  # the default: torch's allocator
    cost = ppo_report.kv_saver_cost(
        {"step_s_mean": 9.0, "phase_s_mean": {"engine_release": 0.05, "generate": 2.1}},
        {"step_s_mean": 8.8, "phase_s_mean": {"engine_release": 0.01, "generate": 2.0}},
    )
    assert cost is not None
    assert cost["saver_over_torch"] == pytest.approx(8.8 / 9.0 - 1)
    assert (
        cost["phase_s"]["torch"]["engine_release"] == 0.05
        and cost["phase_s"]["torch"]["engine_resume"] is None
    )
    assert cost["phase_s"]["torch_memory_saver"]["generate"] == 2.0
    assert ppo_report.kv_saver_cost({"step_s_mean": 9.0}, {}) is None
