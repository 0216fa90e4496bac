"""Routing the payloads between roles (`payloads.route_payloads`): per rank when they line up, else by sample."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

from tandem.megatron.payloads import per_rank_sample_indices, route_payloads
from tandem.value_transfer import SampleGather, pack_values, unpack_values


@pytest.fixture(scope="module")
def local_ray(ray_start: Callable[[Callable[[], Any]], Any]) -> Iterator[None]:
    ray_start(lambda: ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False))
    yield
    ray.shutdown()


def _values(indices: list[int]) -> list[torch.Tensor]:
    """A distinct tensor per sample: sample i has i + 1 values, all equal to i."""
    return [torch.full((i % 3 + 1,), float(i)) for i in indices]


def _critic_result(indices: list[int]) -> dict[str, Any]:
    return {"metrics": {}, "values": pack_values(_values(indices)), "critic_sample_indices": tuple(indices)}


@pytest.mark.usefixtures("local_ray")
def test_critic_dp2_to_actor_tp2_by_sample() -> None:
    # Critic TP = 1, DP = 2 (ranks hold halves); actor TP = 2, DP = 1 (both ranks hold all, in another order).
    critic_out = [_critic_result([0, 1, 2]), _critic_result([3, 4, 5])]
    actor_order = [5, 0, 3, 1, 4, 2]
    routed = route_payloads(
        "actor", critic_out, 2, sample_indices=[actor_order], layout=(2, 1)
    )  # per DP rank
    for payload in routed:
        assert isinstance(payload["values"], SampleGather)
        got = unpack_values(payload["values"], "cpu", sample_indices=actor_order)
        for index, tensor in zip(actor_order, got, strict=True):
            assert torch.equal(tensor, _values([index])[0]), index
        assert "critic_sample_indices" not in payload


@pytest.mark.usefixtures("local_ray")
def test_aligned_payloads_stay_per_rank_and_own_keys_keep_their_rank() -> None:
    critic_out = [_critic_result([0, 1]), _critic_result([2, 3])]
    assert route_payloads("actor", critic_out, 2, sample_indices=[[0, 1], [2, 3]]) == critic_out
    assert route_payloads("actor", critic_out, 2) == critic_out
    # The actor's own log-probs (merged per rank) stay with their rank when values move by sample.
    own = [{"log_probs": pack_values(_values([0, 1, 2, 3])), "actor_sample_indices": (0, 1, 2, 3)}] * 2
    merged = [{**c, **a} for c, a in zip(critic_out, own, strict=True)]
    routed = route_payloads("actor", merged, 2, sample_indices=[[0, 1, 2, 3]] * 2)
    assert all(r["log_probs"] is own[0]["log_probs"] for r in routed)
    assert all(isinstance(r["values"], SampleGather) for r in routed)


@pytest.mark.usefixtures("local_ray")
def test_actor_log_probs_to_critic_by_sample_and_missing_samples_fail() -> None:
    # Actor TP = 2 (peers return the same samples: one source); critic DP = 2.
    payload = {
        "log_probs": pack_values(_values([0, 1, 2, 3])),
        "ref_log_probs": pack_values(_values([0, 1, 2, 3])),
        "actor_sample_indices": (0, 1, 2, 3),
    }
    routed = route_payloads("critic", [payload, payload], 2, sample_indices=[[2, 3], [0, 1]])
    assert unpack_values(routed[0]["ref_log_probs"], "cpu", sample_indices=[2, 3])[1].tolist() == [3.0]
    assert set(routed[1]) == {"log_probs", "ref_log_probs"}
    with pytest.raises(ValueError, match="no critic rank returned"):
        route_payloads("critic", [payload, payload], 2, sample_indices=[[0, 1], [2, 9]])


def test_sample_indices_per_data_parallel_rank_follow_megatrons_rank_order() -> None:
    # TP = 2, PP = 1 on 4 ranks: DP = 2, ranks 0-1 are DP rank 0, ranks 2-3 DP rank 1.
    assert per_rank_sample_indices([[0], [1]], 4, (2, 1)) == [(0,), (0,), (1,), (1,)]
    with pytest.raises(ValueError, match="sample_indices"):
        per_rank_sample_indices([[0], [1], [2]], 4, (2, 1))
