"""The train worker's memory tags on CPU: the optimizer in two kinds of tag, each in two pieces
(`optimizer_pieces=2`), some tags asleep, the state's bytes.

One actor group (Ray + gloo, data parallel 2, a tiny Llama, the pinned-host backend, a KL loss
against host-side reference weights) lives for the whole module. It is a group of its own, not
test_worker.py's: a Ray group belongs to its module's Ray job, and that module is at its size
limit. Each test wakes the group first, so each passes alone and in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

from tandem.megatron import RolloutBatch, TrainGroup, WorkerConfig, create_train_group

pytestmark = pytest.mark.slow

VOCAB = 64
RANKS = 2
MOMENTS = ["optimizer_moments.0", "optimizer_moments.1"]
MAIN_PARAMS = ["main_params.0", "main_params.1"]
TAGS = ["weights", "grads", *MAIN_PARAMS, *MOMENTS]
OPTIMIZER_AND_GRADS = [*MOMENTS, *MAIN_PARAMS, "grads"]


def put_rollout(seed: int) -> list[Any]:
    """One rollout of 8 samples (prompt 3 tokens, response 2-5), 4 for each data-parallel rank."""
    g = torch.Generator().manual_seed(seed)
    refs = []
    for rank in range(RANKS):
        lengths = [int(torch.randint(2, 6, (1,), generator=g)) for _ in range(4)]
        batch = RolloutBatch(
            tokens=[torch.randint(0, VOCAB, (3 + n,), generator=g) for n in lengths],
            response_lengths=lengths,
            loss_masks=[torch.ones(n) for n in lengths],
            rewards=torch.randn(4, generator=g),
            sample_indices=[seed * 100 + rank * 4 + i for i in range(4)],
        )
        refs.append(ray.put(batch))
    return refs


@pytest.fixture(scope="module")
def actor(
    tmp_path_factory: pytest.TempPathFactory, module_ray_job: str, random_llama: Callable[..., None]
) -> Iterator[TrainGroup]:
    from ray.util.placement_group import placement_group

    root = tmp_path_factory.mktemp("worker-tags")
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
        global_batch_size=4,
        micro_batch_size=2,
        device="cpu",
        params_dtype="float32",
        offload_backend="pinned_host",
        optimizer_pieces=2,
        lr=1e-3,
        use_kl_loss=True,
        kl_loss_coef=0.01,
        save=str(root / "actor"),
        load=str(root / "actor"),
    )
    pg = placement_group([{"CPU": 1}] * RANKS, strategy="PACK")
    ray.get(pg.ready())
    group = create_train_group(config, "actor", pg, range(RANKS), num_gpus_per_worker=0)
    yield group
    group.kill()


def log_probs(group: TrainGroup, rollout_id: int, data: list[Any]) -> list[list[torch.Tensor]]:
    """Each rank's old and reference log-probs (`compute_log_probs`), as one list of tensors."""
    from tandem.value_transfer import unpack_values

    out = []
    for rank, record in enumerate(ray.get(group.compute_log_probs(rollout_id, data))):
        indices = ray.get(data[rank]).sample_indices
        out.append(
            [
                *unpack_values(record.log_probs, "cpu", sample_indices=indices),
                *unpack_values(record.ref_log_probs, "cpu", sample_indices=indices),
            ]
        )
    return out


def groups_alive(group: TrainGroup) -> bool:
    """Whether every rank's larger process groups are alive (none torn down)."""
    counts = group.run("process_groups")
    return all(c["alive_larger"] > 0 and c["torn_down_larger"] == 0 for c in counts)


