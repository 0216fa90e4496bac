"""Layout math: the table of docs/design.md ("Layout rules") and the spec's validation, as properties."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.placement import Layout, PlacementSpec, compute_layout

FLAGS = ("colocate", "debug_train_only", "debug_rollout_only", "rollout_external", "use_critic")


# -- the table, row by row, with hand-picked numbers (A = 2 nodes × 4 GPUs = 8) -------------------

TABLE = [
    # (spec fields, num_gpus, rollout_offset): one row of the table each, first match wins
    (dict(debug_train_only=True, rollout_num_gpus=3, colocate=True), 8, 0),
    (dict(rollout_external=True, debug_rollout_only=True), 0, 0),
    (dict(rollout_external=True), 8, 8),
    (dict(debug_rollout_only=True, rollout_num_gpus=3), 3, 0),
    (dict(debug_rollout_only=True, rollout_num_gpus=3, colocate=True), 3, 0),
    (dict(colocate=True, rollout_num_gpus=3), 8, 0),
    (dict(colocate=True, rollout_num_gpus=12), 12, 0),
    (dict(rollout_num_gpus=3), 11, 8),
    (dict(rollout_num_gpus=3, eval_num_gpus=2), 13, 8),
]


@pytest.mark.parametrize(("fields", "num_gpus", "rollout_offset"), TABLE)
@pytest.mark.parametrize("use_critic", [False, True])
def test_table_rows(fields: dict[str, Any], num_gpus: int, rollout_offset: int, use_critic: bool) -> None:
    layout = compute_layout(
        PlacementSpec(actor_num_nodes=2, actor_num_gpus_per_node=4, use_critic=use_critic, **fields)
    )
    assert (layout.num_gpus, layout.rollout_offset) == (num_gpus, rollout_offset)


# -- properties over every combination of fields ----------------------------------------------------

counts = st.one_of(st.integers(-2, 6), st.just(1.0), st.just(True), st.just("2"))
flags = st.one_of(st.booleans(), st.just(1), st.none())
raw_fields = st.fixed_dictionaries(
    {
        "actor_num_nodes": counts,
        "actor_num_gpus_per_node": counts,
        "rollout_num_gpus": st.one_of(st.none(), counts),
        "eval_num_gpus": counts,
        **{flag: flags for flag in FLAGS},
    }
)
# Mostly well-typed, small fields: most examples are valid, so the layout properties get exercised.
typed_fields = st.fixed_dictionaries(
    {
        "actor_num_nodes": st.integers(0, 3),
        "actor_num_gpus_per_node": st.integers(0, 8),
        "rollout_num_gpus": st.one_of(st.none(), st.integers(0, 12)),
        "eval_num_gpus": st.integers(0, 3),
        **{flag: st.booleans() for flag in FLAGS},
    }
)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def expected_valid(f: dict[str, Any]) -> bool:
    """The validation rules, written out independently of the implementation."""
    if not all(_is_count(f[k]) for k in ("actor_num_nodes", "actor_num_gpus_per_node", "eval_num_gpus")):
        return False
    if f["rollout_num_gpus"] is not None and not _is_count(f["rollout_num_gpus"]):
        return False
    if not all(type(f[flag]) is bool for flag in FLAGS):
        return False
    if f["debug_train_only"] and f["debug_rollout_only"]:
        return False
    if f["colocate"] and f["rollout_external"]:
        return False
    trains = not f["debug_rollout_only"]
    if trains and (f["actor_num_nodes"] == 0 or f["actor_num_gpus_per_node"] == 0):
        return False
    engine_here = not f["debug_train_only"] and not f["rollout_external"]
    if engine_here and not f["rollout_num_gpus"]:  # None or 0
        return False
    debug = f["debug_train_only"] or f["debug_rollout_only"]
    return not ((f["colocate"] or f["rollout_external"]) and f["eval_num_gpus"] > 0 and not debug)


def table(f: dict[str, Any]) -> tuple[int, int]:
    """docs/design.md's table, row by row: (num_gpus, rollout_offset)."""
    a = f["actor_num_nodes"] * f["actor_num_gpus_per_node"]
    r = f["rollout_num_gpus"]
    if f["debug_train_only"]:
        return a, 0
    if f["rollout_external"] and f["debug_rollout_only"]:
        return 0, 0
    if f["rollout_external"]:
        return a, a
    if f["debug_rollout_only"]:
        return r, 0
    if f["colocate"]:
        return max(a, r), 0
    return a + r + f["eval_num_gpus"], a


