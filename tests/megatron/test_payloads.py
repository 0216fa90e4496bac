"""The typed records between the roles and their routing (`payloads.route_payloads`, `TrainGroup.train`).

Per rank when they line up, else by sample; the actor's own log-probs stay with their rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.megatron.group import TrainGroup
from tandem.megatron.payloads import (
    ActorLogProbs,
    CriticValues,
    TrainResult,
    per_rank_sample_indices,
    route_payloads,
)
from tandem.value_transfer import SampleGather, pack_values, unpack_values


@pytest.fixture(scope="module")
def local_ray(module_ray_job: str) -> Iterator[None]:
    """This module as a job of the session's Ray cluster (tests/conftest.py)."""
    yield


def _values(indices: list[int]) -> list[torch.Tensor]:
    """A distinct tensor per sample: sample i has i % 3 + 1 values, all equal to i."""
    return [torch.full((i % 3 + 1,), float(i)) for i in indices]


def _critic_result(indices: list[int]) -> TrainResult:
    return TrainResult(metrics={}, values=CriticValues(pack_values(_values(indices)), tuple(indices)))


def _critic_values(critic_out: list[TrainResult]) -> list[CriticValues | None]:
    return [r.values for r in critic_out]


@pytest.mark.usefixtures("local_ray")
def test_critic_dp2_to_actor_tp2_by_sample() -> None:
    # Critic TP = 1, DP = 2 (ranks hold halves); actor TP = 2, DP = 1 (both ranks hold all, in another order).
    critic_out = [_critic_result([0, 1, 2]), _critic_result([3, 4, 5])]
    actor_order = [5, 0, 3, 1, 4, 2]
    routed = route_payloads(
        "critic", _critic_values(critic_out), 2, sample_indices=[actor_order], layout=(2, 1)
    )  # per DP rank
    for payload in routed:
        assert isinstance(payload, CriticValues) and isinstance(payload.values, SampleGather)
        got = unpack_values(payload.values, "cpu", sample_indices=actor_order)
        for index, tensor in zip(actor_order, got, strict=True):
            assert torch.equal(tensor, _values([index])[0]), index
        assert payload.sample_indices == tuple(actor_order)  # the receiving rank's own samples


@pytest.mark.usefixtures("local_ray")
def test_aligned_payloads_stay_per_rank() -> None:
    values = _critic_values([_critic_result([0, 1]), _critic_result([2, 3])])
    assert route_payloads("critic", values, 2, sample_indices=[[0, 1], [2, 3]]) == values
    assert route_payloads("critic", values, 2) == values
    # Not lined up: moved by sample, each rank's record names its own samples.
    routed = route_payloads("critic", values, 2, sample_indices=[[0, 1, 2, 3]] * 2)
    assert all(isinstance(r, CriticValues) and isinstance(r.values, SampleGather) for r in routed)
    assert all(r is not None and r.sample_indices == (0, 1, 2, 3) for r in routed)


@pytest.mark.usefixtures("local_ray")
def test_actor_log_probs_to_critic_by_sample_and_missing_samples_fail() -> None:
    # Actor TP = 2 (peers return the same samples: one source); critic DP = 2.
    record = ActorLogProbs(
        log_probs=pack_values(_values([0, 1, 2, 3])),
        ref_log_probs=pack_values(_values([0, 1, 2, 3])),
        sample_indices=(0, 1, 2, 3),
    )
    routed = route_payloads("log_probs", [record, record], 2, sample_indices=[[2, 3], [0, 1]])
    assert routed[0] is not None and routed[1] is not None
    assert unpack_values(routed[0].ref_log_probs, "cpu", sample_indices=[2, 3])[1].tolist() == [3.0]
    assert routed[1].sample_indices == (0, 1)
    assert unpack_values(routed[1].log_probs, "cpu", sample_indices=[0, 1])[1].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="no critic rank returned"):
        route_payloads("log_probs", [record, record], 2, sample_indices=[[0, 1], [2, 9]])


@pytest.mark.usefixtures("local_ray")
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(1, 12), world=st.integers(1, 3))
def test_routing_by_sample_gives_every_rank_exactly_its_samples(
    data: st.DataObject, n: int, world: int
) -> None:
    # Actor and critic on the same ranks, each with its own split of the samples and its own order.
    samples = list(range(n))

    def split() -> list[list[int]]:
        order = data.draw(st.permutations(samples))
        cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
        return [order[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]

    critic_split, actor_split = split(), split()
    records = [CriticValues(pack_values(_values(part)), tuple(part)) for part in critic_split]
    routed = route_payloads("critic", records, world, sample_indices=actor_split)
    for own, record in zip(actor_split, routed, strict=True):
        assert record is not None and record.sample_indices == tuple(own)
        got = unpack_values(record.values, "cpu", sample_indices=own)
        assert [t.tolist() for t in got] == [t.tolist() for t in _values(own)]


class _Recorder:
    """A stand-in worker handle: records what `TrainGroup.train` sends each rank."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.call = SimpleNamespace(
            remote=lambda method, *a, **kw: self.calls.append((a, kw)) if method == "train" else None
        )


def test_train_group_passes_the_records_by_name_and_checks_the_last_stage() -> None:
    workers = [_Recorder(), _Recorder()]
    actor = TrainGroup("actor", workers, 0, layout=(1, 2))  # PP = 2: rank 1 is the last stage
    values = CriticValues(values="box", sample_indices=(0, 1))
    own = ActorLogProbs(log_probs="lp", ref_log_probs=None, sample_indices=(0, 1))
    critic_out = [TrainResult(metrics={}), TrainResult(metrics={}, values=values)]
    actor.train(3, "data", critic=critic_out, log_probs=[None, own], kl_coef=0.02)
    # The step's KL coefficient (the adaptive controller's) reaches every rank alike.
    assert [w.calls[0][1] for w in workers] == [
        {"critic": None, "log_probs": None, "kl_coef": 0.02},
        {"critic": values, "log_probs": own, "kl_coef": 0.02},
    ]
    assert workers[0].calls[0][0] == (3, "data")
    # A last-stage rank without the critic's values is a routing error, caught before any call.
    with pytest.raises(ValueError, match="actor rank 1 is on the pipeline-last stage"):
        actor.train(4, "data", critic=[TrainResult(metrics={}, values=values), TrainResult(metrics={})])
    critic = TrainGroup("critic", [_Recorder()], 0, layout=(1, 1))
    with pytest.raises(ValueError, match="the critic takes none"):
        critic.train(0, "data", critic=critic_out[:1])


def test_sample_indices_per_data_parallel_rank_follow_megatrons_rank_order() -> None:
    # TP = 2, PP = 1 on 4 ranks: DP = 2, ranks 0-1 are DP rank 0, ranks 2-3 DP rank 1.
    assert per_rank_sample_indices([[0], [1]], 4, (2, 1)) == [(0,), (0,), (1,), (1,)]
    with pytest.raises(ValueError, match="sample_indices"):
        per_rank_sample_indices([[0], [1], [2]], 4, (2, 1))
