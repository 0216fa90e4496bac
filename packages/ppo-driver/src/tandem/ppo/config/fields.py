"""The run's fields: every flag of `ppo-driver train`, read from YAML plus command-line overrides, unchecked.

`RunFields` holds the train workers' fields (`WorkerFields`, tandem-megatron-backend,
each declared and documented there once) and what the driver owns: data, rollout,
rewards, placement, the offload plan, checkpoint cadence and logging. The flags stay
flat, with slime/miles names where they exist (`--use-critic`, `--colocate`,
`--offload-train`, `--rollout-batch-size`, ...). It is not a `WorkerConfig`: it
builds one per role, validated, with the role's checkpoint folders resolved
(`actor_config()`, `critic_config()`), and those are what the train groups get.

Nothing here checks anything (so that a YAML file and flags can be merged first):
`PPOConfig` (`ppo_config`) is these fields with `validate()`, which runs the
checks (`checks`) before Ray starts. Derived sizes are properties, computed in
one place; a field's flag is `flag(name)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Literal

from tandem.megatron.config import WorkerConfig, WorkerFields
from tandem.placement import PlacementSpec
from tandem.ppo.config.episode_fields import EpisodeFields
from tandem.ppo.config.memory_fields import MemoryFields
from tandem.ppo.config.rollout_fields import RolloutFields

__all__ = ["BUILTIN_REWARDS", "FLAG_NAMES", "RunFields", "flag"]

BUILTIN_REWARDS = ("exact_match", "math")

FLAG_NAMES = {"async_mode": "async"}
"""Fields whose flag is not their name (`async` is a Python keyword)."""


def flag(name: str) -> str:
    """The command-line flag of config field `name` (`global_batch_size` -> `--global-batch-size`)."""
    return "--" + FLAG_NAMES.get(name, name).replace("_", "-")


FIT_OPTIMIZER_PIECES = 4
"""`optimizer_pieces` when unset where the run may plan its memory (`--memory-plan fit`, or `auto` on a GPU):
each optimizer tag in quarters, so that a turn moves a quarter of a model's moments or main weights, not all
of them, where that is the room it needs."""

CPU_THREADS_MIN_HIDDEN_SIZE = 512
"""The hidden size from which a CPU run's workers get the machine's cores (`cpu_threads` None): on two
cores SmolLM2-135M (hidden 576) trained a forward and backward in 4.1 s on two threads against
7.7 s on one, while the demo's model (hidden 64) stepped slower on two (1.35 against 1.2 s)."""


def _hidden_size(folder: str) -> int | None:
    """The `hidden_size` of a local Hugging Face folder's config.json; None where there is none."""
    path = Path(folder) / "config.json"
    try:
        value = json.loads(path.read_text()).get("hidden_size")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


