"""Forward-only Hugging Face models on the rollout GPUs that sleep: what the reward model and the teacher share.

A forward-only role (the reward model, a distillation teacher) is one worker per
rollout bundle, beside that bundle's engine, each holding one Hugging Face model on
its device and computing forward passes of the samples it is given. Asleep, a worker
keeps its weights in retained host buffers (tandem.lifecycle's `PinnedHostBackend`)
and only its CUDA context on the device. `ForwardOptions` says how a worker is built
and driven, `ForwardWorker` is the worker's base class (the model's device, dtype
and lifecycle, its memory figures), `ForwardGroup` calls the workers by rank, and
`start_forward_group` starts one per bundle and waits until each has loaded, with
its share of the bundle's GPU (`rollout_bundle_shares`).

Importing this package imports neither torch nor Ray; the worker does when it is built.
"""

from ._group import EventRecorder, ForwardGroup, start_forward_group
from ._options import ForwardOptions
from ._shares import RolloutShares, rollout_bundle_shares

__all__ = [
    "EventRecorder",
    "ForwardGroup",
    "ForwardOptions",
    "ForwardWorker",
    "RolloutShares",
    "rollout_bundle_shares",
    "start_forward_group",
]


def __getattr__(name: str) -> object:
    if name == "ForwardWorker":
        from . import _worker  # torch and transformers: the package itself loads neither

        return _worker.ForwardWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
