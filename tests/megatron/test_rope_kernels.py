"""The Triton RoPE kernel (`models._rope_kernels`) against the eager rotation `rope.rope_rotate`.

The kernel tests (`kernel_test`) run on CUDA on a GPU; without one, tests/test_kernels_interpreted.py
runs them in a subprocess under Triton's interpreter, its bf16 casts made the GPU's.

- Drawn shapes (hypothesis): rows strided over the heads (q and k are views of the fused
  QKV projection), partial rotary, packed rows with each token's position in its sample:
  values and gradients in bf16 equal eager's bit for bit (each product rounded before the
  sum, as eager rounds), fp32 alike (no fused multiply-add).
- The hooks route here on CUDA (`rope.KERNELS`), and to the compiled functions when told.
- The cos/sin table and a packed row's positions are computed once per angles tensor and
  `cu_seqlens`, and again when either changes in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models import rope

from .._triton_interpreter import DEVICE, INTERPRETED, ON_GPU, kernel_test, patch_interpreter_numerics


@pytest.fixture(autouse=True)
def _gpu_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETED:
        patch_interpreter_numerics(monkeypatch)


def _freqs(seq: int, rot_dim: int, seed: int) -> torch.Tensor:
    """Megatron's layout, `cat((f, f))`, `(seq, 1, 1, rot_dim)` fp32, with a random offset a channel."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq) + torch.rand(
        rot_dim // 2, generator=gen
    )
    return torch.cat((angles, angles), dim=-1)[:, None, None, :].to(DEVICE)


