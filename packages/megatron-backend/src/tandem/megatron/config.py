"""The train worker's configuration: one typed, validated object, handed to a worker with its role.

`WorkerConfig` holds everything a `TrainWorker` needs to build, train, save and
load one rank of the actor or of the critic. Its fields are `WorkerFields`
(`_config_fields.py`, check-free, shared with the driver's `PPOConfig`); this
class adds the checks and the role helpers. The role picked at `init` selects
the role's fields (`lr_of` picks `lr` / `critic_lr`, `load_of` picks `load` /
`critic_load`, ...); the driver builds one config per role
(`PPOConfig.actor_config()` / `critic_config()`).

The checks run here and nowhere else: those that need only the config at
construction (`__post_init__`, from `_config_checks`); those that need the number
of ranks or the role in `check_world` / `check_role` / `check_model`, which the
group helper calls on the driver before any worker starts, so a bad config fails
fast. Every check raises a `FieldError` (a ValueError): the field, and a message naming the fix
and, in backticks, each other field it mentions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.megatron._algorithm_checks import check_estimator, check_ppo
from tandem.megatron._config_checks import (
    check_batches,
    check_choices,
    check_folders,
    check_lora,
    check_model_layout,
    check_positive_ints,
)
from tandem.megatron._config_fields import WorkerFields
from tandem.megatron._field_error import FieldError
from tandem.megatron.choices import ROLES, Role, check_role
from tandem.megatron.models.lora_spec import LoraSettings, resolve_targets

__all__ = ["FORWARD_ONLY_FACTOR", "ROLES", "FieldError", "Role", "WorkerConfig", "WorkerFields"]

FORWARD_ONLY_FACTOR = 2
"""A forward-only micro-batch left unset holds this many training micro-batches (samples or tokens).

