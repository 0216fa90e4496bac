"""What bench/soak.py computes: each series' slope (a least-squares line per 100 steps, an intercept per
start), and what a process holds (RSS, open file descriptors, threads) read from Linux's /proc.

The driver's process imports this; what runs inside the workers stays in soak.py, whose functions Ray
sends by value.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

RUN_FOLDER_KEY = "run_dir_bytes"
"""The one series fitted over the whole run (the folder carries over from start to start)."""


# --- fits --------------------------------------------------------------------------------------


def fit(points: list[tuple[int, float, int]]) -> dict[str, Any] | None:
    """One slope for (step, value, start) points, an intercept per start; per 100 steps, with its
    standard error, R² within starts, and its share of the mean. None with fewer than 3 points."""
    by_start: dict[int, list[tuple[int, float]]] = {}
    for step, value, start in points:
        by_start.setdefault(start, []).append((step, value))
    sxx = sxy = 0.0
    centred: list[tuple[float, float]] = []
    for pts in by_start.values():
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        centred += [(x - mx, y - my) for x, y in pts]
    for dx, dy in centred:
        sxx += dx * dx
        sxy += dx * dy
    n, dof = len(centred), len(centred) - 1 - len(by_start)
    if n < 3 or sxx == 0 or dof < 1:
        return None
    slope = sxy / sxx
    residual = sum((dy - slope * dx) ** 2 for dx, dy in centred)
    total = sum(dy * dy for _, dy in centred)
    stderr = math.sqrt(residual / dof / sxx)
    mean = sum(v for _, v, _ in points) / len(points)
    return {
        "per_100_steps": 100 * slope,
        "stderr_per_100_steps": 100 * stderr,
        "share_of_mean_per_100_steps": 100 * (100 * slope) / mean if mean else None,
        "r2": 1 - residual / total if total else None,
        "points": n,
        "starts": len(by_start),
        "mean": mean,
    }


def series(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float, int]]]:
    """Every numeric leaf of the records' `values` as (step, value, start) points, by dotted key."""
    out: dict[str, list[tuple[int, float, int]]] = {}

    def walk(prefix: str, node: Any, step: int, start: int) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v, step, start)
        elif isinstance(node, int | float) and not isinstance(node, bool) and math.isfinite(node):
            out.setdefault(prefix, []).append((step, float(node), start))

    for r in records:
        walk("", r["values"], r["step"], r["start"])
    return out


def slopes(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Each series' `fit`: within starts after their first `warmup` steps; the run folder over the run."""
    first = {}
    for r in records:
        first.setdefault(r["start"], r["step"])
    fits: dict[str, Any] = {}
    for key, points in sorted(series(records).items()):
        if key == RUN_FOLDER_KEY:
            fits[key] = fit([(s, v, 0) for s, v, _ in points])
            continue
        kept = [(s, v, st) for s, v, st in points if s >= first[st] + warmup]
        fits[key] = fit(kept)
        if fits[key] is not None:
            each = {st: fit([p for p in kept if p[2] == st]) for st in sorted({p[2] for p in kept})}
            fits[key]["per_start_per_100_steps"] = {st: f and f["per_100_steps"] for st, f in each.items()}
    return fits


# --- what a process holds (Linux /proc; no dependency) ------------------------------------------


def proc_stats(pid: int) -> dict[str, Any] | None:
    """RSS bytes, open file descriptors and threads of process `pid`, and its name; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {
        "rss": rss_kib * 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
        "name": cmdline.strip()[:80],
    }


def descendants(root: int) -> list[int]:
    """The pids below `root` in the process tree (Ray's daemons and workers below the driver)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, pp in parent.items() if pp == pid]
        found += children
        frontier += children
    return found


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def kind_of(cmdline: str) -> str:
    """What one of Ray's processes is, from its command line: `gcs_server`, `raylet`, `ray::IDLE`, ..."""
    first = cmdline.split(" ", 1)[0]
    if first.startswith("ray::"):
        return first
    for word in cmdline.split(" ")[:3]:
        name = os.path.basename(word).removesuffix(".py")
        if name and not name.startswith("python"):
            return name
    return first or "?"


def summary(report: dict[str, Any]) -> str:
    """The slopes as a markdown table (the series that matter: totals, each process, GPU, the folder)."""
    lines = ["| series | mean | per 100 steps | ± (1 s.e.) | % of mean | R² |", "|---|---|---|---|---|---|"]
    for key, f in report["slopes"].items():
        if f is None or key.endswith(".pid") or ".processes" in key:
            continue
        mib = any(w in key for w in ("rss", "bytes", "allocated", "reserved", "buffers"))
        scale, unit = (2**20, " MiB") if mib else (1, "")
        share = f["share_of_mean_per_100_steps"]
        lines.append(
            f"| {key} | {f['mean'] / scale:.2f}{unit} | {f['per_100_steps'] / scale:+.3f}{unit} | "
            f"{f['stderr_per_100_steps'] / scale:.3f} | {'' if share is None else f'{share:+.2f} %'} | "
            f"{'' if f['r2'] is None else f'{f["r2"]:.2f}'} |"
        )
    return "\n".join(lines)
