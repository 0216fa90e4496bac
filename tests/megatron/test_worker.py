"""The train worker on CPU: Ray + gloo, two ranks per role, a tiny Llama.

One critic group and one actor group (data parallel 2) share the same two
placement bundles (each Ray worker process imports Megatron, which is slow),
and the tests share them: the value hand-off, learning (with the KL loss
against host-side reference weights and the entropy bonus on), sleep/wake
exactness, the weight export, and a save -> kill -> restart that resumes both
roles from their own folders. Then both roles with pipeline parallel 2 (values
from the last stage only, the weight export gathering both stages), and PPO
epochs with shuffled minibatches. Only one pair of groups lives at a time
(`Workers.use`); every test brings the groups into the state it needs, so each
passes alone and in any order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from tandem.megatron import RolloutBatch, TrainGroup, WorkerConfig, create_train_group

pytestmark = pytest.mark.slow

VOCAB = 64
RANKS = 2


def make_batch(n: int, seed: int, reward: float | None = None) -> RolloutBatch:
    """`n` random samples (prompt 2-4 tokens, response 2-5, last response token masked out on odd samples)."""
    g = torch.Generator().manual_seed(seed)
    tokens, lengths, masks = [], [], []
    for i in range(n):
        prompt, response = (
            int(torch.randint(2, 5, (1,), generator=g)),
            int(torch.randint(2, 6, (1,), generator=g)),
        )
        tokens.append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
        lengths.append(response)
        mask = torch.ones(response)
        if i % 2:
            mask[-1] = 0
        masks.append(mask)
    rewards = torch.full((n,), reward) if reward is not None else torch.randn(n, generator=g)
    return RolloutBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=masks,
        rewards=rewards,
        sample_indices=[seed * 100 + i for i in range(n)],
    )


def put_rollout(seed: int, reward: float | None = None) -> list[Any]:
    """One rollout of 8 samples split over the two data-parallel ranks (one object ref each)."""
    return [ray.put(make_batch(4, seed * 10 + r, reward)) for r in range(RANKS)]


class Workers:
    """The critic and actor groups of one configuration at a time, started on first use."""

    def __init__(self, root: Path, pg: Any, configs: dict[str, WorkerConfig]) -> None:
        self.root, self.pg, self.configs = root, pg, configs
        self.kind: str | None = None
        self.critic: TrainGroup | None = None
        self.actor: TrainGroup | None = None
        self.checkpoints = itertools.count(10, 10)

    def use(self, kind: str) -> tuple[TrainGroup, TrainGroup]:
        """(critic, actor) of configuration `kind`; the groups of another kind are killed first."""
        if self.kind != kind:
            self.kill()
            self.kind = kind
            self.start()
        assert self.critic is not None and self.actor is not None
        return self.critic, self.actor

    def start(self) -> None:
        assert self.kind is not None
        config = self.configs[self.kind]
        self.critic = create_train_group(config, "critic", self.pg, range(RANKS), num_gpus_per_worker=0)
        self.actor = create_train_group(config, "actor", self.pg, range(RANKS), num_gpus_per_worker=0)

    def kill(self) -> None:
        for group in (self.critic, self.actor):
            if group is not None:
                group.kill()
        self.critic = self.actor = None

    def next_checkpoint(self) -> int:
        """A rollout id above every checkpoint saved so far (the newest one is the one loaded)."""
        return next(self.checkpoints)


@pytest.fixture(scope="module")
def workers(
    tmp_path_factory: pytest.TempPathFactory,
    module_ray_job: str,
    random_llama: Callable[..., None],
) -> Iterator[Workers]:
    import dataclasses

    root = tmp_path_factory.mktemp("worker")
    # A tiny random Llama: the workers' initial weights.
    random_llama(
        root / "hf",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    config = WorkerConfig(
        hf_checkpoint=str(root / "hf"),
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        global_batch_size=4,  # two optimizer steps per rollout, two micro-batches per step and rank
        micro_batch_size=1,
        device="cpu",
        params_dtype="float32",
        offload_backend="pinned_host",
        lr=1e-3,
        critic_lr=2e-3,
        clip_grad=1.0,
        # Raw advantages: test_losses_fall_on_fixed_data rewards every response alike, which
        # whitening (the default) would turn into zero advantages.
        normalize_advantages=False,
        # The KL loss (reference weights swapped in from the host) and the entropy bonus are on.
        use_kl_loss=True,
        kl_loss_coef=0.01,
        entropy_coef=1e-3,
        save=str(root / "actor"),
        load=str(root / "actor"),
        critic_save=str(root / "critic"),
        critic_load=str(root / "critic"),
    )
    configs = {
        "dp": config,
        # Pipeline parallel 2 (one layer per stage), advantages whitened over the last stage's DP group;
        # one-rank groups with communicators of their own, torn down at each sleep.
        "pp": dataclasses.replace(
            config,
            pipeline_model_parallel_size=2,
            local_single_rank_groups=False,
            normalize_advantages=True,
            save=str(root / "pp-actor"),
            load=str(root / "pp-actor"),
            critic_save=str(root / "pp-critic"),
            critic_load=str(root / "pp-critic"),
        ),
        # Two shuffled passes over each rollout, no checkpoints; one-rank groups with communicators
        # of their own, alive while asleep.
        "epochs": dataclasses.replace(
            config,
            ppo_epochs=2,
            shuffle_minibatches=True,
            local_single_rank_groups=False,
            keep_single_rank_groups=True,
            use_kl_loss=False,
            kl_loss_coef=0.0,
            save=None,
            load=None,
            critic_save=None,
            critic_load=None,
        ),
    }
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 1}] * RANKS, strategy="PACK")
    ray.get(pg.ready())
    state = Workers(root, pg, configs)
    yield state
    state.kill()


def ppo_step(critic: TrainGroup, actor: TrainGroup, rollout_id: int, data: list[Any], *, sleep: bool) -> dict:
    """One critic step then one actor step, the actor getting the critic's per-rank payloads."""
    critic_out = ray.get(critic.train(rollout_id, data))
    if sleep:
        critic.run("sleep")
    actor_out = ray.get(actor.train(rollout_id, data, critic=critic_out))
    if sleep:
        timings = actor.run("sleep")
        assert all(
            {"destroy_process_groups", "pause:weights", "pause:optimizer_moments"} <= t.keys()
            for t in timings
        )
        assert actor.run("sleep") == [{}, {}]  # idempotent: nothing ran
    return {"critic": critic_out, "actor": actor_out}


