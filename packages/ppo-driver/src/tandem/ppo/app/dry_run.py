"""`--dry-run`: the resolved config as YAML and where each role lands, printed without starting anything.

The config is validated first, as a run would validate it; the YAML is exactly
what `RUN_DIR/config.yaml` would hold; the placement comes from
`tandem.placement.compute_layout` (pure: no Ray), one line per GPU (bundle) with
each role on it and the share of the GPU that Ray gives it; then the run's memory by arithmetic
(`run_memory.memory_lines`: each GPU's peak and the host's, whether they fit, and the flags that make
them fit where they do not).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.placement import compute_layout
from tandem.ppo.app.run_memory import memory_lines
from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.config.record import run_config_text

__all__ = ["DRY_RUN_FLAG", "dry_run_report", "placement_lines", "split_dry_run"]

DRY_RUN_FLAG = "--dry-run"


def split_dry_run(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """Whether `argv` holds `--dry-run`, and the arguments without it."""
    rest = [arg for arg in argv if arg != DRY_RUN_FLAG]
    return len(rest) != len(argv), rest


def _ranks(role: str, count: int) -> list[str]:
    return [f"{role} {i}" for i in range(count)]


def placement_lines(config: PPOConfig) -> list[str]:
    """One line per GPU of the run: the roles on it and their shares (`GPU 0: actor rank 0 (0.4), ...`)."""

    layout = compute_layout(config.placement_spec())
    gpus: dict[int, list[str]] = {i: [] for i in range(layout.num_gpus)}
    tp, pp = config.topology("actor")
    for position in layout.train_gpus:
        gpus[position].append(f"actor rank {position} ({config.actor_gpu_share:g})")
        if config.use_critic:
            gpus[position].append(f"critic rank {position} ({config.critic_gpu_share:g})")
    engine_share = config.engine_gpu_share if layout.colocated else 1.0
    for engine, position in enumerate(layout.rollout_gpus):
        gpus[position].append(f"{config.rollout_engine} engine {engine} ({engine_share:g})")
    per_node = config.actor_num_gpus_per_node
    lines = [
        f"placement: {layout.num_gpus} GPU(s), layout {layout.case!r}; the actor's ranks are TP {tp} x "
        f"PP {pp} x DP {config.actor_data_parallel_size}"
        + ("; the critic shares the actor's GPUs" if config.use_critic else "; no critic"),
    ]
    for position, roles in gpus.items():
        where = (
            f"node {position // per_node}, "
            if config.actor_num_nodes > 1 and position in layout.train_gpus
            else ""
        )
        lines.append(f"  GPU {position} ({where}bundle {position}): " + (", ".join(roles) or "(idle)"))
    return lines


def dry_run_report(config: PPOConfig) -> str:
    """What `--dry-run` prints: the config.yaml a run would write, then its placement and memory (as YAML comments)."""

    lines = [run_config_text(config).rstrip("\n"), ""]
    lines += [f"# {line}" for line in placement_lines(config)]
    lines += [f"# {line}" for line in memory_lines(config)]
    lines.append(f"# dry run: config valid; nothing started (run without {DRY_RUN_FLAG} to train)")
    return "\n".join(lines) + "\n"
