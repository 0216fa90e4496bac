"""`ppo-driver plot`: PNG curves of one or more runs' metrics.jsonl, one figure per metric group.

A metric's group is its name before the first "/" (`reward/mean` → `reward`;
a name without "/" goes to `other`). Each figure has one subplot per metric of
its group and one line per run, so two runs (say shared and resident placement)
overlay in the same PNG. Figures are drawn with matplotlib's object API on the
Agg canvas: no pyplot, no global backend switch, no display needed.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .metrics import read_metrics

_COLUMNS = 3
_SUBPLOT_SIZE = (4.5, 3.0)
"""Inches per subplot (width, height)."""
_LINESTYLES = ("-", "--", ":", "-.")
"""One per run, in turn, so that runs with equal curves still show each line."""


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

    run_paths = [Path(d) for d in run_dirs]
    if not run_paths:
        raise ValueError("plot_run needs at least one run directory")
    if labels is None:
        labels = [p.resolve().name or str(p) for p in run_paths]
    if len(labels) != len(run_paths):
        raise ValueError(f"{len(labels)} labels for {len(run_paths)} run directories; give one label per run")
    runs = [(label, _series(read_metrics(path))) for label, path in zip(labels, run_paths, strict=True)]

    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted({key for _, series in runs for key in series}):
        groups[_group(key)].append(key)
    if not groups:
        raise ValueError(f"nothing to plot: {', '.join(map(str, run_paths))} hold no metrics yet")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for group, keys in sorted(groups.items()):
        ncols = min(_COLUMNS, len(keys))
        nrows = math.ceil(len(keys) / ncols)
        fig = Figure(figsize=(_SUBPLOT_SIZE[0] * ncols, _SUBPLOT_SIZE[1] * nrows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax, key in zip(axes, keys, strict=False):
            for i, (label, series) in enumerate(runs):
                if key in series:
                    steps, values = series[key]
                    # Markers where there are few points, so that a single point still shows.
                    marker = "o" if len(steps) <= 20 else None
                    linestyle = _LINESTYLES[i % len(_LINESTYLES)]
                    ax.plot(steps, values, label=label, linestyle=linestyle, marker=marker, markersize=3)
            ax.set_title(key, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if len(runs) > 1:
                ax.legend(fontsize=8)
        for ax in axes[len(keys) :]:
            ax.set_visible(False)
        fig.suptitle(group)
        path = out / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', group)}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
