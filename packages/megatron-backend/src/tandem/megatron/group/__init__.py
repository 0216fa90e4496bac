"""The train worker, driver side: start one role's workers on placement-group bundles, and call them.

`train_group` (`TrainGroup`, `create_train_group`, `ShareLedger`). Never imports
Megatron or torch: it may import the shared modules (`choices`, `config`,
`payloads`) and Ray, and names `worker.train_worker` only inside the Ray actor's
own process (`_WorkerHost`), which is the one edge from this layer down to the
worker (tests/test_import_graph.py, tests/megatron/test_group.py).
"""

from .train_group import ShareLedger, TrainGroup, create_train_group

__all__ = ["ShareLedger", "TrainGroup", "create_train_group"]
