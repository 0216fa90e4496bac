"""Routing critic payloads to actor ranks when actor and critic have the same topology."""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Set

from tandem.value_transfer import _arguments as arguments


def route_per_rank[P](external_data: Sequence[P | None] | P | None, world_size: int) -> list[P | None]:
    """Give each of `world_size` actor ranks its payload (what the driver passes to rank i's call).

    - a list (or tuple, or an iterator such as a generator, read once): one
      payload per rank, in rank order (`None` for a rank without values, e.g. not
      on the pipeline-last stage);
    - a single payload (not a list, tuple or iterator): the same payload to every rank;
    - `None`: nothing is sent; every rank gets `None`, so a call that passes
      `external_data=route_per_rank(None, n)[i]` keeps its old meaning.

    Raises:
        ValueError: the list's length is not `world_size`, or `world_size < 1`.
        TypeError: `world_size` is not an int, or `external_data` is a set (it has no rank order).
    """
    world_size = arguments.index("world_size", world_size, minimum=1)
    if external_data is None:
        return [None] * world_size
    if isinstance(external_data, Set):
        raise TypeError(
            f"external_data is a {arguments.type_name(external_data)}, which has no order; "
            "give a list with one payload per actor rank, in rank order"
        )
    if isinstance(external_data, Iterator):
        external_data = list(external_data)  # a generator of payloads is the list it yields
    if isinstance(external_data, list | tuple):
        if len(external_data) != world_size:
            raise ValueError(
                f"external_data has {len(external_data)} payloads but world_size is {world_size}; "
                "give one payload per actor rank (None where a rank gets none) or a single payload"
            )
        return list(external_data)
    single: P = external_data  # type: ignore[assignment]
    return [single] * world_size


def values_for_rank[P](payload: P | None, *, rank: int, is_pipeline_last_stage: bool) -> P | None:
    """The topology contract, checked on actor rank `rank`: the payload this rank must use, or None.

    Actor and critic have identical topology (TP, PP, DP sizes and rank order), so
    critic rank r's payload goes to actor rank r (`route_per_rank`), and only
    pipeline-last-stage ranks, where the loss and GAE run, use values:

    - on a pipeline-last-stage rank, returns the payload; a missing one is a bug in
      the routing and raises ValueError naming the rank;
    - on any other stage, returns None: a payload sent there is ignored.

    Call it only in runs that use critic values (with a critic and GAE).
    """
    arguments.index("rank", rank)
    if not arguments.flag("is_pipeline_last_stage", is_pipeline_last_stage):
        return None
    if payload is None:
        raise ValueError(
            f"payload is None: actor rank {rank} is on the pipeline-last stage but got no critic values; with "
            f"identical topology critic rank {rank} (also last stage) must return its values and the "
            "driver must pass route_per_rank(critic_payloads, world_size)[rank] to this rank"
        )
    return payload
