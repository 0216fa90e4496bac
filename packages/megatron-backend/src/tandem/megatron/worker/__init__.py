"""The train worker, process side: one rank of the actor or of the critic inside its Ray actor process.

`train_worker.TrainWorker` (the mechanism: train, sleep and wake, save and load,
weights to the engines), the figures it reports about itself (`figures`), its
process's start-up (`startup`), the role's
stages (`roles`, `train_step`, `forward` and its log-prob kernel `log_probs`,
`received`), the trainee it builds (`_trainee`, `optimizer`), checkpoints
(`checkpoint`, Megatron's shards inside `runtime.checkpoint_folder`'s protocol) and
torch.distributed (`parallel`). This layer may import everything below it: the
mechanisms the driver shares (`runtime`: fault points, GPU memory figures, the
checkpoint folder), the shared modules (`choices`, `batch`, `config`, `payloads`),
the algorithms and the models, megatron-core, tandem-lifecycle and
tandem-value-transfer; never the driver side (`group`) (tests/test_import_graph.py).

Names are imported on first use: `from tandem.megatron.worker import TrainWorker`
loads megatron-core only then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"TrainWorker": "train_worker", "WeightReceiver": "train_worker"}

if TYPE_CHECKING:
    from .train_worker import TrainWorker, WeightReceiver


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["TrainWorker", "WeightReceiver"]
