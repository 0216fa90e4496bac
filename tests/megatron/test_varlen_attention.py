"""`varlen_packed_attention`: one varlen call over a packed row gives the per-sample causal attention.

On the CPU the call goes to a stand-in with `varlen_attn`'s calling convention
(torch 2.11's, without `enable_gqa`, and 2.12's, with it) that computes each block's
causal attention by the definition; it checks what the wrapper hands it (int32
boundaries, the causal window, the longest block). On a GPU the real kernel runs
against the blocks' path of `models/attention.py`, values and gradients.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models.attention import (
    VARLEN_MAX_HEAD_DIM,
    check_varlen,
    resolve_packed_attention,
    varlen_function,
    varlen_packed_attention,
)


def _by_definition(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    """Each block's causal softmax attention, written out (query `[t, heads, d]`, key/value `[t, heads, d]`)."""
    out = []
    for a, b in pairwise(bounds):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))  # [heads, n, d]
        scores = q @ k.transpose(1, 2) * scale
        n = b - a
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        out.append((scores.masked_fill(future, -math.inf).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out)


def _stand_in(with_gqa: bool) -> Any:
    seen: dict[str, Any] = {}

    def check(
        cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, window: tuple[int, int]
    ) -> None:
        assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert max_q == max_k == max(b - a for a, b in pairwise(cu_q.tolist()))
        assert window == (-1, 0)  # flash attention's causal window

    def varlen_211(
        query, key, value, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):  # type: ignore[no-untyped-def]
        check(cu_q, cu_k, max_q, max_k, window_size)
        assert key.shape[1] == query.shape[1], "2.11 has no enable_gqa: heads must match"
        seen["calls"] = seen.get("calls", 0) + 1
        return _by_definition(query, key, value, cu_q.tolist(), scale)

    def varlen_212(
        query,
        key,
        value,
        cu_q,
        cu_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
    ):  # type: ignore[no-untyped-def]
        check(cu_q, cu_k, max_q, max_k, window_size)
        groups = query.shape[1] // key.shape[1]
        assert enable_gqa == (groups > 1)
        seen["calls"] = seen.get("calls", 0) + 1
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        return _by_definition(query, key, value, cu_q.tolist(), scale)

    return (varlen_212 if with_gqa else varlen_211), seen


def _blocks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    """The blocks' path of `models/attention.py`: one causal SDPA call per sample."""
    out = []
    for a, b in pairwise(bounds):
        q, k, v = (t[a:b].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        out.append(o[0].permute(1, 0, 2))
    return torch.cat(out)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    with_gqa=st.booleans(),
)
def test_one_call_gives_each_samples_causal_attention(
    lengths: list[int], kv_heads: int, groups: int, with_gqa: bool
) -> None:
    g = torch.Generator().manual_seed(sum(lengths) * 7 + kv_heads)
    t, d = sum(lengths), 8
    query = torch.randn(t, kv_heads * groups, d, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(t, kv_heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(t, kv_heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int64)  # any integer tensor: the wrapper hands int32 on
    fn, seen = _stand_in(with_gqa)
    scale = 0.3

    out = varlen_packed_attention(query, key, value, cu, max(lengths), scale=scale, fn=fn)
    expected = _blocks(query, key, value, bounds, scale)
    assert seen["calls"] == 1
    torch.testing.assert_close(out, expected)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_uneven_head_groups_and_hosts_that_cannot_run_it_are_refused() -> None:
    fn, _ = _stand_in(with_gqa=False)
    with pytest.raises(ValueError, match="5 query heads over 2"):
        varlen_packed_attention(
            torch.zeros(3, 5, 4),
            torch.zeros(3, 2, 4),
            torch.zeros(3, 2, 4),
            torch.tensor([0, 3]),
            3,
            scale=None,
            fn=fn,
        )
    with pytest.raises(ValueError, match=r"packed_attention='varlen': the model is on cpu.*'blocks'"):
        check_varlen(torch.device("cpu"), torch.bfloat16, 64)
    with pytest.raises(ValueError, match=r"params_dtype is torch.float32.*'blocks'"):
        check_varlen(torch.device("cuda", 0), torch.float32, 64)
    with pytest.raises(ValueError, match=r"heads are 512 wide.*at most 256.*'blocks'"):
        check_varlen(torch.device("cuda", 0), torch.bfloat16, 512)


@given(
    device=st.sampled_from(["cpu", "cuda"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_dim=st.sampled_from([64, 128, 256, 512]),
    available=st.booleans(),
)
def test_auto_is_varlen_exactly_where_varlen_can_run(
    device: str, dtype: torch.dtype, head_dim: int, available: bool
) -> None:
    runs = device == "cuda" and dtype != torch.float32 and head_dim <= VARLEN_MAX_HEAD_DIM and available
    on = torch.device(device)
    assert resolve_packed_attention("auto", on, dtype, head_dim, available=available) == (
        "varlen" if runs else "blocks"
    )
    for given_choice in ("blocks", "varlen"):  # a choice given stands (check_varlen refuses what cannot run)
        assert (
            resolve_packed_attention(given_choice, on, dtype, head_dim, available=available) == given_choice
        )


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 7])  # Qwen2.5-0.5B: 14 query heads over 2 key/value heads
def test_the_real_kernel_gives_the_blocks_attention_and_gradients(groups: int) -> None:
    fn = varlen_function()
    if fn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    check_varlen(torch.device("cuda"), torch.bfloat16, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [130, 1, 517, 64, 283, 7]
    t, kv_heads, d = sum(lengths), 2, 64
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    # Views of one fused projection, as Megatron's attention splits its mixed query/key/value: strided
    # in the heads, contiguous in the head dimension.
    heads = kv_heads * groups
    mixed = torch.randn(t, heads + 2 * kv_heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
    mixed.requires_grad_()
    query, key, value = mixed.split([heads, kv_heads, kv_heads], dim=1)
    assert not query.is_contiguous()
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    out = varlen_packed_attention(query, key, value, cu, max(lengths), scale=scale)
    expected = _blocks(query, key, value, bounds, scale)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    weights = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    (grad,) = torch.autograd.grad((out * weights).sum(), mixed)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), mixed)
    assert expected_grad.abs().max() > 0
    torch.testing.assert_close(grad, expected_grad, rtol=5e-2, atol=5e-2)