@settings(max_examples=400, deadline=None)
@given(st.one_of(raw_fields, typed_fields))
def test_valid_specs_lay_out_and_invalid_ones_raise(fields: dict[str, Any]) -> None:
    if not expected_valid(fields):
        with pytest.raises(ValueError):
            PlacementSpec(**fields)
        return
    layout = compute_layout(PlacementSpec(**fields))
    figures = dataclasses.asdict(layout)
    del figures["case"]
    assert all(value >= 0 for value in figures.values()), layout
    assert (layout.num_gpus, layout.rollout_offset) == table(fields)


def valid_specs() -> st.SearchStrategy[PlacementSpec]:
    return typed_fields.filter(expected_valid).map(lambda f: PlacementSpec(**f))


@settings(max_examples=300, deadline=None)
@given(valid_specs())
def test_slots_fit_inside_the_group(spec: PlacementSpec) -> None:
    layout = compute_layout(spec)
    everything = range(layout.num_gpus)
    for slot in (layout.train_gpus, layout.rollout_gpus, layout.eval_gpus):
        assert set(slot) <= set(everything), layout


@settings(max_examples=300, deadline=None)
@given(valid_specs())
def test_no_bundle_is_reserved_for_nothing(spec: PlacementSpec) -> None:
    layout = compute_layout(spec)
    used = set(layout.train_gpus) | set(layout.rollout_gpus) | set(layout.eval_gpus)
    assert used == set(range(layout.num_gpus)), layout


@settings(max_examples=300, deadline=None)
@given(valid_specs())
def test_training_and_rollout_overlap_only_when_colocated(spec: PlacementSpec) -> None:
    layout = compute_layout(spec)
    train, rollout, evaluation = set(layout.train_gpus), set(layout.rollout_gpus), set(layout.eval_gpus)
    assert not evaluation & (train | rollout), layout
    if layout.colocated:
        assert layout.rollout_offset == 0
        assert train and rollout and (train <= rollout or rollout <= train)
    else:
        assert not train & rollout, layout
    assert layout.colocated == (spec.colocate and not spec.debug_train_only and not spec.debug_rollout_only)


@settings(max_examples=300, deadline=None)
@given(valid_specs())
def test_the_critic_never_adds_gpus(spec: PlacementSpec) -> None:
    with_critic = compute_layout(dataclasses.replace(spec, use_critic=True))
    without = compute_layout(dataclasses.replace(spec, use_critic=False))
    assert (with_critic.num_gpus, with_critic.rollout_offset) == (without.num_gpus, without.rollout_offset)
    assert with_critic == without


@settings(max_examples=200, deadline=None)
@given(valid_specs())
def test_rollout_starts_at_the_offset_and_training_at_zero(spec: PlacementSpec) -> None:
    layout = compute_layout(spec)
    assert layout.rollout_gpus.start == layout.rollout_offset
    assert layout.train_gpus.start == 0
    if not spec.debug_rollout_only:
        assert layout.train_num_gpus == spec.actor_num_nodes * spec.actor_num_gpus_per_node


# -- the error messages name the field and the fix ----------------------------------------------

BAD = [
    (dict(actor_num_nodes=-1, rollout_num_gpus=1), "actor_num_nodes", ">= 0"),
    (dict(actor_num_gpus_per_node=0, rollout_num_gpus=1), "actor_num_gpus_per_node", ">= 1"),
    (dict(actor_num_nodes=1.5, rollout_num_gpus=1), "actor_num_nodes", "int"),
    (dict(), "rollout_num_gpus", "debug_train_only=True"),
    (dict(rollout_num_gpus=0), "rollout_num_gpus", ">= 1"),
    (dict(debug_rollout_only=True), "rollout_num_gpus", ">= 1"),
    (dict(colocate=True), "rollout_num_gpus", ">= 1"),
    (dict(colocate=True, rollout_external=True), "rollout_external", "colocate=False"),
    (dict(debug_train_only=True, debug_rollout_only=True), "debug_rollout_only", "at most one"),
    (dict(colocate=True, rollout_num_gpus=2, eval_num_gpus=1), "eval_num_gpus", "eval_num_gpus=0"),
    (dict(rollout_external=True, eval_num_gpus=1), "eval_num_gpus", "eval_num_gpus=0"),
    (dict(rollout_num_gpus=2, use_critic="yes"), "use_critic", "True or False"),
]


@pytest.mark.parametrize(("fields", "field", "fix"), BAD)
def test_bad_specs_name_the_field_and_the_fix(fields: dict[str, Any], field: str, fix: str) -> None:
    with pytest.raises(ValueError, match=field) as raised:
        PlacementSpec(**fields)
    assert fix in str(raised.value)


def test_spec_is_frozen_and_layout_is_a_value() -> None:
    spec = PlacementSpec(actor_num_gpus_per_node=2, rollout_num_gpus=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.colocate = True  # type: ignore[misc]
    assert compute_layout(spec) == Layout("separate", 4, 2, 2, 2, 0)
    assert compute_layout(spec).rollout_gpus == range(2, 4)