def assert_identical(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        different = [k for k in x if not torch.equal(x[k], y[k])]
        assert not different, f"rank {rank}: {different[:5]} differ"


def test_the_optimizer_sleeps_in_pieces_whose_bytes_are_known_asleep(actor: TrainGroup) -> None:
    actor.wake_up()
    assert actor.memory_tags() == TAGS
    ray.get(actor.train(0, put_rollout(seed=1)))
    awake = actor.state_nbytes()
    for nbytes in awake:
        assert nbytes.keys() >= set(TAGS)
        # Adam's two moments per trained weight, in two pieces of whole tensors, neither empty; on the
        # CPU the main weights are the model's own.
        moments = [nbytes[t] for t in MOMENTS]
        assert sum(moments) == 2 * nbytes["weights"] > 0 and min(moments) > 0, moments
        assert all(nbytes[t] == 0 for t in MAIN_PARAMS)
    assert actor.phase_peaks() == [{}, {}]  # the CPU has no allocator figures
    timings = actor.sleep()
    assert all({f"pause:{t}" for t in MAIN_PARAMS + MOMENTS} <= t.keys() for t in timings)
    assert actor.asleep_tags() == [TAGS, TAGS]
    assert actor.state_nbytes() == awake  # the figures recorded awake, not the freed storages' 0
    actor.sleep(OPTIMIZER_AND_GRADS)  # already away: nothing moves
    actor.wake_up(["weights"])
    assert actor.state_nbytes() == awake
    with pytest.raises(ray.exceptions.RayTaskError, match=r"choose among its memory tags \['weights'"):
        actor.sleep(["optimizer"])  # the torch_memory_saver backend's tag, not this one's
    actor.empty_cache()


def test_a_partial_sleep_keeps_computing_and_training_exact(actor: TrainGroup) -> None:
    actor.wake_up()
    actor.save_model(5)
    saved = actor.run("state_snapshot")
    data = put_rollout(seed=2)
    awake = log_probs(actor, 1, data)

    # One piece of the moments asleep, then the rest of the optimizer state and the gradients (the
    # pieces' cuts stay where they were with a piece asleep): the weights compute, the process groups stay.
    actor.sleep(MOMENTS[1:])
    assert actor.asleep_tags() == [MOMENTS[1:]] * RANKS
    timings = actor.sleep([t for t in OPTIMIZER_AND_GRADS if t not in MOMENTS[1:]])
    assert all("destroy_process_groups" not in t and "pause:grads" in t for t in timings)
    assert actor.asleep_tags() == [["grads", *MAIN_PARAMS, *MOMENTS]] * RANKS
    assert groups_alive(actor)
    partial = log_probs(actor, 1, data)
    for a, b in zip(awake, partial, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    # The last tag takes the process groups along; the first one back brings them back.
    timings = actor.sleep()
    assert all(
        list(t) == ["clear_caches", "destroy_process_groups", "pause:weights", "total"] for t in timings
    )
    assert not groups_alive(actor)
    with pytest.raises(ray.exceptions.RayTaskError, match=r"weight tags \['weights'\] are asleep"):
        ray.get(actor.compute_log_probs(1, data))
    assert all("reload_process_groups" in t for t in actor.wake_up(["weights"]))
    assert groups_alive(actor)
    assert all(torch.equal(x, y) for x, y in zip(awake[0], log_probs(actor, 1, data)[0], strict=True))

    # Training wakes the rest and trains as if nothing had slept.
    slept = ray.get(actor.train(1, data))
    assert actor.asleep_tags() == [[], []]
    after_sleeping = actor.run("state_snapshot")
    assert actor.load_model() == [5, 5]
    assert_identical(actor.run("state_snapshot"), saved)
    never_slept = ray.get(actor.train(1, data))
    assert_identical(actor.run("state_snapshot"), after_sleeping)
    assert [r.metrics for r in slept] == [r.metrics for r in never_slept]


class Engine:
    """Stands in for a rollout engine: keeps the weights it is sent."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors.update((name, tensor.clone()) for name, tensor in named_tensors)

    def received(self) -> dict[str, torch.Tensor]:
        return self.tensors


def test_a_weight_export_wakes_only_the_weights_that_sleep(actor: TrainGroup) -> None:
    actor.wake_up()
    engine_cls: Any = ray.remote(Engine)
    engines = [engine_cls.remote(), engine_cls.remote()]
    # The weights alone asleep: they come back for the export and go again; the rest stays awake, and so
    # do the process groups (nothing to tear down or rebuild).
    actor.sleep(["weights"])
    assert groups_alive(actor)
    actor.update_weights([engines[0]])
    assert actor.asleep_tags() == [["weights"]] * RANKS and groups_alive(actor)
    assert all(list(t) == ["clear_caches", "pause:weights", "total"] for t in actor.run("lifecycle_timings"))
    actor.wake_up()
    actor.update_weights([engines[1]])
    sent, sent_awake = ray.get([e.received.remote() for e in engines])
    assert sent and sent.keys() == sent_awake.keys()
    assert all(torch.equal(sent[k], sent_awake[k]) for k in sent)


def test_a_train_that_wakes_the_optimizer_state_for_its_steps_alone_trains_exact(actor: TrainGroup) -> None:
    # A memory plan's `at_step`: the optimizer's state asleep through the passes, woken for each optimizer
    # step (two a train here: 8 samples, 4 a step) and asleep again after it. The training is the same as with
    # the state awake throughout, and the state is asleep once the train is over.
    state = [*MAIN_PARAMS, *MOMENTS]
    actor.wake_up()
    ray.get(actor.train(1, put_rollout(seed=4)))  # Adam's moments exist, so the checkpoint holds them
    actor.save_model(6)
    data = put_rollout(seed=3)
    actor.sleep([*state, "grads"])
    actor.run("keep_asleep_for_passes", state)
    split = ray.get(actor.train(2, data))
    assert actor.asleep_tags() == [state] * RANKS, "the state sleeps again after the last step"
    assert all(r.step_moves.keys() == {"step_wake_s", "step_sleep_s", "step_moved_gib"} for r in split)
    assert all(r.metrics["optimizer_steps"] == 2 for r in split)
    asleep_figures = actor.state_nbytes()
    for result, figures in zip(split, asleep_figures, strict=True):  # each step: the state there and back
        assert result.step_moves["step_moved_gib"] * 2**30 == 2 * 2 * sum(figures[t] for t in state) > 0
    actor.wake_up()
    assert actor.state_nbytes() == asleep_figures, "the state's bytes recorded while it was awake for a step"
    after_split = actor.run("state_snapshot")

    actor.run("keep_asleep_for_passes", [])
    assert actor.load_model() == [6, 6]
    whole = ray.get(actor.train(2, data))
    assert actor.asleep_tags() == [[], []] and all(r.step_moves == {} for r in whole)
    assert_identical(actor.run("state_snapshot"), after_split)
    assert [r.metrics for r in split] == [r.metrics for r in whole]

    # Awake as the train begins, they stay awake: nothing to wake for a step.
    actor.run("keep_asleep_for_passes", state)
    assert all(r.step_moves == {} for r in ray.get(actor.train(3, data)))
    assert actor.asleep_tags() == [[], []]
    actor.run("keep_asleep_for_passes", [])
    with pytest.raises(ray.exceptions.RayTaskError, match=r"keep_asleep_for_passes: tags \['adam'\]"):
        actor.run("keep_asleep_for_passes", ["adam"])


def assert_parts_sum_to_total(train_time: dict[str, float]) -> None:
    parts = {k: v for k, v in train_time.items() if k not in ("total", "call")}
    assert all(v >= 0 for v in train_time.values()) and train_time["total"] > 0
    assert sum(parts.values()) == pytest.approx(train_time["total"], rel=1e-9, abs=1e-9)
    assert train_time["call"] >= train_time["total"], "the worker's whole method holds its train"


def test_a_train_says_where_its_seconds_went(actor: TrainGroup) -> None:
    # Two optimizer steps a train (8 samples, 4 a step): the old log-probs are a forward of their own, and
    # the KL loss's reference log-probs another, with the reference weights swapped in.
    actor.wake_up()
    out = ray.get(actor.train(7, put_rollout(seed=7)))
    for result in out:
        assert result.train_time.keys() == {
            "old_log_probs",
            "reference_log_probs",
            "passes",
            "optimizer_step",
            "other",
            "total",
            "call",
        }
        assert_parts_sum_to_total(result.train_time)
    # Given the log-probs (the KL-first plan), the train runs neither forward of its own.
    data = put_rollout(seed=8)
    given = ray.get(actor.compute_log_probs(8, data))
    for result in ray.get(actor.train(8, data, log_probs=given)):
        assert result.train_time.keys() == {"passes", "optimizer_step", "other", "total", "call"}
        assert_parts_sum_to_total(result.train_time)