@dataclasses.dataclass(frozen=True)
class RunFields(RolloutFields, EpisodeFields, MemoryFields, WorkerFields):
    """Everything one PPO run needs, unchecked: the train workers' fields plus the driver's (with those of
    multi-turn rollouts, `EpisodeFields`, of the memory plan, `MemoryFields`, and of what the run samples and
    scores, `RolloutFields`).

    The three fields below are the workers' too; a worker needs them given, while a run
    has defaults for them (a YAML file may give them; `validate` names a missing
    `--hf-checkpoint`) and help text that speaks of the whole run.
    """

    hf_checkpoint: str = ""
    """Hugging Face folder (config.json, safetensors, tokenizer): the model's architecture, the
    actor's, critic's and reference's initial weights, the rollout engine's start and the tokenizer."""

    rollout_batch_size: int = 32
    """Prompts per rollout (each sampled `n_samples_per_prompt` times)."""

    global_batch_size: int = 32
    """Samples per optimizer step (over all data-parallel ranks); must divide a rollout's samples."""

    # --- placement and the offload plan ----------------------------------------------------------
    use_critic: bool = True
    """Train a critic (GAE's baseline); it shares the actor's GPUs and never adds any. Left unset, a
    critic-free `--advantage-estimator` implies `--no-use-critic` (no critic starts, sleeps or
    trains); asked for with one, or turned off with `gae`, it is refused."""

    colocate: bool = True
    """The rollout engine sits on the training GPUs (released during training)."""

    offload_train: bool = True
    """Actor and critic sleep after training and wake before it (they time-share the GPUs);
    `--no-offload-train` keeps both resident, for comparison."""

    actor_num_nodes: int = 1
    """Nodes of the actor (and critic)."""

    actor_num_gpus_per_node: int = 1
    """GPUs per node of the actor (and critic)."""

    rollout_num_gpus: int | None = None
    """GPUs of the rollout engines, one engine per GPU; None: the actor's GPUs when colocated."""

    train_backend: Literal["megatron"] = "megatron"
    """Training backend; the critic and the sleep/wake mechanism need Megatron."""

    actor_gpu_share: float = 0.4
    """Fraction of each shared GPU that Ray gives each actor rank (scheduling, not memory)."""

    critic_gpu_share: float = 0.4
    """Fraction of each shared GPU that Ray gives each critic rank."""

    engine_gpu_share: float = 0.2
    """Fraction of each shared GPU that Ray gives each rollout engine."""

    max_engine_restarts: int = 3
    """Times each rollout engine that dies (out of memory, killed) is started again on its bundle, with
    the current weights and the prompts it lost; one more death ends the run naming its rank. 0: never."""

    # --- checkpoints ---------------------------------------------------------------------------
    save_interval: int | None = None
    """Save a checkpoint every this many steps (and always at the end); None: only at the end."""

    keep_checkpoints: int | None = None
    """Once a save completes, keep the newest this many of the run's checkpoints and remove the older
    ones (both models' and the driver's states); None: keep every one (a 0.5B actor and critic with
    their optimizer states take about 14 GB a save)."""

    save_on_interrupt: bool = True
    """On Ctrl-C, finish the step under way and save before exiting (130); a second Ctrl-C
    exits at once, leaving the last complete checkpoint."""

    export_hf: bool = True
    """Write the actor as a Hugging Face folder to `RUN_DIR/hf` at the end of the run."""

    verify_checkpoint_checksums: bool = True
    """On resume, check every file of the checkpoint resumed from against the xxh3 checksum its save
    recorded (one read of it before Ray starts, at disk speed, which the workers' load then finds in
    the page cache; 0.4 s a GB on one core of a small machine); off: their sizes only, which a stat
    per file checks always. A checkpoint that does not read is set aside, and the run resumes from
    the newest one that does."""

    sigterm_grace_s: float | None = 25.0
    """On SIGTERM (a scheduler's preemption: Slurm, Kubernetes, Ray's autoscaler), seconds to finish the
    step under way and save it, as on Ctrl-C; past them the run stops at once, keeping the last complete
    checkpoint (exit 143 either way, naming what was saved). Set it a few seconds below the scheduler's
    own grace period before its SIGKILL (Kubernetes' terminationGracePeriodSeconds and Slurm's KillWait
    are 30 s by default). None: no limit."""

    # --- cluster and logging ----------------------------------------------------------------
    ray_address: str | None = None
    """Ray cluster to join; None: `RAY_ADDRESS`, else a local cluster."""

    local_gpus: int | None = None
    """Logical GPUs of a local Ray cluster on a machine without GPUs (CPU runs); None: what Ray
    detects."""

    tensorboard: bool = True
    """Write TensorBoard event files under RUN_DIR/tensorboard."""

    gpu_memory_metrics: bool = True
    """On GPUs, record each phase's device memory in use (`memory/<phase>_gib`, from nvidia-smi)."""

    progress: bool = True
    """Show a progress bar with the key figures."""

    policy_change_count: bool = True
    """At each weight sync, count the elements of the engine's weights that changed in it and since the
    start, on the engine's device as the sync copies (`policy/changed_fraction`,
    `policy/changed_fraction_since_start`; the embedded engine; one bit of GPU memory a weight). Off:
    neither is measured (the sync's time without the count)."""

    hints: bool = True
    """Say once, on the terminal and in RUN_DIR/logs/driver.log, why a run that is not learning may not
    be: sampling weights that barely change, rewards without signal, a critic that explains nothing,
    responses cut short, each with what was measured and the flag to change (docs/troubleshooting.md).
    Off: not said (events.jsonl still records them)."""

    # --- experiment trackers (extras tandem-ppo-driver[wandb] and [mlflow]) --------------------
    use_wandb: bool = False
    """Log every step's metrics (as metrics.jsonl has them) and the resolved config to Weights & Biases."""

    wandb_project: str = "tandem"
    """The wandb project of the run."""

    wandb_team: str | None = None
    """The wandb entity (team or user) of the run; None: your default entity."""

    wandb_group: str | None = None
    """The wandb group of the run (runs to compare side by side, e.g. shared vs resident)."""

    wandb_run_name: str | None = None
    """The wandb run's name; None: the name of RUN_DIR."""

    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """`offline`: write the run locally (`wandb sync` uploads it later); `disabled`: log nothing."""

    wandb_dir: str | None = None
    """Folder of wandb's own files; None: RUN_DIR (they go to RUN_DIR/wandb)."""

    use_mlflow: bool = False
    """Log every step's metrics (as metrics.jsonl has them) and the resolved config (as run
    parameters) to MLflow."""

    mlflow_tracking_uri: str | None = None
    """The MLflow tracking server or store; None: a local `file:` store at RUN_DIR/mlruns."""

    mlflow_experiment_name: str = "tandem"
    """The MLflow experiment the run is logged under (created when missing)."""

    # --- derived sizes -------------------------------------------------------------------
    @property
    def actor_num_gpus(self) -> int:
        """GPUs (ranks) of the actor, and of the critic that shares them."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        """Rollout engines, one per rollout GPU."""
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.actor_num_gpus

    @property
    def actor_data_parallel_size(self) -> int:
        """Data-parallel size of the actor."""
        return self.data_parallel_size(self.actor_num_gpus, "actor")

    @property
    def syncs_adapters(self) -> bool:
        """Whether the weight sync sends the LoRA actor's adapters rather than its merged weights (`lora_sync`)."""
        if self.lora_rank is None or self.lora_sync == "merged":
            return False
        return self.lora_sync == "adapters" or self.rollout_engine == "embedded"

    @property
    def reward_spec(self) -> str:
        """What `load_reward` is given: the custom reward if set, else the built-in."""
        return self.custom_rm_path or self.rm_type

    @property
    def actor_save(self) -> str:
        """The actor's checkpoint folder: `--save`, else RUN_DIR/actor."""
        return self.save or str(Path(self.run_dir) / "actor")

    @property
    def critic_save_dir(self) -> str:
        """The critic's checkpoint folder: `--critic-save`, else RUN_DIR/critic."""
        return self.critic_save or str(Path(self.run_dir) / "critic")

    def actor_config(self) -> WorkerConfig:
        """The actor group's config: this run's worker fields, checked, its checkpoints resumable.

        The actor saves to `actor_save` and resumes from `--load`, or else from that folder (a
        run started again in the same RUN_DIR continues where it stopped). The critic's folders
        are left out: the actor never reads them. ValueError naming the field where the fields
        break a rule of `WorkerConfig`.
        """
        return self._worker_config(critic_save=None, critic_load=None)

    def critic_config(self) -> WorkerConfig | None:
        """The critic group's config, as `actor_config` for the critic; None when the run trains no critic.

        The critic saves to `critic_save_dir` and resumes from `--critic-load`, or else from that
        folder. It holds the actor's folders too (the critic never reads them; `WorkerConfig`
        checks against them that the critic's are its own). No critic: `--no-use-critic`, which
        a critic-free `--advantage-estimator` implies.
        """
        if not self.use_critic:
            return None
        return self._worker_config(
            critic_save=self.critic_save_dir, critic_load=self.critic_load or self.critic_save_dir
        )

    def _worker_config(self, **critic_folders: str | None) -> WorkerConfig:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerFields)}
        values |= {"save": self.actor_save, "load": self.load or self.actor_save, **critic_folders}
        if self.async_mode and self.reuse_old_log_probs is None:
            # A rollout one step stale: the old log-probs stay a forward of their own (auto only).
            values["reuse_old_log_probs"] = False
        if self.optimizer_pieces is None and self.may_plan_memory and self.offload_backend == "pinned_host":
            # The plan may then sleep a part of each optimizer tag: the part a turn needs room for.
            values["optimizer_pieces"] = FIT_OPTIMIZER_PIECES
        values["cpu_threads"] = self.resolved_cpu_threads()
        if self.loss_norm_tokens is None:
            # Dr.GRPO's constant: the generation budget, the longest response the engines may give.
            values["loss_norm_tokens"] = self.rollout_max_response_len
        return WorkerConfig(**values)

    @property
    def may_plan_memory(self) -> bool:
        """Whether the run takes its memory plan after the first step: `fit`, or `auto` with `--offload-train`
        on a device that is not the CPU (a GPU run; whether its engines report the GPU's memory is
        known only then, `loop.step_plans.auto_plans`)."""
        if self.memory_plan == "fit":
            return True
        return self.memory_plan == "auto" and self.offload_train and self.device != "cpu"

    def resolved_cpu_threads(self) -> int | None:
        """`cpu_threads`, or where None the driver's choice: this machine's cores where the models
        take turns (the sync loop) on a CPU run of a model whose hidden size is at least
        `CPU_THREADS_MIN_HIDDEN_SIZE`, else None (the workers keep Ray's one thread). Workers and
        engines on a GPU never read it, so `device: auto` needs no look at the GPUs here."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        if self.async_mode or self.device == "cuda":
            return None
        hidden = [_hidden_size(p) for p in (self.hf_checkpoint, self.critic_hf_checkpoint) if p]
        if not hidden or min(h or 0 for h in hidden) < CPU_THREADS_MIN_HIDDEN_SIZE:
            return None
        return len(os.sched_getaffinity(0))

    def placement_spec(self) -> PlacementSpec:
        """The tandem.placement spec of this run."""
        return PlacementSpec(
            actor_num_nodes=self.actor_num_nodes,
            actor_num_gpus_per_node=self.actor_num_gpus_per_node,
            rollout_num_gpus=self.num_engines,
            colocate=self.colocate,
            use_critic=self.use_critic,
        )
