"""`ppo-driver plot`: PNG curves of one or more runs' metrics.jsonl, one figure per metric group.

A metric's group is its name before the first "/" (`reward/mean` → `reward`;
a name without "/" goes to `other`). Each figure has one panel per metric of its
group and one line per run, so two runs (say shared and resident placement)
overlay in the same PNG. Every panel's y-axis names its unit (`UNITS`: seconds,
GiB, tokens/s, ...). A metric that is 0 at every step of every run (its feature
was off: `async/staleness` without `--async`) gets no panel, but for `policy/`
(`KEEP_AT_ZERO`: no weight changed is the figure to see). The lifecycle's
seconds (`lifecycle/<role>_<sleep|wake>/<stage>`) make one panel per role (and
run): at each step a sleep bar and a wake bar, each stacked by stage. Figures
are drawn with matplotlib's object API on the Agg canvas: no pyplot, no global
backend switch, no display needed.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.megatron.choices import memory_tag_kind
from tandem.ppo.run.metrics import read_metrics

__all__ = ["KEEP_AT_ZERO", "UNITS", "Panel", "panels", "plot_run", "unit_of"]

_COLUMNS = 3
_SUBPLOT_SIZE = (4.5, 3.0)
"""Inches per subplot (width, height)."""
_LINESTYLES = ("-", "--", ":", "-.")
"""One per run, in turn, so that runs with equal curves still show each line."""

UNITS: tuple[tuple[str, str], ...] = (
    (r"^(time|lifecycle)/", "seconds"),
    (r"_gib$", "GiB"),
    (r"tokens_per_s$", "tokens/s"),
    (r"response_length$", "tokens"),
    (r"(^|/)lr$", "learning rate"),
    (r"(accuracy|_frac|_fraction|_fraction_since_start|truncated|tied_groups|critic_only)$", "fraction"),
    (r"explained_variance(_window)?$", "explained variance"),
    (r"log_prob_gap$", "|log-prob difference| (nats)"),
    (r"^(reward|eval)/(mean|std)$", "reward"),
    (r"(^loss/|_loss$)", "loss"),
    (r"(^|/)(approx_kl|kl)$", "KL (nats)"),
    (r"entropy$", "entropy (nats)"),
    (r"log_prob$", "log-prob (nats)"),
    (r"_prompts$", "prompts"),
    (r"epoch$", "epochs"),
    (r"staleness$", "steps"),
    (r"grad_norm$", "gradient norm"),
)
"""(regex, unit) of the y-axis, first match wins; other metrics are labelled with their own name."""

KEEP_AT_ZERO = re.compile(r"^policy/")
"""Metrics drawn even when 0 throughout: `policy/changed_fraction` at 0 says the sampling weights never
changed, which is what a run that does not learn may need to show."""

_LIFECYCLE = re.compile(r"^lifecycle/(?P<role>\w+?)_(?P<phase>sleep|wake)/(?P<stage>[\w.]+)$")
"""A lifecycle step's seconds; a stage may be one piece of a memory tag (`pause_optimizer_moments.2`)."""


@dataclass(frozen=True)
class Panel:
    """One subplot: a metric's curves (`keys` = one key), or a role's lifecycle stages (`role` set)."""

    title: str
    ylabel: str
    keys: tuple[str, ...]
    role: str | None = None
    run: int | None = None
    """For a lifecycle panel: which run (index) it shows."""


def unit_of(key: str) -> str:
    """The y-axis label of metric `key`."""
    for pattern, unit in UNITS:
        if re.search(pattern, key):
            return unit
    return key.rsplit("/", 1)[-1].replace("_", " ")


