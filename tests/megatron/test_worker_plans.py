"""The KL-first plan and a critic with its own layout, on CPU: Ray + gloo, two ranks per role, a tiny Llama.

- "layouts": an actor with TP = 2, DP = 1 and a critic with TP = 1, DP = 2 on the
  same two bundles, reward-level KL on (`kl_coef`). The actor's log-probs reach
  the critic's ranks and the critic's values reach the actor's ranks by sample;
  the critic's returns and the actor's advantages equal an independent
  computation with the KL term, from the returned log-probs, rewards and values.
- "kl0": the KL-first plan's calls with `kl_coef = 0` leave the state bit for bit
  where the plain critic → actor step leaves it.
- "grpo", "rpp_baseline": critic-free actors on DP = 2, each rank holding half of
  every prompt's samples: GRPO's advantages (and GSPO's loss) and
  REINFORCE++-baseline's (token KL in the reward, whitened over both ranks) equal
  a computation from the paper's formula over the whole rollout.

One pair of groups at a time (each Ray worker imports Megatron, which is slow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from tandem.megatron import RolloutBatch, TrainGroup, WorkerConfig, create_train_group
from tandem.megatron.payloads import ActorLogProbs

pytestmark = pytest.mark.slow

VOCAB = 64
RANKS = 2
GAMMA, LAMBD, KL_COEF = 0.9, 0.8, 0.5


def make_batch(n: int, seed: int) -> RolloutBatch:
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
    return RolloutBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=masks,
        rewards=torch.randn(n, generator=g),
        sample_indices=[seed * 100 + i for i in range(n)],
    )


class Groups:
    """The critic and actor groups of one configuration at a time."""

    def __init__(self, pg: Any, configs: dict[str, WorkerConfig]) -> None:
        self.pg, self.configs = pg, configs
        self.kind: str | None = None
        self.critic: TrainGroup | None = None
        self.actor: TrainGroup | None = None

    def use(self, kind: str) -> tuple[TrainGroup, TrainGroup]:
        self._start(kind)
        assert self.critic is not None and self.actor is not None
        return self.critic, self.actor

    def actor_only(self, kind: str) -> TrainGroup:
        """The actor of a critic-free configuration (no critic group starts)."""
        self._start(kind)
        assert self.critic is None and self.actor is not None
        return self.actor

    def _start(self, kind: str) -> None:
        if self.kind != kind:
            self.kill()
            config = self.configs[kind]
            if config.uses_critic:
                self.critic = create_train_group(
                    config, "critic", self.pg, range(RANKS), num_gpus_per_worker=0
                )
            self.actor = create_train_group(config, "actor", self.pg, range(RANKS), num_gpus_per_worker=0)
            self.kind = kind

    def kill(self) -> None:
        for group in (self.critic, self.actor):
            if group is not None:
                group.kill()
        self.critic = self.actor = None
        self.kind = None


@pytest.fixture(scope="module")
def groups(
    tmp_path_factory: pytest.TempPathFactory,
    module_ray_job: str,
    random_llama: Callable[..., None],
) -> Iterator[Groups]:
    root: Path = tmp_path_factory.mktemp("plans")
    random_llama(
        root / "hf",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    # A smaller critic: another hidden size and depth.
    random_llama(
        root / "hf-critic",
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        max_position_embeddings=64,
    )
    base = WorkerConfig(
        hf_checkpoint=str(root / "hf"),
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        global_batch_size=4,
        micro_batch_size=1,
        device="cpu",
        params_dtype="float32",
        offload_backend="pinned_host",
        lr=1e-2,
        critic_lr=2e-3,
        gamma=GAMMA,
        lambd=LAMBD,
        # The advantages are compared with a plain reverse loop below: raw, not whitened.
        normalize_advantages=False,
    )
    configs = {
        "layouts": dataclasses.replace(
            base,
            tensor_model_parallel_size=2,
            critic_tensor_model_parallel_size=1,
            critic_hf_checkpoint=str(root / "hf-critic"),
            kl_coef=KL_COEF,
        ),
        "kl0": dataclasses.replace(
            base,
            use_kl_loss=True,
            kl_loss_coef=0.01,
            save=str(root / "actor"),
            load=str(root / "actor"),
            critic_save=str(root / "critic"),
            critic_load=str(root / "critic"),
        ),
        # Critic-free: DP = 2, two prompts of 4 samples (8 samples, 4 a rank).
        "grpo": dataclasses.replace(
            base, rollout_batch_size=2, n_samples_per_prompt=4, advantage_estimator="grpo", loss_type="gspo"
        ),
        "rpp_baseline": dataclasses.replace(
            base,
            rollout_batch_size=2,
            n_samples_per_prompt=4,
            advantage_estimator="reinforce_plus_plus_baseline",
            kl_coef=KL_COEF,
            normalize_advantages=True,
            gamma=1.0,  # its centred outcome reward is not discounted (OpenRLHF forces 1)
        ),
    }
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 1}] * RANKS, strategy="PACK")
    ray.get(pg.ready())
    state = Groups(pg, configs)
    yield state
    state.kill()


def by_sample(box: Any, indices: list[int]) -> dict[int, torch.Tensor]:
    from tandem.value_transfer import unpack_values

    return dict(zip(indices, unpack_values(box, "cpu", sample_indices=indices), strict=True))


def reference_targets(
    rewards: float, log_probs: torch.Tensor, ref: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one response with the KL term, the textbook way (k1, reverse loop)."""
    steps = [t for t in range(len(mask)) if mask[t] != 0]
    advantages = [0.0] * len(mask)
    returns = [0.0] * len(mask)
    next_value = next_advantage = 0.0
    for k in reversed(range(len(steps))):
        t = steps[k]
        r = -KL_COEF * float(log_probs[t] - ref[t]) + (rewards if k == len(steps) - 1 else 0.0)
        delta = r + GAMMA * next_value - float(values[t])
        advantages[t] = delta + GAMMA * LAMBD * next_advantage
        returns[t] = advantages[t] + float(values[t])
        next_value, next_advantage = float(values[t]), advantages[t]
    return advantages, returns