def snapshots(group: TrainGroup) -> list[dict[str, torch.Tensor]]:
    return group.run("state_snapshot")


def assert_identical(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        different = [k for k in x if not torch.equal(x[k], y[k])]
        assert not different, f"rank {rank}: {different[:5]} differ"


def test_critic_then_actor_hand_values_over(workers: Workers) -> None:
    from tandem.value_transfer import Box, unpack_values

    critic, actor = workers.use("dp")
    data = put_rollout(seed=1)
    out = ppo_step(critic, actor, 0, data, sleep=False)
    total, count = 0.0, 0
    for rank, result in enumerate(out["critic"]):
        assert result.values is not None and isinstance(result.values.values, Box)
        batch = ray.get(data[rank])
        values = unpack_values(result.values.values, "cpu", sample_indices=batch.sample_indices)
        assert [v.numel() for v in values] == batch.response_lengths
        for v, mask in zip(values, batch.loss_masks, strict=True):
            total += float((v * mask).sum())
            count += int(mask.sum())
    # The actor's GAE used exactly the critic's old values (token mean over both ranks).
    actor_metrics = out["actor"][0].metrics
    assert actor_metrics["values_mean"] == pytest.approx(total / count, rel=1e-5)
    assert out["critic"][0].metrics["values_mean"] == pytest.approx(total / count, rel=1e-5)
    # Every rank reports the same figures; the learning rates are the roles' own.
    for role in ("critic", "actor"):
        assert all(r.metrics == out[role][0].metrics for r in out[role])
    assert out["critic"][0].metrics["lr"] == pytest.approx(2e-3)
    assert actor_metrics["lr"] == pytest.approx(1e-3)
    assert all(torch.isfinite(torch.tensor(v)) for v in actor_metrics.values())
    assert 0.0 <= actor_metrics["clip_frac"] <= 1.0 and actor_metrics["grad_norm"] > 0
    assert actor_metrics["kl_loss"] >= 0.0
    assert 0.0 < actor_metrics["entropy"] <= math.log(VOCAB)


def test_losses_fall_on_fixed_data(workers: Workers) -> None:
    critic, actor = workers.use("dp")
    data = put_rollout(seed=2)
    value_losses = [ray.get(critic.train(i, data))[0].metrics["value_loss"] for i in range(4)]
    assert value_losses[-1] < 0.8 * value_losses[0], value_losses
    # Every response rewarded +1 and no critic (values 0): the actor makes them all more likely.
    rewarded = put_rollout(seed=3, reward=1.0)
    metrics = [ray.get(actor.train(i, rewarded))[0].metrics for i in range(4)]
    log_probs = [m["log_prob"] for m in metrics]
    assert all(b > a for a, b in itertools.pairwise(log_probs)), log_probs
    # The policy moved away from the reference weights, which stayed put on the host.
    assert metrics[-1]["kl_loss"] > metrics[0]["kl_loss"] > 0.0


def test_sleep_and_wake_leave_training_bit_identical(workers: Workers) -> None:
    critic, actor = workers.use("dp")
    checkpoint = workers.next_checkpoint()
    for group in (critic, actor):
        group.run("wake_up")
        group.run("save_model", checkpoint)
    before = {"critic": snapshots(critic), "actor": snapshots(actor)}
    rollouts = [put_rollout(seed=s) for s in (4, 5)]

    slept = [ppo_step(critic, actor, 11 + i, data, sleep=True) for i, data in enumerate(rollouts)]
    assert critic.run("asleep") == [True, True] and actor.run("asleep") == [True, True]
    for group in (critic, actor):
        assert all("resume:weights" in t for t in group.run("wake_up"))
        # Idempotent: awake, only the process groups are reloaded.
        assert [list(t) for t in group.run("wake_up")] == [["reload_process_groups", "total"]] * 2
    after_sleeping = {"critic": snapshots(critic), "actor": snapshots(actor)}

    # Back to the saved state, in place; the same steps without ever sleeping.
    for group in (critic, actor):
        assert group.run("load_model") == [checkpoint, checkpoint]
    assert_identical(snapshots(critic), before["critic"])
    assert_identical(snapshots(actor), before["actor"])
    awake = [ppo_step(critic, actor, 11 + i, data, sleep=False) for i, data in enumerate(rollouts)]
    assert_identical(snapshots(critic), after_sleeping["critic"])
    assert_identical(snapshots(actor), after_sleeping["actor"])
    for a, b in zip(slept, awake, strict=True):
        for role in ("critic", "actor"):
            assert [r.metrics for r in a[role]] == [r.metrics for r in b[role]]
    # The state did move: the steps trained something.
    assert not torch.equal(
        before["actor"][0]["weights/embedding.word_embeddings.weight"],
        after_sleeping["actor"][0]["weights/embedding.word_embeddings.weight"],
    )


class RecordingEngine:
    """Stands in for a rollout engine: keeps the weights it is sent."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.chunks = 0

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.chunks += 1
        for name, tensor in named_tensors:
            assert name not in self.tensors, f"{name} sent twice"
            self.tensors[name] = tensor.clone()

    def received(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.chunks, self.tensors


def test_update_weights_asleep_and_awake_send_the_same_hf_tensors(workers: Workers) -> None:
    from safetensors.torch import load_file

    _, actor = workers.use("dp")
    initial = load_file(str(Path(workers.configs["dp"].hf_checkpoint) / "model.safetensors"))
    ray.get(
        actor.train(0, put_rollout(seed=8, reward=1.0))
    )  # so that the weights differ from the checkpoint's
    engine_cls: Any = ray.remote(RecordingEngine)
    asleep_engine, awake_engine = engine_cls.remote(), engine_cls.remote()
    actor.run("sleep")
    chunk_counts = actor.run("update_weights", asleep_engine)
    assert actor.run("asleep") == [True, True]  # the weights only; still asleep
    # TP = PP = 1: every rank holds every weight, so the process groups stayed torn down.
    assert all("destroy_process_groups" not in t for t in actor.run("lifecycle_timings"))
    actor.run("wake_up")
    actor.run("update_weights", awake_engine)
    chunks, sent = ray.get(asleep_engine.received.remote())
    _, sent_awake = ray.get(awake_engine.received.remote())
    assert chunks == chunk_counts[0] >= 1
    assert sent.keys() == initial.keys()
    assert all(sent[k].shape == initial[k].shape for k in initial)
    assert all(torch.equal(sent[k], sent_awake[k]) for k in sent)
    # The actor trained: its weights are no longer the checkpoint's.
    assert any(not torch.equal(sent[k], initial[k].to(sent[k].dtype)) for k in initial)


def test_save_kill_restart_resumes_each_role_from_its_own_folder(workers: Workers) -> None:
    from tandem.megatron.worker.checkpoint import read_latest

    critic, actor = workers.use("dp")
    config = workers.configs["dp"]
    checkpoint = workers.next_checkpoint()
    for group in (critic, actor):
        group.run("wake_up")
        group.run("save_model", checkpoint)
    assert read_latest(config.critic_save) == read_latest(config.save) == checkpoint
    saved = {"critic": snapshots(critic), "actor": snapshots(actor)}
    # The critic's own weights went to its own folder (scalar head, not the vocabulary head).
    assert saved["critic"][0]["weights/output_layer.weight"].shape == (1, 32)
    data = put_rollout(seed=6)
    continued = ppo_step(critic, actor, checkpoint + 1, data, sleep=False)
    trained = {"critic": snapshots(critic), "actor": snapshots(actor)}

    workers.kill()
    workers.start()
    critic, actor = workers.use("dp")
    assert critic.start_rollout_id == actor.start_rollout_id == checkpoint + 1
    assert_identical(snapshots(critic), saved["critic"])
    assert_identical(snapshots(actor), saved["actor"])
    resumed = ppo_step(critic, actor, checkpoint + 1, data, sleep=False)
    assert_identical(snapshots(critic), trained["critic"])
    assert_identical(snapshots(actor), trained["actor"])
    for role in ("critic", "actor"):
        assert [r.metrics for r in resumed[role]] == [r.metrics for r in continued[role]]


def test_pipeline_values_come_from_the_last_stage_only(workers: Workers) -> None:
    critic, actor = workers.use("pp")
    batch = make_batch(8, seed=7)
    data = [ray.put(batch)]  # one data-parallel rank: both stages get the whole rollout
    out = ppo_step(critic, actor, 0, data, sleep=True)
    assert out["critic"][0].values is None
    from tandem.value_transfer import unpack_values

    values = unpack_values(out["critic"][1].values.values, "cpu", sample_indices=batch.sample_indices)
    assert [v.numel() for v in values] == batch.response_lengths
    for role in ("critic", "actor"):
        first, last = (r.metrics for r in out[role])
        assert first == last and all(math.isfinite(v) for v in first.values()), (role, first)
    assert out["actor"][0].metrics["values_mean"] == out["critic"][0].metrics["values_mean"]
    again = ppo_step(critic, actor, 1, data, sleep=True)
    assert again["critic"][0].metrics["value_loss"] < out["critic"][0].metrics["value_loss"]


def test_pipeline_weight_export_gathers_both_stages(workers: Workers) -> None:
    from safetensors.torch import load_file

    _, actor = workers.use("pp")
    initial = load_file(str(Path(workers.configs["pp"].hf_checkpoint) / "model.safetensors"))
    engine_cls: Any = ray.remote(RecordingEngine)
    engine = engine_cls.remote()
    actor.run("sleep")
    actor.run("update_weights", engine)
    # PP = 2: the stages broadcast their tensors over groups that came back for the export.
    assert all("destroy_process_groups" in t for t in actor.run("lifecycle_timings"))
    _, sent = ray.get(engine.received.remote())
    assert sent.keys() == initial.keys()
    assert all(sent[k].shape == initial[k].shape for k in initial)
    assert actor.run("asleep") == [True, True]


def test_ppo_epochs_take_an_optimizer_step_per_minibatch_of_each_pass(workers: Workers) -> None:
    critic, actor = workers.use("epochs")
    before = snapshots(critic)
    out = ray.get(critic.train(0, put_rollout(seed=9)))
    # Two passes of two minibatches: four Adam steps, which the scheduler counts.
    assert [int(s["scheduler/num_steps"]) for s in snapshots(critic)] == [
        int(before[0]["scheduler/num_steps"]) + 4
    ] * 2
    assert all(math.isfinite(v) for v in out[0].metrics.values())
    # Past the first step the policy has moved away from the old log-probs, which stay fixed.
    metrics = ray.get(actor.train(0, put_rollout(seed=9, reward=1.0)))[0].metrics
    assert 0.0 <= metrics["clip_frac"] <= 1.0 and metrics["approx_kl"] > 0.0


def test_a_sleep_tears_one_rank_groups_down_unless_local_or_kept(workers: Workers) -> None:
    # dp: one-rank groups local (the default); epochs: with communicators, kept; pp: with communicators, torn down.
    for kind, local, keep in (("dp", True, False), ("epochs", False, True), ("pp", False, False)):
        _, actor = workers.use(kind)
        assert workers.configs[kind].local_single_rank_groups is local
        assert workers.configs[kind].keep_single_rank_groups is keep
        actor.run("wake_up")
        awake = actor.run("process_groups")[0]
        # DP 2 (dp, epochs) or PP 2 (pp): the model-parallel groups of dp and epochs have one rank.
        one_rank = awake["local_one_rank"] + awake["alive_one_rank"]
        assert one_rank > 0 and awake["alive_larger"] > 0, awake
        assert awake["local_one_rank"] == (one_rank if local else 0), (kind, awake)
        assert awake["torn_down_one_rank"] == awake["torn_down_larger"] == 0, awake
        actor.run("sleep")
        for asleep in actor.run("process_groups"):
            assert asleep["alive_larger"] == 0, (kind, asleep)
            assert asleep["local_one_rank"] == awake["local_one_rank"], (kind, asleep)
            assert asleep["alive_one_rank"] == (awake["alive_one_rank"] if keep else 0), (kind, asleep)
        # Training wakes the actor, every group rebuilt, and it trains on (PP 2: one data-parallel rank).
        data = [ray.put(make_batch(8, 110, 1.0))] if kind == "pp" else put_rollout(seed=11, reward=1.0)
        metrics = ray.get(actor.train(0, data))[-1].metrics  # the last stage's (the loss is there)
        assert math.isfinite(metrics["pg_loss"])
        assert all(g["torn_down_one_rank"] == g["torn_down_larger"] == 0 for g in actor.run("process_groups"))
