"""The plots' panels: a unit on every y-axis, none for a metric that stayed 0, the lifecycle one panel per role."""

from __future__ import annotations

from pathlib import Path

from tandem.ppo.app.plot import panels, plot_run, unit_of
from tandem.ppo.run.metrics import MetricsLogger


def _series(rows: list[dict[str, float]]) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step, row in enumerate(rows):
        for key, value in row.items():
            out.setdefault(key, ([], []))[0].append(step)
            out[key][1].append(value)
    return out


def test_units_name_what_the_axis_measures() -> None:
    assert unit_of("time/step") == "seconds"
    assert unit_of("lifecycle/actor_sleep/pause_weights") == "seconds"
    assert unit_of("memory/actor_train_gib") == "GiB"
    assert unit_of("throughput/tokens_per_s") == "tokens/s"
    assert unit_of("reward/response_length") == "tokens"
    assert unit_of("reward/accuracy") == "fraction"
    assert unit_of("actor/grad_norm") == "gradient norm"
    assert unit_of("actor/some_new_figure") == "some new figure"
    assert unit_of("policy/changed_fraction") == unit_of("policy/changed_fraction_since_start") == "fraction"
    assert unit_of("reward/tied_groups") == unit_of("eval/tied_groups") == "fraction"
    assert unit_of("critic/explained_variance_window") == "explained variance"
    assert unit_of("actor/sampler_log_prob_gap") == "|log-prob difference| (nats)"
    assert unit_of("time/engine_weight_update") == "seconds"


def test_a_metric_that_stayed_zero_gets_no_panel() -> None:
    rows = [{"async/staleness": 0.0, "reward/mean": 0.1, "actor/dual_clip_frac": 0.0}] * 3
    shared = _series(rows)
    figures = panels([shared])
    assert set(figures) == {"reward"}
    # Zero in one run but not in another: the panel stays, for both.
    other = _series([{**r, "async/staleness": 1.0} for r in rows])
    assert [p.keys for p in panels([shared, other])["async"]] == [("async/staleness",)]


def test_the_policys_movement_gets_its_figure_even_when_no_weight_changed(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=3, progress=False, tensorboard=False) as logger:
        for step in range(3):
            logger.log(
                step,
                {
                    "policy/changed_fraction": 0.0,
                    "policy/changed_fraction_since_start": 0.0,
                    "reward/tied_groups": 1.0,
                    "critic/explained_variance_window": -0.5,
                    "actor/sampler_log_prob_gap": 0.01,
                },
            )
    paths = {p.name: p for p in plot_run([tmp_path], tmp_path / "plots")}
    assert set(paths) == {"policy.png", "reward.png", "critic.png", "actor.png"}
    assert [p.keys for p in panels([_series([{"policy/changed_fraction": 0.0}])])["policy"]] == [
        ("policy/changed_fraction",)
    ]


def test_the_lifecycle_is_one_panel_per_role_stacking_sleep_and_wake_by_stage() -> None:
    stages = ("pause_weights", "pause_optimizer_moments", "pause_main_params.1", "clear_caches", "total")
    row = {f"lifecycle/{role}_sleep/{s}": 0.1 for role in ("actor", "critic") for s in stages}
    row.update({f"lifecycle/{role}_wake/resume_weights": 0.2 for role in ("actor", "critic")})
    (actor, critic) = panels([_series([row, row])])["lifecycle"]
    assert (actor.role, critic.role) == ("actor", "critic")
    assert actor.ylabel == "seconds" and all("total" not in k for k in actor.keys)
    assert set(actor.keys) == {
        "lifecycle/actor_sleep/pause_weights",
        "lifecycle/actor_sleep/pause_optimizer_moments",
        "lifecycle/actor_sleep/pause_main_params.1",  # a piece of a tag (`--optimizer-pieces`)
        "lifecycle/actor_sleep/clear_caches",
        "lifecycle/actor_wake/resume_weights",
    }


def test_the_lifecycle_figure_draws(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=2, progress=False, tensorboard=False) as logger:
        for step in range(2):
            logger.log(
                step, {"lifecycle/actor_sleep/pause_weights": 0.1, "lifecycle/actor_wake/resume_weights": 0.2}
            )
    (path,) = plot_run([tmp_path], tmp_path / "plots")
    assert path.name == "lifecycle.png" and path.stat().st_size > 5000
