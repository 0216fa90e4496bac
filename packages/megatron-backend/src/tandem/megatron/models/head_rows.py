"""The actor's output layer at chosen positions only: those that predict a response token.

A PPO update needs the actor's logits only where a response token is predicted,
yet `GPTModel` runs its vocabulary head over every position of the micro-batch:
the prompts, and the padding of the padded layout. The head costs
`2 · hidden · vocabulary` FLOPs a token each way (272 MFLOP for Qwen2.5-0.5B's
152k vocabulary, against 720 MFLOP for its decoder layers), and its logits are
the largest activation of the step. `HeadRows` hooks the output layer so that,
within `only(rows)`, the layer sees only the chosen rows of the final hidden
states: the model then returns logits `(1, len(rows), vocab / tp)` whose rows
are those positions in the order given, with the same values the full head
gives there, and a backward that reaches the decoder only through them.

Outside `only`, the model is untouched (exports, parity checks and every other
caller get the full logits). Megatron's sequence parallelism would hand the
layer a shard of the sequence; the worker never turns it on
(`hf_config.ModelSpec.transformer_config`), and `only` refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class HeadRows:
    """Picks the rows of the final hidden states `[s, b, h]` that the output layer computes, per forward.

    `rows` are flat indices into the hidden states' positions in Megatron's
    layout, `position * b + row` (`ResponseIndex.hidden_rows` gives them).
    """

    def __init__(self, output_layer: nn.Module) -> None:
        self._layer = output_layer
        self._rows: torch.Tensor | None = None
        output_layer.register_forward_pre_hook(self._pick, with_kwargs=True)

    @contextlib.contextmanager
    def only(self, rows: torch.Tensor) -> Iterator[None]:
        """Within: the next forward of the output layer computes only `rows` (a 1-D index tensor)."""
        if getattr(self._layer, "sequence_parallel", False):
            raise ValueError(
                "the actor's head at response positions needs sequence_parallel=False: under sequence "
                "parallelism each tensor-parallel rank holds a shard of the positions"
            )
        if rows.dim() != 1:
            raise ValueError(f"HeadRows.only: rows must be a 1-D index tensor, got shape {tuple(rows.shape)}")
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def _pick(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        rows, self._rows = self._rows, None  # one forward of the layer per `only`
        if rows is None:
            return None
        hidden = args[0]
        # [s, b, h] -> the chosen positions as [n, 1, h], the layout the layer expects.
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows).unsqueeze(1)
        return (picked, *args[1:]), kwargs


def head_rows(model: Any) -> HeadRows | None:
    """The `HeadRows` of an actor's last pipeline stage (`networks.build_model` installs it), else None."""
    found = getattr(model, "tandem_head_rows", None)
    return found if isinstance(found, HeadRows) else None
