"""The run folder is the user's record: locked while a run uses it, left as it was by a start that fails.

`RunFolder.open(config)` runs before Ray starts and writes nothing but the lock
(`run_lock`): it finds where the run resumes (`run_checkpoint.find_resume_point`),
refuses flags that cannot change on resume (`FIXED_ON_RESUME`, naming each one with
its old and new value), and tells a finished run apart (`complete`). Only once
the run's processes are up does `commit` change the folder: it sets aside the
checkpoint parts that no resume uses and writes `config.yaml`. `close` releases
the lock; when nothing was committed it also removes the folder if this start
created it and left it empty, so a failed start leaves no stub behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from tandem.megatron.choices import Role
from tandem.megatron.config import WorkerConfig
from tandem.ppo.config.fields import flag
from tandem.ppo.config.file import read_yaml
from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.config.record import write_run_config
from tandem.ppo.run.checkpoint import ModelFolders, ResumePoint, find_resume_point, set_aside
from tandem.ppo.run.lock import RunLock

__all__ = ["CONFIG_FILE", "FIXED_ON_RESUME", "RunFolder"]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.run_folder")

CONFIG_FILE = "config.yaml"

_FIXED_GROUPS: dict[str, tuple[str, ...]] = {
    "the models' shape and weights": (
        "hf_checkpoint", "critic_hf_checkpoint", "ref_load", "params_dtype", "use_critic", "train_backend",
        "lora_rank", "lora_alpha", "lora_target_modules",
        "critic_lora_rank", "critic_lora_alpha", "critic_lora_target_modules",
    ),
    "the optimizer state and learning-rate schedule in the checkpoints": (
        "lr", "critic_lr", "min_lr", "lr_decay_style", "lr_warmup_steps", "lr_decay_steps",
        "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "global_batch_size",
    ),
    "the layout the checkpoints are sharded for": (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "critic_tensor_model_parallel_size", "critic_pipeline_model_parallel_size",
        "actor_num_nodes", "actor_num_gpus_per_node",
    ),
    "the data cursor (which prompts come next)": (
        "prompt_data", "input_key", "max_prompt_len", "apply_chat_template", "rollout_batch_size", "seed",
    ),
    "where the checkpoints are": ("save", "critic_save"),
}  # fmt: skip

FIXED_ON_RESUME: dict[str, str] = {name: why for why, names in _FIXED_GROUPS.items() for name in names}
"""Fields that a resumed run must keep, and why; every other flag may change on resume."""

_MAY_CHANGE = (
    "the run length (--num-rollout), checkpoint and eval cadence (--save-interval, --eval-interval), "
    "the PPO coefficients, sampling, logging and the cluster (--ray-address)"
)


def _normalised(name: str, value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_normalised(name, v) for v in value]
    if name in _PATH_FIELDS and isinstance(value, str) and value:
        return os.path.abspath(value)
    return value


_PATH_FIELDS = frozenset(
    {"hf_checkpoint", "critic_hf_checkpoint", "ref_load", "prompt_data", "save", "critic_save"}
)


class RunFolder:
    """One start's hold on RUN_DIR: its lock, where it resumes, and whether it changed anything yet."""

    def __init__(self, config: PPOConfig, lock: RunLock, created: bool, resume: ResumePoint) -> None:
        self.config = config
        self.path = Path(config.run_dir)
        self.lock = lock
        self.created = created
        self.resume = resume
        self.committed = False

    # --- before Ray: read only, but for the lock --------------------------------------------
    @classmethod
    def open(cls, config: PPOConfig) -> RunFolder:
        """Lock RUN_DIR and find where it resumes; ValueError naming the flag on a folder in use or a
        fixed flag changed. Creates RUN_DIR (for the lock) when it does not exist."""
        path = Path(config.run_dir)
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        try:
            lock = RunLock.acquire(path)
        except BaseException:
            if created:
                _remove_if_empty(path)
            raise
        try:
            resume = find_resume_point(
                path,
                model_folders(config),
                requested=config.load_rollout_id,
                checksums=config.verify_checkpoint_checksums,
            )
            folder = cls(config, lock, created, resume)
            if resume.rollout_id is not None:
                folder._check_fixed_flags()
        except BaseException:
            lock.release()
            if created:
                _remove_if_empty(path)
            raise
        return folder

    @property
    def complete(self) -> bool:
        """Whether every rollout of `--num-rollout` is saved (and the HF export written, when asked)."""
        done = self.resume.rollout_id is not None and self.resume.rollout_id >= self.config.num_rollout - 1
        exported = not self.config.export_hf or (self.path / "hf" / "config.json").is_file()
        return done and exported

    def actor_config(self) -> WorkerConfig:
        """The actor's config (`PPOConfig.actor_config`), loading the resume point's rollout (or nothing)."""
        return self._resumed(self.config.actor_config())

    def critic_config(self) -> WorkerConfig | None:
        """The critic's config (`PPOConfig.critic_config`) as `actor_config`; None when the run has no critic."""
        critic = self.config.critic_config()
        return None if critic is None else self._resumed(critic)

    def _resumed(self, worker: WorkerConfig) -> WorkerConfig:
        # Every model loads the resume point's rollout, or nothing on a fresh start.
        if self.resume.rollout_id is None:
            return dataclasses.replace(worker, load=None, critic_load=None, load_rollout_id=None)
        return dataclasses.replace(worker, load_rollout_id=self.resume.rollout_id)

    def _check_fixed_flags(self) -> None:

        saved_path = self.path / CONFIG_FILE
        if not saved_path.is_file():
            return
        try:
            saved = read_yaml(saved_path)
        except ValueError:
            return  # not ours to judge: the resume goes on with the flags given
        current = dataclasses.asdict(self.config)
        changed = [
            name
            for name in FIXED_ON_RESUME
            if name in saved
            and name in current
            and _normalised(name, saved[name]) != _normalised(name, current[name])
        ]
        if not changed:
            return
        details = "; ".join(
            f"{flag(n)} was {saved[n]!r}, now {current[n]!r} ({FIXED_ON_RESUME[n]})" for n in changed
        )
        raise ValueError(
            f"{', '.join(flag(n) for n in changed)}: cannot change when resuming {self.path} after rollout "
            f"{self.resume.rollout_id}: {details}. Resume with the values in {saved_path}, or start a new "
            f"--run-dir. These may change on resume: {_MAY_CHANGE}"
        )

    # --- once the run is up ---------------------------------------------------------------------
    def commit(self) -> None:
        """The run is starting: set aside the checkpoint parts no resume uses, write config.yaml."""

        set_aside(self.path, self.resume, model_folders(self.config))
        write_run_config(self.config)
        self.committed = True

    def close(self) -> None:
        """Release the lock; without a commit, also remove RUN_DIR if this start created it and it is empty."""
        self.lock.release()
        if self.created and not self.committed:
            _remove_if_empty(self.path)


def model_folders(config: PPOConfig) -> list[ModelFolders]:
    """Each model's load and save folders (the critic's only when the run has one)."""
    workers: dict[Role, WorkerConfig | None] = {
        "critic": config.critic_config(),
        "actor": config.actor_config(),
    }

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value)

    return [
        ModelFolders(r, path(w.load_of(r)), path(w.save_of(r))) for r, w in workers.items() if w is not None
    ]


def _remove_if_empty(path: Path) -> None:
    # Not empty (another process's files, or logs that explain the failure): left as is.
    with contextlib.suppress(OSError):
        path.rmdir()
