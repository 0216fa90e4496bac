"""The driver-side offload plan: when a model sleeps and wakes around training and saving."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class OffloadPlan:
    """When the driver puts a model to sleep and wakes it; workers never decide this themselves.

    `train()` and `save_model()` never sleep or wake on their own initiative
    (docs/design.md, "Lifecycle rules"): the driver reads this plan and calls the
    worker's `sleep()` / `wake_up()` around them.

    Attributes:
        sleep_after_train: put the model to sleep after each training call (so the
            other model, or the rollout engine, gets the GPU); it is then woken
            before its next training call.
        wake_up_before_save: wake the model before saving a checkpoint (saving
            reads the weights and optimizer state from the GPU); it goes back to
            sleep after the save when `sleep_after_train` is set.
    """

    sleep_after_train: bool = False
    wake_up_before_save: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"OffloadPlan.{f.name}={value!r}: must be True or False")

    @classmethod
    def resident(cls) -> OffloadPlan:
        """Models stay on their GPUs (separate placement, or `offload_backend='none'`)."""
        return cls(sleep_after_train=False, wake_up_before_save=False)

    @classmethod
    def time_shared(cls) -> OffloadPlan:
        """Actor and critic share GPUs: each sleeps after training and wakes to save."""
        return cls(sleep_after_train=True, wake_up_before_save=True)

    @property
    def wake_up_before_train(self) -> bool:
        """Wake before training: needed exactly when the model slept after the previous training."""
        return self.sleep_after_train

    @property
    def sleep_after_save(self) -> bool:
        """Go back to sleep after a save that woke the model, so a save leaves the state it found."""
        return self.sleep_after_train and self.wake_up_before_save