def test_kl_first_plan_across_layouts(groups: Groups) -> None:
    critic, actor = groups.use("layouts")
    assert (actor.data_parallel_size, critic.data_parallel_size) == (1, 2)
    batch = make_batch(8, seed=3)
    halves = [batch.select(range(0, 4)), batch.select(range(4, 8))]
    actor_data = [ray.put(batch)]
    critic_data = [ray.put(h) for h in halves]
    actor_indices = [batch.sample_indices] * RANKS  # TP peers hold the same samples
    critic_indices = [h.sample_indices for h in halves]
    # One plain actor step first, so that the policy is no longer the reference (KL != 0).
    ray.get(actor.train(0, actor_data))

    # The KL-first plan: actor log-probs, then the critic, then the actor.
    log_probs_out = ray.get(actor.compute_log_probs(1, actor_data))
    assert all(isinstance(o, ActorLogProbs) and o.ref_log_probs is not None for o in log_probs_out)
    critic_out = ray.get(critic.train(1, critic_data, log_probs=log_probs_out, sample_indices=critic_indices))
    actor_out = ray.get(
        actor.train(1, actor_data, critic=critic_out, log_probs=log_probs_out, sample_indices=actor_indices)
    )
    critic_targets, actor_targets = critic.run("last_targets"), actor.run("last_targets")

    log_probs = by_sample(log_probs_out[0].log_probs, batch.sample_indices)
    ref = by_sample(log_probs_out[0].ref_log_probs, batch.sample_indices)
    values: dict[int, torch.Tensor] = {}
    for out, indices in zip(critic_out, critic_indices, strict=True):
        assert list(out.values.sample_indices) == indices
        values |= by_sample(out.values.values, indices)
    assert values.keys() == set(batch.sample_indices)
    assert any(float((log_probs[i] - ref[i]).abs().max()) > 1e-4 for i in log_probs), "KL is 0: vacuous"

    # The values each actor rank received are the critic's, sample by sample.
    for rank, targets in enumerate(actor_targets):
        assert targets["sample_indices"] == batch.sample_indices, rank
        for row, index in enumerate(targets["sample_indices"]):
            n = batch.response_lengths[row]
            assert torch.equal(targets["old_values"][row, :n], values[index]), (rank, index)
            # The actor reused the log-probs it had returned (no recomputation needed).
            assert torch.equal(targets["old_log_probs"][row, :n], log_probs[index])
            assert torch.equal(targets["ref_log_probs"][row, :n], ref[index])

    # Critic returns and actor advantages: an independent computation with the KL term.
    position = {index: i for i, index in enumerate(batch.sample_indices)}
    for targets in critic_targets:
        for row, index in enumerate(targets["sample_indices"]):
            i = position[index]
            n = batch.response_lengths[i]
            _, expected = reference_targets(
                float(batch.rewards[i]), log_probs[index], ref[index], values[index], batch.loss_masks[i]
            )
            torch.testing.assert_close(
                targets["returns"][row, :n], torch.tensor(expected), rtol=1e-5, atol=1e-6
            )
    for targets in actor_targets:
        for row, index in enumerate(targets["sample_indices"]):
            n = batch.response_lengths[row]
            expected, _ = reference_targets(
                float(batch.rewards[row]), log_probs[index], ref[index], values[index], batch.loss_masks[row]
            )
            torch.testing.assert_close(
                targets["advantages"][row, :n], torch.tensor(expected), rtol=1e-5, atol=1e-6
            )
    for out in (critic_out, actor_out):
        assert out[0].metrics["reward_kl"] == pytest.approx(out[1].metrics["reward_kl"])
    assert critic_out[0].metrics["reward_kl"] == pytest.approx(actor_out[0].metrics["reward_kl"], rel=1e-5)

    # Without the actor's log-probs the critic refuses, naming kl_coef, on every rank.
    with pytest.raises(ray.exceptions.RayTaskError, match="kl_coef"):
        ray.get(critic.train(2, critic_data))


