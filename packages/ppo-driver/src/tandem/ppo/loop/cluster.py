"""Where a run's processes come from: Ray, the placement groups, the train groups and the engines.

The driver owns the plan; this module only starts things. Actor and critic
train groups go on the same bundles with fractional GPU shares, the engines on
the rollout slot, all three at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tandem.megatron.choices import Role
from tandem.megatron.group import create_train_group
from tandem.placement import create_placement_groups
from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.engines import EngineOptions, create_engine_group, ipc_payload
from tandem.ppo.loop.node_checks import check_nodes_see_folders, folders_to_check
from tandem.ppo.rollout.forward import rollout_bundle_shares
from tandem.ppo.run.errors import RayStartError

if TYPE_CHECKING:
    from tandem.megatron.config import WorkerConfig
    from tandem.megatron.group import TrainGroup
    from tandem.placement import Placements
    from tandem.ppo.engines import EngineGroup

__all__ = ["StartedGroups", "check_ray_address", "start_groups", "start_ray", "weight_pack"]


class StartedGroups(NamedTuple):
    """What `start_groups` started: the placement groups and the three groups on them."""

    placements: Placements
    actor: TrainGroup
    critic: TrainGroup | None
    """None with a critic-free advantage estimator."""
    engines: EngineGroup


def start_ray(
    address: str | None = None, local_gpus: int | None = None, runtime_env: dict[str, Any] | None = None
) -> bool:
    """Join `address` (or `RAY_ADDRESS`), else start a local cluster with `local_gpus` logical GPUs
    (None: what Ray detects); whether this call started Ray (False when it was running already).

    `runtime_env`: the job's (the worker-log hook of `worker_logs.ray_runtime_env`)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    # Ray's own INFO and WARNING lines (the cluster started, token authentication is on) stay off
    # the terminal: a run's terminal holds Tandem's lines and the progress bar.
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.ERROR,
    }
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    # ray.init installs a SIGTERM handler of its own in the driver (exit 15 and a C++ stack dump): the
    # command keeps its own (`training.train`, `loop`), which stop the run cleanly.
    sigterm = (
        signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        _init(ray, address, local_gpus, kwargs)
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    return True


def _init(ray: Any, address: str | None, local_gpus: int | None, kwargs: dict[str, Any]) -> None:
    if address:
        check_ray_address(address)
        ray.init(address=address, **kwargs)
    else:
        if local_gpus is not None:
            kwargs["num_gpus"] = local_gpus
        # "local": a cluster of our own, even where `ray start` left one running on this machine.
        try:
            ray.init(address="local", **kwargs)
        except Exception as exc:
            if "timed out during startup" not in str(exc):
                raise

            raise RayStartError(
                f"the local Ray cluster did not start in time ({' '.join(str(exc).split())[:200]}); the machine "
                "may be too busy: try again, or start Ray yourself (`ray start --head`) and pass --ray-address"
            ) from None


RAY_ADDRESS_TIMEOUT_S = 10.0
"""Seconds to wait for `--ray-address` to accept a connection, and again for its answer, before
`ray.init`, which would retry for minutes against an address where nothing listens, or where a
server other than Ray's GCS does (a dashboard)."""

GCS_PORT = 6379
"""The port of the GCS of a head that `ray start --head` started without `--port`."""

_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, Ray
Client) answers with a SETTINGS frame of its own."""


def check_ray_address(address: str) -> None:
    """Ray's GCS (or Ray Client, for `ray://`) answers at `address`, within `RAY_ADDRESS_TIMEOUT_S`
    each for the connection and the answer; ValueError naming the flag and the head's port otherwise.

    The GCS is a gRPC server: it answers an HTTP/2 preface with a SETTINGS frame. A dashboard, or any
    other web server, answers HTTP/1; a port that accepts and never answers times out.
    """
    import socket
    from urllib.parse import urlsplit

    parsed = urlsplit(address if "://" in address else f"ray://{address}")
    if parsed.scheme in ("", "auto", "local") or parsed.hostname is None or parsed.port is None:
        return  # "auto", a bare host: Ray's own resolution
    fix = (
        f"give the cluster head's GCS address (port {GCS_PORT} unless `ray start --head --port` chose another; "
        "`ray start --head` prints it), or ray://HOST:10001 for Ray Client; fix --ray-address (or RAY_ADDRESS)"
    )
    try:
        conn = socket.create_connection((parsed.hostname, parsed.port), timeout=RAY_ADDRESS_TIMEOUT_S)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ValueError(
            f"--ray-address: nothing answers at {address} ({reason}); start the cluster's head there "
            f"(`ray start --head --port {parsed.port}`), or fix --ray-address (or RAY_ADDRESS)"
        ) from None
    if parsed.scheme in ("http", "https"):
        conn.close()
        return  # a job server's address, for `ray job submit`: not ours to speak to
    with conn:
        answer = _first_answer(conn)
    if answer is None:
        raise ValueError(
            f"--ray-address: {address} accepts connections but does not answer as Ray's GCS within "
            f"{RAY_ADDRESS_TIMEOUT_S:g} s; {fix}"
        )
    if len(answer) < 9 or answer[3] != 4:  # a frame header: 3 bytes of length, then its type (4: SETTINGS)
        if not answer:
            spoken = "it closed the connection"
        elif answer.isascii() and answer.decode().isprintable():
            spoken = "it speaks HTTP/1, as a web server does: Ray's dashboard?"
        else:
            spoken = f"it answered {answer!r}"
        raise ValueError(f"--ray-address: {address} answers, but not as Ray's GCS ({spoken}); {fix}")


def _first_answer(conn: Any) -> bytes | None:
    """The first 9 bytes the server sends after `_HTTP2_PREFACE` (fewer if it closes); None on a timeout."""
    try:
        conn.sendall(_HTTP2_PREFACE)
        answer = b""
        while len(answer) < 9:
            chunk = conn.recv(9 - len(answer))
            if not chunk:
                break
            answer += chunk
    except TimeoutError:
        return None
    except OSError:  # reset by a server that does not speak HTTP/2
        return b""
    return answer


def start_groups(
    config: PPOConfig,
    actor_config: WorkerConfig,
    critic_config: WorkerConfig | None,
    *,
    lock_file: Path | None = None,
) -> StartedGroups:
    """The placements, the actor group, the critic group (or None) and the engine group, started concurrently.

    `actor_config` / `critic_config`: each train group's config (`RunFolder.actor_config()` /
    `critic_config()`); no critic group starts where `critic_config` is None.
    `lock_file`: the run folder's lock; with it, every node of the placement groups must see
    the model folders and the run folder before any worker starts (`node_checks`).
    """

    placements = create_placement_groups(config.placement_spec())
    actor_slot, rollout_slot = placements.actor, placements.rollout
    if lock_file is not None:
        try:
            check_nodes_see_folders([actor_slot, rollout_slot], folders_to_check(config, lock_file))
        except BaseException:
            placements.remove()
            raise
    engine_options = engine_options_of(config)

    def start(role: Role, worker_config: WorkerConfig) -> TrainGroup:
        share = config.actor_gpu_share if role == "actor" else config.critic_gpu_share
        return create_train_group(
            worker_config,
            role,
            actor_slot.pg,
            actor_slot.bundle_indices,
            num_gpus_per_worker=share,
            num_cpus_per_worker=share,
        )

    def start_engines() -> EngineGroup:
        share = rollout_bundle_shares(config).engine  # a reward model and a teacher take part of it
        return create_engine_group(
            config.hf_checkpoint,
            rollout_slot.pg,
            rollout_slot.bundle_indices,
            num_gpus_per_engine=share,
            num_cpus_per_engine=share,
            engine=config.rollout_engine,
            options=engine_options,
            max_restarts=config.max_engine_restarts,
        )

    # The three groups do not depend on each other: they start at once.
    with ThreadPoolExecutor(max_workers=3) as pool:
        actor = pool.submit(start, "actor", actor_config)
        critic = pool.submit(start, "critic", critic_config) if critic_config is not None else None
        engines = pool.submit(start_engines)
        return StartedGroups(
            placements, actor.result(), critic.result() if critic is not None else None, engines.result()
        )


def weight_pack(config: PPOConfig) -> Any:
    """`ipc_payload` when actor rank r and engine r share a GPU (CUDA IPC), else None (CPU copies)."""
    import torch

    if config.weight_sync == "cpu":
        return None
    shared_gpus = config.colocate and config.num_engines == config.actor_num_gpus
    if config.weight_sync == "ipc" or (shared_gpus and config.device != "cpu" and torch.cuda.is_available()):
        return ipc_payload
    return None


def engine_options_of(config: PPOConfig) -> Any:
    """The rollout engines' `EngineOptions` from the run's `rollout_*` and SGLang fields."""

    engine_kwargs: dict[str, Any] = {
        "dtype": config.rollout_dtype,
        "fused_decode": config.rollout_fused_decode,
        "cpu_threads": config.resolved_cpu_threads(),
        "count_weight_changes": config.policy_change_count,
        "kv_cache_backend": config.rollout_kv_cache_backend,
    }
    if config.rollout_kv_cache_memory_fraction is not None:
        engine_kwargs["kv_cache_memory_fraction"] = config.rollout_kv_cache_memory_fraction
    if config.sglang_urls:
        engine_kwargs["sglang_urls"] = tuple(config.sglang_urls)
    if config.syncs_adapters:
        engine_kwargs["adapter_sync"] = True
    return EngineOptions(**engine_kwargs)