It keeps no activations for a backward pass: the actor's logits of twice the samples take
what one training micro-batch's logits and their gradient take, and each layer's transient
is one layer's, not the whole stack's that a training micro-batch keeps for its backward."""


@dataclass(frozen=True)
class WorkerConfig(WorkerFields):
    """The train workers' fields (`WorkerFields`), checked at construction, with the role helpers."""

    def __post_init__(self) -> None:
        # The one place the checks that need only the fields run (`_config_checks`).
        check_positive_ints(self)
        check_choices(self)
        check_ppo(self)
        check_estimator(self)
        check_batches(self)
        check_folders(self)
        check_lora(self)

    # --- what the fields imply, and each role's own fields -----------------------------
    def _one_epoch_one_step(self, what: str) -> str | None:
        """None with one PPO epoch and one optimizer step a rollout; else why `what` (the old
        log-probs or values) are not the update's own, naming the field."""
        if self.ppo_epochs != 1:
            return f"ppo_epochs is {self.ppo_epochs} (later epochs train against the first's {what})"
        if self.global_batch_size != self.samples_per_rollout:
            return (
                f"global_batch_size ({self.global_batch_size}) is below a rollout's {self.samples_per_rollout} "
                "samples (later optimizer steps train against the weights before the first)"
            )
        return None

    def old_log_probs_redundant(self) -> str | None:
        """None when the old log-probs are the update's own (one epoch, one step, no KL to the
        reference or the teacher in the rewards, no TIS); else why not, naming the field."""
        why = self._one_epoch_one_step("log-probs")
        if why is None and self.kl_coef != 0:
            why = "kl_coef folds the KL into the rewards before the update"
        if why is None and self.opd_in_rewards:
            why = "opd_coef folds the reverse KL to the teacher into the rewards before the update"
        if why is None and self.use_tis:
            why = "use_tis weighs each token by the old against the sampler's log-probs"
        if why is None and self.lora_rank is not None and self.lora_dropout > 0:
            why = "lora_dropout drops adapter inputs in the update's forward pass"
        return why

    @property
    def reuses_old_log_probs(self) -> bool:
        """Whether the actor takes its old log-probs from its update's forward (`reuse_old_log_probs`)."""
        return _reuses(self.reuse_old_log_probs, self.old_log_probs_redundant)

    def old_values_redundant(self) -> str | None:
        """None when the critic's old values are its update's own (one epoch, one step, one update
        a step); else why not, naming the field."""
        why = self._one_epoch_one_step("values")
        if why is None and self.critic_updates_per_step != 1:
            why = (
                f"critic_updates_per_step is {self.critic_updates_per_step} (later passes train against the "
                "first's values)"
            )
        if why is None and self.critic_lora_rank is not None and self.critic_lora_dropout > 0:
            why = "critic_lora_dropout drops adapter inputs in the update's forward pass"
        return why

    @property
    def reuses_old_values(self) -> bool:
        """Whether the critic takes its old values from its update's forward (`reuse_old_values`)."""
        return _reuses(self.reuse_old_values, self.old_values_redundant)

    @property
    def critic_lambda(self) -> float:
        """GAE λ of the critic's targets: `critic_lambd`, else `lambd` (VAPO's decoupled GAE)."""
        return self.lambd if self.critic_lambd is None else self.critic_lambd

    @property
    def critic_passes(self) -> int:
        """The critic's passes over each rollout: `ppo_epochs * critic_updates_per_step`."""
        return self.ppo_epochs * self.critic_updates_per_step

    def lora_of(self, role: Role) -> LoraSettings | None:
        """`role`'s LoRA settings (rank, alpha, dropout, target layers); None: it trains in full."""
        _check_role(role)
        prefix = "critic_" if role == "critic" else ""
        rank = getattr(self, f"{prefix}lora_rank")
        if rank is None:
            return None
        alpha = getattr(self, f"{prefix}lora_alpha")
        return LoraSettings(
            rank=rank,
            alpha=float(rank if alpha is None else alpha),
            dropout=float(getattr(self, f"{prefix}lora_dropout")),
            targets=resolve_targets(getattr(self, f"{prefix}lora_target_modules")),
        )

    def lr_of(self, role: Role) -> float:
        """Peak learning rate of `role`."""
        _check_role(role)
        return self.critic_lr if role == "critic" else self.lr

    def load_of(self, role: Role) -> str | None:
        """Checkpoint folder `role` resumes from."""
        _check_role(role)
        return self.critic_load if role == "critic" else self.load

    def save_of(self, role: Role) -> str | None:
        """Checkpoint folder `role` saves to."""
        _check_role(role)
        return self.critic_save if role == "critic" else self.save

    def hf_checkpoint_of(self, role: Role) -> str:
        """Hugging Face folder with `role`'s initial weights."""
        _check_role(role)
        if role == "critic" and self.critic_hf_checkpoint is not None:
            return self.critic_hf_checkpoint
        return self.hf_checkpoint

    def micro_batch_tokens(self, *, forward_only: bool) -> int | None:
        """The token budget of a micro-batch (training or forward-only); None: cut by count.

        A forward-only budget left unset is twice the training one (`log_probs_max_tokens_per_gpu`).
        """
        if not self.use_dynamic_batch_size or self.max_tokens_per_gpu is None:
            return None
        if not forward_only:
            return self.max_tokens_per_gpu
        if self.log_probs_max_tokens_per_gpu is not None:
            return self.log_probs_max_tokens_per_gpu
        return FORWARD_ONLY_FACTOR * self.max_tokens_per_gpu

    @property
    def forward_micro_batch_size(self) -> int:
        """Samples of a forward-only micro-batch cut by count: `log_probs_micro_batch_size`, else twice the training one."""
        if self.log_probs_micro_batch_size is not None:
            return self.log_probs_micro_batch_size
        return FORWARD_ONLY_FACTOR * self.micro_batch_size

    # --- checks that need the world or the role -----------------------------------
    def check_world(self, world_size: int, role: Role | None = None) -> None:
        """Check that `world_size` ranks can run `role` (None: both roles); ValueError naming the field.

        Actor and critic run on the same ranks (the same bundles), each with its own
        layout: for each role, TP * PP must divide `world_size`, and the role's
        data-parallel size must divide `global_batch_size / micro_batch_size`.
        Both layouts then cover all ranks and every sample of a rollout (each role
        splits the rollout over its own data-parallel ranks).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: got {world_size!r}; a train group needs at least one rank")
        if role is not None:
            _check_role(role)
        for checked in ROLES if role is None else (role,):
            self._check_layout(world_size, checked)

    def _check_layout(self, world_size: int, role: Role) -> None:
        tp, pp = self.topology(role)
        prefix = "critic_" if role == "critic" else ""
        if world_size % (tp * pp):
            raise FieldError(
                f"{prefix}tensor_model_parallel_size",
                f"{tp} times `{prefix}pipeline_model_parallel_size` ({pp}) = {tp * pp} "
                f"({role}) does not divide the {world_size} ranks of the train group; pick sizes whose "
                "product divides it",
                f"{prefix}pipeline_model_parallel_size",
            )
        dp = world_size // (tp * pp)
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise FieldError(
                "global_batch_size",
                f"{self.global_batch_size} is not divisible by `micro_batch_size` "
                f"({self.micro_batch_size}) * the {role}'s data-parallel size ({dp}); make it a multiple "
                f"of {self.micro_batch_size * dp}",
                "micro_batch_size",
            )

    def check_model(self, role: Role) -> None:
        """Check that `role`'s model (config.json) splits over its TP / PP sizes; ValueError naming the field.

        Reads the role's Hugging Face config, so that a layout the model cannot take
        (9 attention heads over 2 tensor-parallel ranks) fails before any worker starts.
        """
        _check_role(role)
        check_model_layout(self, role)

    def check_role(self, role: Role) -> None:
        """Check the fields `role` needs (its checkpoint folders); ValueError naming the field."""
        _check_role(role)
        if role != "critic":
            return
        if not self.uses_critic:
            raise FieldError(
                "advantage_estimator",
                f"{self.advantage_estimator} needs no critic, so no critic worker "
                "starts; train a critic only with `advantage_estimator` gae",
                "advantage_estimator",
            )
        if self.save is not None and self.critic_save is None:
            raise FieldError(
                "critic_save",
                "`save` is set but the critic has no save folder; set it to a folder "
                "of its own (the critic never writes into the actor's folder)",
                "save",
            )
        if self.load is not None and self.critic_load is None:
            raise FieldError(
                "critic_load",
                "`load` is set but the critic has no load folder; set it to the "
                "critic's own folder (usually the same as `critic_save`) so a resumed critic never loads "
                "the actor's weights",
                "load",
                "critic_save",
            )


def _check_role(role: str) -> None:
    check_role(role)


def _reuses(flag: bool | None, redundant: Callable[[], str | None]) -> bool:
    """A `reuse_old_*` field's meaning: as set, or (None) wherever its `*_redundant` rule holds."""
    return redundant() is None if flag is None else flag