def test_kl_coef_zero_plan_reproduces_the_plain_step_bit_for_bit(groups: Groups) -> None:
    critic, actor = groups.use("kl0")
    batch = make_batch(8, seed=5)
    data = [ray.put(batch.select(range(0, 4))), ray.put(batch.select(range(4, 8)))]
    indices = [list(range(500, 504)), list(range(504, 508))]
    # One step first: the optimizer state exists (Adam's is made lazily) and is saved and loaded too.
    ray.get(actor.train(6, data, critic=ray.get(critic.train(6, data))))
    for group in (critic, actor):
        group.run("save_model", 7)
    before = {"critic": critic.run("state_snapshot"), "actor": actor.run("state_snapshot")}

    critic_plain = ray.get(critic.train(8, data))
    actor_plain = ray.get(actor.train(8, data, critic=critic_plain))
    plain = {"critic": critic.run("state_snapshot"), "actor": actor.run("state_snapshot")}

    for group in (critic, actor):
        assert group.run("load_model") == [7, 7]
    assert all(_equal(a, b) for a, b in zip(actor.run("state_snapshot"), before["actor"], strict=True))
    log_probs_out = ray.get(actor.compute_log_probs(8, data))
    critic_plan = ray.get(critic.train(8, data, log_probs=log_probs_out, sample_indices=indices))
    actor_plan = ray.get(
        actor.train(8, data, critic=critic_plan, log_probs=log_probs_out, sample_indices=indices)
    )
    for role, group in (("critic", critic), ("actor", actor)):
        after = group.run("state_snapshot")
        assert all(_equal(a, b) for a, b in zip(after, plain[role], strict=True)), role
        assert not _equal(after[0], before[role][0]), f"{role} did not train"
    assert [r.metrics for r in critic_plan] == [r.metrics for r in critic_plain]
    assert [r.metrics for r in actor_plan] == [r.metrics for r in actor_plain]

    # The driver owns the plan: computing never wakes the actor; only the actor computes log-probs.
    actor.run("sleep")
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        ray.get(actor.compute_log_probs(9, data))
    actor.run("wake_up")
    with pytest.raises(ValueError, match="only the actor"):
        critic.compute_log_probs(9, data)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def split_groups(batch: RolloutBatch) -> list[RolloutBatch]:
    """Rank 0 gets samples 0, 1, 4, 5 and rank 1 samples 2, 3, 6, 7: half of each prompt's four each."""
    return [batch.select([0, 1, 4, 5]), batch.select([2, 3, 6, 7])]


def grpo_reference(rewards: list[float], size: int) -> list[float]:
    """DeepSeekMath §4.1.2: (r − mean) / (std + 1e-6) per group, unbiased std; a tied group gives 0."""
    out = []
    for g in range(0, len(rewards), size):
        group = rewards[g : g + size]
        mean = sum(group) / size
        std = (sum((r - mean) ** 2 for r in group) / (size - 1)) ** 0.5
        out += [0.0 if len(set(group)) == 1 else (r - mean) / (std + 1e-6) for r in group]
    return out


