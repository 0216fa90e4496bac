"""A distillation teacher on the shared GPUs: a forward-only role that gives the student's samples their log-probs, and sleeps.

The teacher is a Hugging Face causal LM on the student's tokenizer (`--teacher-hf-checkpoint`,
any size: a 1.5B teacher for a 0.5B student, say). One `TeacherWorker` per rollout
bundle serves it beside that bundle's engine; `TeacherGroup` spreads a rollout's
samples over them; `TeacherRole` is what the driver's step calls (`wake`,
`log_probs`, `sleep`: the schedule's `teacher` turn). Its log-probs of each response
token reach the train workers in the rollout's batches, where the student's reverse
KL to them trains it (`--opd-coef`, `--opd-mode`; tandem.megatron's
`algorithms.distillation`). See docs/design.md, "On-policy distillation".

Importing this package imports neither torch nor ray; the worker does when it is built.
"""

from ._group import TeacherError, TeacherGroup, create_teacher_group
from ._options import TeacherOptions
from ._role import ROLE, TeacherRole
from ._setup import check_teacher_config, start_teacher, uses_teacher

__all__ = [
    "ROLE",
    "TeacherAsleepError",
    "TeacherError",
    "TeacherGroup",
    "TeacherOptions",
    "TeacherRole",
    "TeacherWorker",
    "check_teacher_config",
    "create_teacher_group",
    "start_teacher",
    "uses_teacher",
]


def __getattr__(name: str) -> object:
    if name in ("TeacherWorker", "TeacherAsleepError"):
        from . import _worker  # torch and transformers: the package itself loads neither

        return getattr(_worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
