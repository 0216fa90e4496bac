"""A reward model on the shared GPUs: a forward-only role that scores prompt + response and sleeps.

The model is a Hugging Face sequence-classification folder with one label
(`--rm-type model --reward-model PATH`). One `RewardModelWorker` per rollout
bundle serves it beside that bundle's engine; `RewardModelGroup` spreads a
rollout's samples over them; `RewardModelRole` is what the driver's step calls
(`wake`, `score`, `sleep`, each recorded in events.jsonl). Its score can be one
term of a weighted sum with rule rewards (`tandem.ppo.rollout.reward_mix`,
`--reward-weights`). See docs/design.md, "The reward model in the step".

Importing this package imports neither torch nor ray; the worker does when it is built.
"""

from ._batching import score_position, token_budget_batches
from ._folder import RewardModelFolder, is_sequence_classification, read_reward_model_folder
from ._group import RewardModelError, RewardModelGroup, create_reward_model_group
from ._options import RewardModelOptions
from ._role import ROLE, RewardModelInputs, RewardModelRole
from ._setup import RM_TYPES, check_reward_config, start_reward_model, uses_reward_model

__all__ = [
    "RM_TYPES",
    "ROLE",
    "RewardModelAsleepError",
    "RewardModelError",
    "RewardModelFolder",
    "RewardModelGroup",
    "RewardModelInputs",
    "RewardModelOptions",
    "RewardModelRole",
    "RewardModelWorker",
    "check_reward_config",
    "create_reward_model_group",
    "is_sequence_classification",
    "read_reward_model_folder",
    "score_position",
    "start_reward_model",
    "token_budget_batches",
    "uses_reward_model",
]


def __getattr__(name: str) -> object:
    if name in ("RewardModelWorker", "RewardModelAsleepError"):
        from . import _worker  # torch and transformers: the package itself loads neither

        return getattr(_worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