def _eager(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    cos, sin = rope.rope_cos_sin(freqs, t.dtype)
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    return rope.rope_rotate(t, cos, sin)


def _kernel(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    from tandem.megatron.models import _rope_kernels

    return _rope_kernels.rotate(t, *_rope_kernels.rope_table(freqs, t.dtype), positions)


def _values_and_grad(
    fn: Callable[..., torch.Tensor], base: torch.Tensor, heads_step: int, *args: Any
) -> tuple[torch.Tensor, ...]:
    leaf = base.detach().clone().requires_grad_()
    t = leaf[:, :, ::heads_step]  # strided over the heads, as q and k are views of the QKV projection
    out = fn(t, *args)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, out.dtype)
    out.backward(upstream)
    assert leaf.grad is not None
    return out.detach(), leaf.grad


def _assert_same(ours: tuple[torch.Tensor, ...], eager: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    for a, b in zip(ours, eager, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


@kernel_test
@settings(max_examples=40, deadline=None)
@given(
    seq=st.integers(1, 20),
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    heads_step=st.integers(1, 3),
    half_d=st.integers(1, 24),
    data=st.data(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_rotates_as_eager_does(
    seq: int,
    batch: int,
    heads: int,
    heads_step: int,
    half_d: int,
    data: st.DataObject,
    dtype: torch.dtype,
    seed: int,
) -> None:
    rot_dim = 2 * data.draw(st.integers(1, half_d), label="rot_dim / 2")  # partial rotary when below d
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(seq, batch, heads * heads_step, 2 * half_d, generator=gen).to(DEVICE, dtype)
    freqs = _freqs(seq, rot_dim, seed)
    _assert_same(
        _values_and_grad(_kernel, base, heads_step, freqs, None),
        _values_and_grad(_eager, base, heads_step, freqs, None),
        dtype,
    )


@kernel_test
@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    heads=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_a_packed_row_restarts_positions_at_every_sample(
    lengths: list[int], heads: int, dtype: torch.dtype, seed: int
) -> None:
    from tandem.megatron.models import _rope_kernels

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    positions = _rope_kernels.packed_positions(cu, sum(lengths))
    assert positions.tolist() == [p for n in lengths for p in range(n)]
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(sum(lengths), 1, heads, 16, generator=gen).to(DEVICE, dtype)
    freqs = _freqs(max(lengths), 16, seed)
    _assert_same(
        _values_and_grad(_kernel, base, 1, freqs, positions),
        _values_and_grad(_eager, base, 1, freqs, positions),
        dtype,
    )


@kernel_test
def test_the_hooks_run_the_kernel_unless_told_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.megatron.models import _rope_kernels

    calls: list[bool] = []
    rotate = _rope_kernels.rotate
    monkeypatch.setattr(_rope_kernels, "rotate", lambda *a: calls.append(True) or rotate(*a))
    monkeypatch.setattr(rope, "_compiled", lambda fn: fn)  # the compiled path, eagerly: no inductor here
    if not ON_GPU:
        monkeypatch.setattr(rope, "KERNELS", "triton")
    t = torch.randn(6, 2, 3, 8).to(DEVICE, torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    freqs = _freqs(6, 8, 0)
    sbhd = rope.fused_apply_rotary_pos_emb(t, freqs)
    thd = rope.fused_apply_rotary_pos_emb_thd(t[:, 0], cu, freqs[:4])
    assert len(calls) == 2
    monkeypatch.setattr(rope, "KERNELS", "compiled")
    assert torch.equal(rope.fused_apply_rotary_pos_emb(t, freqs), sbhd)
    assert torch.equal(rope.fused_apply_rotary_pos_emb_thd(t[:, 0], cu, freqs[:4]), thd)
    assert len(calls) == 2


@kernel_test
def test_the_table_and_positions_are_kept_until_their_source_changes() -> None:
    from tandem.megatron.models import _rope_kernels

    freqs = _freqs(5, 8, 0)
    table = _rope_kernels.rope_table(freqs, torch.bfloat16)
    assert _rope_kernels.rope_table(freqs, torch.bfloat16) is table
    assert _rope_kernels.rope_table(freqs, torch.float32)[0].dtype == torch.float32  # another dtype
    assert _rope_kernels.rope_table(freqs.clone(), torch.bfloat16) is not table  # another tensor
    table = _rope_kernels.rope_table(freqs, torch.bfloat16)
    freqs.mul_(2)  # the same tensor, changed in place: computed again
    again = _rope_kernels.rope_table(freqs, torch.bfloat16)
    assert again is not table and torch.equal(again[0], torch.cos(freqs[:, 0, 0]).to(torch.bfloat16))

    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    positions = _rope_kernels.packed_positions(cu, 5)
    assert _rope_kernels.packed_positions(cu, 5) is positions
    cu[1] = 3
    assert _rope_kernels.packed_positions(cu, 5).tolist() == [0, 1, 2, 0, 1]


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU")
@pytest.mark.parametrize("backward", [False, True])
def test_the_kernel_compiles_without_fused_multiply_adds(backward: bool) -> None:
    """For an H100 (sm_90, no GPU needed): with `COMPILE_OPTIONS` the PTX rounds each bf16 product and
    sum on its own (`mul.rn.bf16`, `sub.rn.bf16`); the control, the compiler's default, fuses them into
    `fma.rn.bf16`, which rounds once where eager rounds twice."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem.megatron.models import _rope_kernels

    ints = [
        "rows",
        "batch",
        "heads",
        *(f"{x}_stride_{d}" for x in ("t", "out") for d in "sbh"),
        "table_stride",
        "half",
        "rest",
    ]
    pointers = {name: "*bf16" for name in ("t_ptr", "out_ptr", "cos_ptr", "sin_ptr", "pos_ptr")}
    constants = {"BLOCK_ROWS": 64, "BLOCK_HALF": 32, "BLOCK_PASS": 1, "HAS_PASS": False}
    constants |= {"HAS_POSITIONS": False, "BACKWARD": backward}
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constants, "constexpr")}

    def ptx(options: dict[str, Any]) -> str:
        source = ASTSource(fn=_rope_kernels._rope_rows_kernel, signature=signature, constexprs=constants)
        return str(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])

    ours = ptx(_rope_kernels.COMPILE_OPTIONS)
    assert "fma" not in ours and "mul.rn.bf16" in ours
    assert "fma.rn.bf16" in ptx({}), "the control: the default fuses the product into its sum"
