"""The driver side of the train worker: no Megatron import, every worker method by name, GPU shares."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.megatron import WorkerConfig
from tandem.megatron.group import TRAIN_WORKER, TrainGroup, TrainWorkerHost, create_train_group

SOURCE = Path(__file__).parents[2] / "packages" / "megatron-backend" / "src" / "tandem" / "megatron"


def _classes(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def test_the_ray_actor_runs_every_public_worker_method_by_name() -> None:
    host = TrainWorkerHost("collections:Counter", "abracadabra")  # any class, built from its name
    assert host.call("most_common", 2) == [("a", 5), ("b", 2)]
    with pytest.raises(AttributeError, match="public methods"):
        host.call("_keep_positive")
    # The host builds the worker named by TRAIN_WORKER, whose module the driver never imports.
    module, _, name = TRAIN_WORKER.partition(":")
    assert (SOURCE / Path(*module.split(".")[2:])).with_suffix(".py").is_file()
    assert name in _classes(SOURCE / "worker" / "train_worker.py")


def test_the_driver_side_never_imports_megatron() -> None:
    code = (
        "import sys\n"
        "from tandem.megatron import TrainGroup, create_train_group, WorkerConfig, RolloutBatch\n"
        "TrainGroup, create_train_group\n"
        "assert 'megatron.core' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


class Ledger:
    """Stands in for tandem-placement's GpuShares: refuses a bundle past one GPU."""

    def __init__(self) -> None:
        self.claims: dict[tuple[Any, int], dict[str, float]] = {}

    def claim(
        self, slot: Any, index: int, *, role: str, num_gpus: float, num_cpus: float | None = None
    ) -> None:
        key = (slot.pg, slot.bundle_indices[index])
        roles = self.claims.setdefault(key, {})
        if sum(roles.values()) + num_gpus > 1:
            raise ValueError(f"bundle {key[1]}: {roles} + {role} {num_gpus} > 1 GPU")
        roles[role] = num_gpus

    def release(self, slot: Any, index: int, role: str) -> None:
        del self.claims[(slot.pg, slot.bundle_indices[index])][role]


def test_shares_past_one_gpu_are_refused_before_any_worker_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = WorkerConfig(
        hf_checkpoint=str(tmp_path),
        rollout_batch_size=2,
        global_batch_size=2,
        device="cpu",
        params_dtype="float32",
    )
    ledger = Ledger()
    ledger.claim(type("Slot", (), {"pg": "pg", "bundle_indices": (0,)})(), 0, role="engine", num_gpus=0.3)
    # The check runs before Ray is touched: no cluster is started here.
    with pytest.raises(ValueError, match=r"engine.*critic 0.8 > 1 GPU"):
        create_train_group(config, "critic", "pg", [0], num_gpus_per_worker=0.8, shares=ledger)
    assert ledger.claims[("pg", 0)] == {"engine": 0.3}
    # Refused on the second bundle: the first bundle's claim is given back.
    ledger.claim(type("Slot", (), {"pg": "pg", "bundle_indices": (1,)})(), 0, role="engine", num_gpus=0.3)
    with pytest.raises(ValueError, match="bundle 1"):
        create_train_group(config, "critic", "pg", [2, 1], num_gpus_per_worker=0.8, shares=ledger)
    assert ledger.claims[("pg", 2)] == {}


def test_kill_gives_the_shares_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from tandem.megatron.group.train_group import _Bundles

    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", killed.append)
    ledger = Ledger()
    bundles = _Bundles("pg", (3, 5))
    for index in range(2):
        ledger.claim(bundles, index, role="actor", num_gpus=0.4)
    group = TrainGroup("actor", ["w0", "w1"], 0, ledger, bundles)
    group.kill()
    assert killed == ["w0", "w1"]
    assert ledger.claims == {("pg", 3): {}, ("pg", 5): {}}


def test_the_weight_sync_call_binds_to_the_workers_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TrainGroup.update_weights` reaches `TrainWorker.update_weights` through the generic host by name:
    its arguments must bind to the worker's signature (`adapters` is keyword-only there)."""
    import inspect

    from tandem.megatron.worker.train_worker import TrainWorker

    group = TrainGroup("actor", ["w0"], 0)
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(group, "run", lambda method, *a, **kw: calls.append((method, a, kw)) or [1])
    for adapters in (False, True):
        group.update_weights(["engine"], None, adapters=adapters)
    for method, args, kwargs in calls:
        bound = inspect.signature(getattr(TrainWorker, method)).bind("self", *args, **kwargs)
        assert bound.arguments.get("adapters", False) == kwargs["adapters"]
