"""Wrong types and values fed to every public function: only a ValueError or TypeError naming the argument escapes.

Each case starts from a call that works, replaces one argument with something
drawn from `junk`, and calls again. The call may still succeed (a single payload
is any object), but if it fails, the error must be a ValueError or TypeError whose
message names the argument that was replaced; an AttributeError, a RuntimeError
from torch or an AssertionError from deep inside is a bug.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.value_transfer import (
    Box,
    IndexedValues,
    PackedValues,
    SampleGather,
    pack_indexed_values,
    pack_values,
    route_by_sample,
    route_per_rank,
    unpack_values,
    values_for_rank,
)


def _generator(n: int) -> Iterator[int]:
    yield from range(n)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=2),
)
junk = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.lists(st.integers(-2, 4), max_size=3),
    st.lists(st.lists(st.integers(-1, 4), max_size=3), max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sets(st.integers(0, 3), max_size=3),
    st.integers(0, 3).map(_generator),
    st.integers(0, 3).map(lambda n: torch.zeros(n)),
    st.integers(0, 3).map(lambda n: [torch.zeros(1)] * n),
    st.sampled_from(
        [
            torch.zeros(()),
            torch.ones(2, 2),
            np.zeros(3),
            np.zeros(3, dtype=np.uint8),
            [np.zeros(2)],
            [torch.zeros(1, dtype=torch.int64), torch.zeros(1)],
            [torch.zeros(2, device="meta")],
            [torch.zeros(2).to_sparse()],
            torch.float32,
            torch.device("cpu"),
            "meta",
            "cuda",
            "cuda:7",
            object(),
            ((0, 0),),
            ((0, 5), (1, 0)),
            (0.5, 1),
            range(3),
        ]
    ),
)


@pytest.fixture(scope="module")
def local_ray(module_ray_job: str) -> Iterator[None]:
    """This module as a job of the session's Ray cluster (tests/conftest.py)."""
    yield


@pytest.fixture(scope="module")
def calls(local_ray: None) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Each public function with arguments that work: name -> (function, keyword arguments)."""
    two = [torch.arange(3.0), torch.arange(2.0)]
    box = pack_values(two)
    critic = [pack_indexed_values(two, [0, 1]), pack_indexed_values(two, [2, 3])]
    gather = route_by_sample(critic, [[0, 2], [1, 3]])[0]
    packed = PackedValues.from_tensors(two)
    return {
        "Box": (Box, {"ref": box.ref}),
        "Box.get": (Box.get, {"self": box, "timeout": 30.0}),
        "PackedValues": (PackedValues, {"data": packed.data, "dtype": packed.dtype, "shapes": packed.shapes}),
        "PackedValues.from_tensors": (PackedValues.from_tensors, {"values": two}),
        "pack_values": (pack_values, {"values": two}),
        "pack_indexed_values": (pack_indexed_values, {"values": two, "sample_indices": [4, 7]}),
        "unpack_values": (unpack_values, {"payload": box, "device": "cpu", "sample_indices": [0, 1]}),
        "unpack_values(gather)": (
            unpack_values,
            {"payload": gather, "device": "cpu", "sample_indices": [0, 2]},
        ),
        "route_per_rank": (route_per_rank, {"external_data": [box, None], "world_size": 2}),
        "values_for_rank": (values_for_rank, {"payload": box, "rank": 1, "is_pipeline_last_stage": True}),
        "route_by_sample": (
            route_by_sample,
            {
                "critic_values": critic,
                "actor_sample_indices": [[0, 2], [1, 3]],
                "critic_dp_ranks": [0, 1],
                "actor_dp_ranks": [0, 1],
            },
        ),
        "IndexedValues": (IndexedValues, {"values": box, "sample_indices": (0, 1)}),
        "SampleGather": (
            SampleGather,
            {"sources": gather.sources, "picks": gather.picks, "sample_indices": gather.sample_indices},
        ),
    }


CASES = [
    ("Box", "ref"),
    ("Box.get", "timeout"),
    ("PackedValues", "data"),
    ("PackedValues", "dtype"),
    ("PackedValues", "shapes"),
    ("PackedValues.from_tensors", "values"),
    ("pack_values", "values"),
    ("pack_indexed_values", "values"),
    ("pack_indexed_values", "sample_indices"),
    ("unpack_values", "payload"),
    ("unpack_values", "device"),
    ("unpack_values", "sample_indices"),
    ("unpack_values(gather)", "sample_indices"),
    ("route_per_rank", "external_data"),
    ("route_per_rank", "world_size"),
    ("values_for_rank", "payload"),
    ("values_for_rank", "rank"),
    ("values_for_rank", "is_pipeline_last_stage"),
    ("route_by_sample", "critic_values"),
    ("route_by_sample", "actor_sample_indices"),
    ("route_by_sample", "critic_dp_ranks"),
    ("route_by_sample", "actor_dp_ranks"),
    ("IndexedValues", "values"),
    ("IndexedValues", "sample_indices"),
    ("SampleGather", "sources"),
    ("SampleGather", "picks"),
    ("SampleGather", "sample_indices"),
]


@pytest.mark.parametrize(("function", "argument"), CASES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=junk)
def test_a_wrong_argument_is_named_in_a_value_or_type_error(
    calls: dict[str, tuple[Callable[..., Any], dict[str, Any]]], function: str, argument: str, value: Any
) -> None:
    call, kwargs = calls[function]
    kwargs = {**kwargs, argument: value}
    try:
        call(**kwargs)
    except (ValueError, TypeError) as err:
        assert argument in str(err), f"{function}({argument}={value!r}): the error does not name it: {err}"


def test_every_public_function_is_fed_junk() -> None:
    import tandem.value_transfer as vt

    covered = {name.split(".")[0].split("(")[0] for name, _ in CASES}
    assert set(vt.__all__) - {"__version__"} <= covered


def test_a_single_tensor_is_refused_not_misread(local_ray: None) -> None:
    """Issue 13: `pack_values(torch.zeros(1))` tested a tensor's truth value and failed inside."""
    with pytest.raises(TypeError, match=r"values must be a list of tensors.*single Tensor of shape \(1,\)"):
        pack_values(torch.zeros(1))  # type: ignore[arg-type]
    assert [v.tolist() for v in unpack_values(pack_values([torch.zeros(1)]), "cpu")] == [[0.0]]


def test_a_generator_of_payloads_is_one_payload_per_rank() -> None:
    assert route_per_rank((f"p{r}" for r in range(3)), 3) == ["p0", "p1", "p2"]
    with pytest.raises(ValueError, match=r"external_data has 2 payloads but world_size is 3"):
        route_per_rank((f"p{r}" for r in range(2)), 3)


def test_boxes_without_indices_are_refused_by_route_by_sample(local_ray: None) -> None:
    with pytest.raises(TypeError, match=r"critic_values\[0\] is a Box .* pack_indexed_values"):
        route_by_sample([pack_values([torch.zeros(1)])], [[0]])  # type: ignore[list-item]