def test_grpo_pools_each_prompts_samples_across_data_parallel_ranks(groups: Groups) -> None:
    actor = groups.actor_only("grpo")
    assert actor.data_parallel_size == 2
    batch = make_batch(8, seed=7)
    batch.sample_indices = list(range(8))  # sample i of the rollout: prompt i // 4
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # prompt 1: all tied
    shares = split_groups(batch)
    out = ray.get(actor.train(0, [ray.put(s) for s in shares]))
    expected = grpo_reference(batch.rewards.tolist(), 4)
    for targets, share in zip(actor.run("last_targets"), shares, strict=True):
        assert targets["sample_indices"] == share.sample_indices
        assert "old_values" not in targets  # no critic, no values
        for row, index in enumerate(share.sample_indices):
            mask = share.loss_masks[row]
            n = share.response_lengths[row]
            torch.testing.assert_close(
                targets["advantages"][row, :n], expected[index] * mask, rtol=1e-5, atol=1e-6
            )
    metrics = out[0].metrics
    assert metrics == out[1].metrics
    assert metrics["tied_groups"] == pytest.approx(0.5)
    assert "values_mean" not in metrics and "returns_mean" not in metrics
    assert metrics["pg_loss"] != 0 and metrics["grad_norm"] > 0

    # Sample 3 renamed 11: prompt 0 misses a sample and prompt 2 has one; every rank refuses alike.
    stray = dataclasses.replace(batch.select([5, 6, 7, 3]), sample_indices=[5, 6, 7, 11])
    with pytest.raises(ray.exceptions.RayTaskError, match="n_samples_per_prompt"):
        ray.get(actor.train(1, [ray.put(batch.select([0, 1, 2, 4])), ray.put(stray)]))


def test_reinforce_plus_plus_baseline_without_a_critic(groups: Groups) -> None:
    """Group-centred reward at the last token, −β·KL per token (the actor's own reference pass),
    summed back (γ = 1), whitened over the trainable tokens of both ranks."""
    actor = groups.actor_only("rpp_baseline")
    batch = make_batch(8, seed=9)
    batch.sample_indices = list(range(8))
    shares = split_groups(batch)
    refs = [ray.put(s) for s in shares]
    ray.get(actor.train(0, refs))  # one step, so that the policy is no longer the reference (KL != 0)
    out = ray.get(actor.train(1, refs))
    all_targets = actor.run("last_targets")

    rewards = batch.rewards.tolist()
    centred = []
    for g in range(0, 8, 4):
        mean = sum(rewards[g : g + 4]) / 4
        centred += [r - mean for r in rewards[g : g + 4]]
    raw: dict[int, list[float]] = {}
    moved = 0.0
    for targets, share in zip(all_targets, shares, strict=True):
        for row, index in enumerate(share.sample_indices):
            n = share.response_lengths[row]
            old, ref = targets["old_log_probs"][row, :n], targets["ref_log_probs"][row, :n]
            moved = max(moved, float((old - ref).abs().max()))
            steps = [t for t in range(n) if share.loss_masks[row][t] != 0]
            token_reward = {t: -KL_COEF * float(old[t] - ref[t]) for t in steps}
            token_reward[steps[-1]] += centred[index]
            g = [0.0] * n
            for k in range(len(steps)):
                g[steps[k]] = sum(token_reward[steps[j]] for j in range(k, len(steps)))
            raw[index] = g
    assert moved > 1e-4, "the policy equals the reference: the KL term is vacuous"
    tokens = [
        raw[i][t] for share in shares for row, i in enumerate(share.sample_indices)
        for t in range(share.response_lengths[row]) if share.loss_masks[row][t] != 0
    ]  # fmt: skip
    mean = sum(tokens) / len(tokens)
    std = (sum((a - mean) ** 2 for a in tokens) / (len(tokens) - 1) + 1e-8) ** 0.5
    for targets, share in zip(all_targets, shares, strict=True):
        for row, index in enumerate(share.sample_indices):
            n = share.response_lengths[row]
            expected = torch.tensor([(a - mean) / std for a in raw[index]]) * share.loss_masks[row]
            torch.testing.assert_close(targets["advantages"][row, :n], expected, rtol=1e-4, atol=1e-5)
    metrics = out[0].metrics
    assert metrics["reward_kl"] != 0 and "tied_groups" in metrics and "values_mean" not in metrics
