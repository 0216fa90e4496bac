"""The train worker, driver side: start one role's workers on placement-group bundles, and call them.

`train_group` (`TrainGroup`, `create_train_group`, `ShareLedger`) and `actors`
(`ActorHost`, the generic Ray actor that builds a worker class in its own process
and runs its methods by name; `ActorGroup`, the rank-ordered calls with timeouts
and errors named by rank that the driver's engine and reward-model groups share).
Never imports Megatron or torch: it may import the shared modules (`choices`,
`config`, `payloads`) and Ray; the train worker is named (`TRAIN_WORKER`) for its
host to import in the Ray actor's own process, never imported here
(tests/test_import_graph.py, tests/megatron/test_group.py).
"""

from .actors import ActorGroup, ActorHost, split_contiguous
from .train_group import TRAIN_WORKER, ShareLedger, TrainGroup, TrainWorkerHost, create_train_group

__all__ = [
    "TRAIN_WORKER",
    "ActorGroup",
    "ActorHost",
    "ShareLedger",
    "TrainGroup",
    "TrainWorkerHost",
    "create_train_group",
    "split_contiguous",
]
