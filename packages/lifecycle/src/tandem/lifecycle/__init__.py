"""Sleep and wake for models that share GPUs: a state machine, memory backends, reloadable process groups.

`Lifecycle` puts a model's GPU memory away and brings it back through a
`MemoryBackend`: `PinnedHostBackend` (retained host buffers, any device),
`TorchMemorySaverBackend` (GPU only; its process starts with
`torch_memory_saver_env()`) or `NoopBackend`, chosen by `make_backend`.
`ReloadableProcessGroup`s let the NCCL communicators go too (when to sleep and
wake is the driver's plan, not this package's). `HostCopies` keeps tensors that
stay on the host for a run (an actor's reference weights) in one exact-size
page-locked buffer; `SharedFrozen` gives processes that hold the same frozen bytes
(a LoRA actor's and critic's base) one host copy between them.

Importing this package imports torch, never ray, megatron or torch_memory_saver.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from ._backend import BACKEND_NAMES, BackendName, MemoryBackend, NoopBackend, clear_torch_caches, make_backend
from ._host_buffers import HostCopies
from ._lifecycle import Lifecycle
from ._memory_saver import TorchMemorySaverBackend, torch_memory_saver_env
from ._pinned_host import PinnedHostBackend
from ._process_groups import (
    ProcessGroupTornDownError,
    ReloadableProcessGroup,
    destroy_all,
    forget_all,
    reload_all,
    reloadable_groups,
    reloadable_new_group,
    reloadable_process_groups,
)
from ._shared_frozen import SharedFrozen

try:
    __version__ = _version("tandem-lifecycle")
except PackageNotFoundError:  # source tree on PYTHONPATH (the offline GPU host), not installed
    __version__ = "0+unknown"

__all__ = [
    "BACKEND_NAMES",
    "BackendName",
    "HostCopies",
    "Lifecycle",
    "MemoryBackend",
    "NoopBackend",
    "PinnedHostBackend",
    "ProcessGroupTornDownError",
    "ReloadableProcessGroup",
    "SharedFrozen",
    "TorchMemorySaverBackend",
    "__version__",
    "clear_torch_caches",
    "destroy_all",
    "forget_all",
    "make_backend",
    "reload_all",
    "reloadable_groups",
    "reloadable_new_group",
    "reloadable_process_groups",
    "torch_memory_saver_env",
]