def _group(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "other"


def _series(rows: list[dict[str, object]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per metric, its steps and values, in the order logged; non-numbers are skipped."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        step = row["step"]
        assert isinstance(step, int)
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(float(value))
    return series


Series = dict[str, tuple[list[int], list[float]]]


def panels(runs: Sequence[Series]) -> dict[str, list[Panel]]:
    """The figures to draw for `runs` (each a metric's steps and values): group -> its panels."""
    keys = sorted({key for series in runs for key in series})
    # A metric at 0 throughout every run measured a feature that was off: no panel for it.
    live = [k for k in keys if KEEP_AT_ZERO.match(k) or any(v != 0 for s in runs if k in s for v in s[k][1])]
    groups: dict[str, list[Panel]] = defaultdict(list)
    stages_of_role: dict[str, set[str]] = defaultdict(set)
    for key in live:
        match = _LIFECYCLE.match(key)
        if match is not None:
            if match["stage"] != "total":  # the sum of the stages, which the stacks show
                stages_of_role[match["role"]].add(key)
            continue
        groups[_group(key)].append(Panel(key, unit_of(key), (key,)))
    for role, stage_keys in sorted(stages_of_role.items()):
        for index in range(len(runs)):
            if any(k in runs[index] for k in stage_keys):
                title = f"{role}: sleep | wake by stage" + (f" (run {index + 1})" if len(runs) > 1 else "")
                groups["lifecycle"].append(Panel(title, "seconds", tuple(sorted(stage_keys)), role, index))
    return dict(groups)


def _draw_stages(ax: Any, panel: Panel, series: Series) -> None:
    """At each step a sleep bar (left) and a wake bar (right, hatched), each stacked by stage."""
    colors: dict[str, str] = {}
    width = 0.38
    for phase, shift in (("sleep", -width / 2), ("wake", width / 2)):
        bottoms: dict[int, float] = defaultdict(float)
        for key in panel.keys:
            match = _LIFECYCLE.match(key)
            if match is None or match["phase"] != phase or key not in series:
                continue
            # The pieces of a tag (`optimizer_moments.0` …) stack in their kind's one colour.
            stage = memory_tag_kind(match["stage"].removeprefix("pause_").removeprefix("resume_"))
            new_stage = stage not in colors
            color = colors.setdefault(stage, f"C{len(colors) % 10}")
            steps, values = series[key]
            ax.bar(
                [s + shift for s in steps],
                values,
                width,
                bottom=[bottoms[s] for s in steps],
                color=color,
                label=stage if new_stage else None,
                hatch="//" if phase == "wake" else None,
                edgecolor="white",
                linewidth=0.3,
            )
            for s, v in zip(steps, values, strict=True):
                bottoms[s] += v
    # A fixed corner: "best" searches the bars and warns (an error under the tests) on many steps.
    ax.legend(fontsize=7, title="stage (hatched: wake)", title_fontsize=7, loc="upper left")


def plot_run(
    run_dirs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    labels: Sequence[str] | None = None,
) -> list[Path]:
    """Write `out_dir/<group>.png` for every metric group of the runs; return the paths, sorted.

    `labels` names the runs in the legends (default: each run directory's name).
    Raises ValueError when a run directory has no metrics.jsonl, when `labels`
    does not match `run_dirs`, or when there is nothing to plot.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_paths = [Path(d) for d in run_dirs]
    if not run_paths:
        raise ValueError("plot_run needs at least one run directory")
    if labels is None:
        labels = [p.resolve().name or str(p) for p in run_paths]
    if len(labels) != len(run_paths):
        raise ValueError(f"{len(labels)} labels for {len(run_paths)} run directories; give one label per run")
    runs = [(label, _series(read_metrics(path))) for label, path in zip(labels, run_paths, strict=True)]
    figures = panels([series for _, series in runs])
    if not figures:
        raise ValueError(f"nothing to plot: {', '.join(map(str, run_paths))} hold no metrics yet")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for group, group_panels in sorted(figures.items()):
        ncols = min(_COLUMNS, len(group_panels))
        nrows = math.ceil(len(group_panels) / ncols)
        fig = Figure(figsize=(_SUBPLOT_SIZE[0] * ncols, _SUBPLOT_SIZE[1] * nrows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax, panel in zip(axes, group_panels, strict=False):
            if panel.role is not None and panel.run is not None:
                _draw_stages(ax, panel, runs[panel.run][1])
            else:
                key = panel.keys[0]
                for i, (label, series) in enumerate(runs):
                    if key in series:
                        steps, values = series[key]
                        # Markers where there are few points, so that a single point still shows.
                        marker = "o" if len(steps) <= 20 else None
                        linestyle = _LINESTYLES[i % len(_LINESTYLES)]
                        ax.plot(steps, values, label=label, linestyle=linestyle, marker=marker, markersize=3)
                if len(runs) > 1:
                    ax.legend(fontsize=8, loc="upper left")
            ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
        for ax in axes[len(group_panels) :]:
            ax.set_visible(False)
        fig.suptitle(group)
        path = out / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', group)}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
