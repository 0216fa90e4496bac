"""The train worker on a CUDA GPU: NCCL, the distributed optimizer, both GPU memory backends.

Per backend (torch_memory_saver, pinned_host), one critic and one actor worker
share one GPU bundle (0.4 GPU each): critic step then actor step with the values
handed over in Boxes, sleeping in between (the cudaMalloc calls of a train after a
wake bounded by a cold first train's); while both sleep each holds at most
1 GiB of GPU memory beyond its CUDA context; a sleep/wake cycle brings back
every byte of weights and optimizer state; a checkpoint saved and loaded in
place restores the state exactly (distributed optimizer), and so does one
loaded by a fresh worker (a resumed run); the weight export works while asleep.

    source .gpu-kit/setup.sh && python3 -m pytest tests/megatron/test_worker_gpu.py -m gpu -q
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GIB = 1024**3
MAX_ASLEEP_EXTRA = 1 * GIB
VOCAB = 512


def make_batch(n: int, seed: int) -> Any:
    from tandem.megatron.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    tokens, lengths = [], []
    for _ in range(n):
        prompt, response = (
            int(torch.randint(4, 32, (1,), generator=g)),
            int(torch.randint(4, 64, (1,), generator=g)),
        )
        tokens.append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
        lengths.append(response)
    return RolloutBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=[torch.ones(r) for r in lengths],
        rewards=torch.randn(n, generator=g),
    )


@pytest.fixture(scope="module", params=["torch_memory_saver", "pinned_host"])
def groups(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    random_llama: Callable[..., None],
) -> Iterator[dict[str, Any]]:
    import ray
    from ray.util.placement_group import placement_group

    from tandem.megatron.config import WorkerConfig
    from tandem.megatron.group import create_train_group

    backend = request.param
    root = tmp_path_factory.mktemp(f"gpu-{backend}")
    # A small random Llama (about 20 M parameters) in bf16.
    random_llama(
        root / "hf",
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        dtype=torch.bfloat16,
    )
    config = WorkerConfig(
        hf_checkpoint=str(root / "hf"),
        rollout_batch_size=8,
        n_samples_per_prompt=2,
        global_batch_size=8,
        micro_batch_size=2,
        device="cuda",
        params_dtype="bfloat16",
        offload_backend=backend,
        optimizer_pieces=2 if backend == "pinned_host" else None,  # its optimizer tags in pieces
        lr=1e-4,
        critic_lr=1e-4,
        save=str(root / "actor"),
        load=str(root / "actor"),
        critic_save=str(root / "critic"),
        critic_load=str(root / "critic"),
    )
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"GPU": 1, "CPU": 2}], strategy="PACK")
    ray.get(pg.ready())
    critic = create_train_group(config, "critic", pg, [0], num_gpus_per_worker=0.4)
    actor = create_train_group(config, "actor", pg, [0], num_gpus_per_worker=0.4)
    yield {"critic": critic, "actor": actor, "config": config, "backend": backend, "pg": pg}
    ray.shutdown()


def test_ppo_steps_with_sleep_in_between(groups: dict[str, Any]) -> None:
    import ray

    critic, actor = groups["critic"], groups["actor"]
    data = [ray.put(make_batch(16, seed=1))]
    value_losses = []
    mallocs: dict[str, list[float]] = {"critic": [], "actor": []}
    for step in range(3):
        critic_out = ray.get(critic.train(step, data))
        critic.run("sleep")
        actor_out = ray.get(actor.train(step, data, critic=critic_out))
        actor.run("sleep")
        value_losses.append(critic_out[0].metrics["value_loss"])
        metrics = actor_out[0].metrics
        assert metrics["values_mean"] == pytest.approx(critic_out[0].metrics["values_mean"], rel=1e-5)
        assert all(v == v for v in metrics.values()), metrics  # no NaN
        for role, out in (("critic", critic_out), ("actor", actor_out)):
            mallocs[role].append(out[0].allocator["alloc/device_mallocs"])
    assert value_losses[-1] < value_losses[0], value_losses
    # The allocator after a wake, as a scaling check (counts, not time): step 0 is each worker's
    # first train, with the allocator's cache as cold as a resident run's first train; every
    # later train follows a sleep that handed the cache back. Re-filling it may cost about what
    # the cold start cost, not more (a leak of cached blocks, or a pool rebuilt per micro-batch,
    # would multiply it).
    print("cudaMalloc calls a train:", json.dumps(mallocs))
    for role, calls in mallocs.items():
        cold, *after_wake = calls
        assert cold > 0, (role, calls)
        assert all(n <= 1.25 * cold + 8 for n in after_wake), (role, calls)


def test_asleep_each_worker_holds_at_most_1_gib_beyond_its_context(groups: dict[str, Any]) -> None:
    critic, actor = groups["critic"], groups["actor"]
    critic.run("sleep")
    actor.run("sleep")
    reports = critic.run("gpu_memory") + actor.run("gpu_memory")
    print("GPU memory asleep:", json.dumps(reports))
    if all(r["process"] is not None and r["process_baseline"] is not None for r in reports):
        for r in reports:
            assert r["process"] - r["process_baseline"] <= MAX_ASLEEP_EXTRA, r
    else:
        # nvidia-smi cannot attribute memory to our pids here (a container's PID view):
        # the whole GPU, less what was used before the first worker and the workers' contexts.
        first = reports[0]
        contexts = sum(r["context"] for r in reports)
        extra = reports[-1]["device_used"] - first["device_before_context"] - contexts
        assert extra <= len(reports) * MAX_ASLEEP_EXTRA, reports


def test_sleep_wake_cycle_brings_every_byte_back(groups: dict[str, Any]) -> None:
    for group in (groups["critic"], groups["actor"]):
        group.run("wake_up")
        before = group.run("state_snapshot")
        group.run("sleep")
        group.run("wake_up")
        after = group.run("state_snapshot")
        for x, y in zip(before, after, strict=True):
            assert x.keys() == y.keys()
            assert all(torch.equal(x[k], y[k]) for k in x), [k for k in x if not torch.equal(x[k], y[k])][:5]


def test_the_optimizer_pieces_sleep_apart_and_come_back_exactly(groups: dict[str, Any]) -> None:
    """pinned_host, `optimizer_pieces=2`: the distributed optimizer's fp32 main weights and Adam's moments, each
    in two tags of whole tensors, none empty on the GPU; put to sleep one piece at a time, in reverse order
    (each cut where it was with the pieces after it asleep), and woken, every byte is back."""
    import ray

    if groups["backend"] != "pinned_host":
        pytest.skip("pieces are the pinned_host backend's (torch_memory_saver: one optimizer region)")
    critic = groups["critic"]
    critic.run("wake_up")
    ray.get(critic.train(7, [ray.put(make_batch(16, seed=7))]))  # the moments exist from the first step
    pieces = [f"{kind}.{i}" for kind in ("main_params", "optimizer_moments") for i in range(2)]
    assert critic.memory_tags() == ["weights", "grads", *pieces]
    (nbytes,) = critic.state_nbytes()
    assert all(nbytes[t] > 0 for t in pieces), nbytes
    before = critic.run("state_snapshot")
    for tag in reversed(pieces):
        critic.sleep([tag])
    assert critic.asleep_tags() == [pieces]
    critic.wake_up()
    (after,) = critic.run("state_snapshot")
    assert all(torch.equal(before[0][k], after[k]) for k in after), [
        k for k in after if not torch.equal(before[0][k], after[k])
    ][:5]


def test_checkpoint_restores_the_distributed_optimizer_state(groups: dict[str, Any]) -> None:
    import ray

    critic, actor = groups["critic"], groups["actor"]
    data = [ray.put(make_batch(16, seed=2))]
    for group in (critic, actor):
        group.run("wake_up")
        group.run("save_model", 5)
    saved = {"critic": critic.run("state_snapshot"), "actor": actor.run("state_snapshot")}
    ray.get(actor.train(6, data, critic=ray.get(critic.train(6, data))))
    for name, group in (("critic", critic), ("actor", actor)):
        assert group.run("load_model") == [5]
        loaded = group.run("state_snapshot")
        for x, y in zip(saved[name], loaded, strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x), [k for k in x if not torch.equal(x[k], y[k])][:5]


def test_a_fresh_worker_resumes_the_distributed_optimizer_from_a_checkpoint(groups: dict[str, Any]) -> None:
    """A new process (a resumed run) has taken no optimizer step: the checkpoint's optimizer state loads into
    it all the same (megatron-core's DistributedOptimizer built its loading template from state it did not
    have yet), and it holds the saved weights, fp32 main weights and Adam's moments."""
    import ray

    from tandem.megatron.group import create_train_group

    critic = groups["critic"]
    critic.run("wake_up")
    ray.get(critic.train(9, [ray.put(make_batch(16, seed=9))]))
    critic.run("save_model", 9)
    (saved,) = critic.run("state_snapshot")
    critic.shutdown()
    critic.kill()
    fresh = create_train_group(groups["config"], "critic", groups["pg"], [0], num_gpus_per_worker=0.4)
    groups["critic"] = fresh
    (loaded,) = fresh.run("state_snapshot")
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), [
        k for k in saved if not torch.equal(saved[k], loaded[k])
    ][:5]
    ray.get(fresh.train(10, [ray.put(make_batch(16, seed=10))]))  # and it trains on
    # The state the load created lies where a sleep moves or releases it (the backend's optimizer region).
    fresh.run("sleep")
    (report,) = fresh.run("gpu_memory")
    if report["process"] is not None and report["process_baseline"] is not None:
        assert report["process"] - report["process_baseline"] <= MAX_ASLEEP_EXTRA, report
    fresh.run("wake_up")


def test_update_weights_while_asleep(groups: dict[str, Any]) -> None:
    import ray

    class Engine:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[int, ...]] = {}

        def update_weights_from_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
            self.shapes.update({name: tuple(t.shape) for name, t in named})

        def received(self) -> dict[str, tuple[int, ...]]:
            return self.shapes

    actor = groups["actor"]
    actor.run("sleep")
    engine_cls: Any = ray.remote(Engine)
    engine = engine_cls.remote()
    actor.run("update_weights", engine)
    assert actor.run("asleep") == [True]
    shapes = ray.get(engine.received.remote())
    assert shapes["model.embed_tokens.weight"] == (VOCAB, 512)
    assert len(shapes) == 3 + 4 * 9  # embedding, final norm, lm_head; 9 tensors per layer
