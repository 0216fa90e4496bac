"""Our fused RoPE (`tandem.megatron.models.rope`) against Megatron's unfused RoPE, and the model wiring.

- `rope_sbhd` and the THD hook, eager, against Megatron's `_apply_rotary_pos_emb_bshd` /
  `_apply_rotary_pos_emb_thd` on random shapes (hypothesis): values and gradients.
  Same operations in the same order, so they agree exactly, fp32 and bf16 alike.
- What ours leave to Megatron (interleaved rotary, context parallelism) is Megatron's.
- `install()` makes `apply_rope_fusion=True` constructible; a tiny actor built with
  `fused_rope=True` (compiled: ~20 s of inductor on a 2-core CPU) computes what one with
  `fused_rope=False` does, padded and packed, gradients too, without recompiling for
  other lengths (`_scripts/rope_check.py`, in its own process).
- Past dynamo's recompile limit (lowered in `_scripts/rope_recompile_check.py`): many
  kinds of call never fail, each kind compiles once, and a kind that exhausts its budget
  runs eagerly with one warning; on the CPU and on CUDA.
- On a GPU: the hooks (there the Triton kernel, `_rope_kernels`) in bf16 against Megatron's
  unfused path (bit for bit),
  and the model check above on CUDA.

Megatron's RoPE comes from megatron-core (a ~10 s import), hence `slow` on those tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models import rope

SCRIPTS = Path(__file__).parent / "_scripts"
MAX_SEQLEN = 40


def _one_cp_rank(size: int = 1, rank: int = 0) -> Any:
    """What Megatron's THD RoPE asks of a context-parallel group."""
    return SimpleNamespace(size=lambda: size, rank=lambda: rank)


@pytest.fixture(scope="module")
def rope_utils() -> ModuleType:
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


def _freqs(seq: int, rot_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Megatron's layout: `cat((f, f))` of per-position angles, `(seq, 1, 1, rot_dim)` fp32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    # A random offset per channel so that no test leans on position 0's identity rotation.
    angles = angles + torch.rand(rot_dim // 2, generator=gen)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _values_and_grad(fn: Any, t: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(t, *args)` and the gradient w.r.t. `t` of a fixed random projection of it."""
    t = t.detach().clone().requires_grad_()
    out = fn(t, *args)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device)
    (out.float() * weights).sum().backward()
    assert t.grad is not None
    return out.detach(), t.grad


@contextmanager
def _eager_hooks() -> Iterator[None]:
    """The hooks with the eager functions in place of the compiled ones (no compile in pytest's process)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rope, "_compiled", lambda fn: fn)
        yield


DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def _head_shapes(draw: st.DrawFn) -> tuple[int, int]:
    """(d, rot_dim): even sizes, rot_dim <= d (partial rotary when smaller)."""
    d = 2 * draw(st.integers(1, 16))
    rot_dim = 2 * draw(st.integers(1, d // 2))
    return d, rot_dim


# --- without Megatron ------------------------------------------------------------------


def test_rope_sbhd_rotates_each_channel_pair_by_its_angle() -> None:
    # An independent reference: channel i and i + rot_dim/2 are the real and imaginary
    # parts of a complex number turned by angle freqs[i] (Megatron's freqs repeat the
    # angles, so both halves hold the same one); channels past rot_dim pass through.
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 10, generator=gen, dtype=torch.float64)
    freqs = _freqs(6, 8, gen).double()
    half, angles = 4, freqs[..., :4]
    z = torch.complex(t[..., :half], t[..., half:8]) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat((z.real, z.imag, t[..., 8:]), dim=-1)
    torch.testing.assert_close(rope.rope_sbhd(t, freqs), expected, rtol=1e-12, atol=1e-12)


def test_rope_thd_restarts_positions_at_every_sample() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 0, 5, 1]  # an empty sample does not shift the next one
    cu_seqlens = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    t = torch.randn(9, 2, 6, generator=gen)
    freqs = _freqs(MAX_SEQLEN, 6, gen)
    expected = torch.cat(
        [rope.rope_sbhd(part.unsqueeze(1), freqs[: len(part)]).squeeze(1) for part in t.split(lengths)]
    )
    torch.testing.assert_close(rope.rope_thd(t, cu_seqlens, freqs), expected, rtol=0, atol=0)


def test_build_model_refuses_a_non_boolean_fused_rope_and_apply_rope_fusion() -> None:
    from tandem.megatron.models import build_model

    spec: Any = None  # never reached: the arguments are checked first
    with pytest.raises(ValueError, match="fused_rope"):
        build_model(spec, "actor", fused_rope="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fused_rope=True/False, not apply_rope_fusion"):
        build_model(spec, "actor", apply_rope_fusion=True)


def test_worker_config_leaves_fused_rope_to_the_device_by_default() -> None:
    import dataclasses

    from tandem.megatron.config import WorkerConfig

    field = {f.name: f for f in dataclasses.fields(WorkerConfig)}["fused_rope"]
    assert field.default is None


# --- eager against Megatron's unfused functions --------------------------------------------


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(1, 12),
    b=st.integers(1, 3),
    heads=st.integers(1, 4),
    head=_head_shapes(),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_rope_sbhd_equals_megatron(
    rope_utils: ModuleType, s: int, b: int, heads: int, head: tuple[int, int], dtype: torch.dtype, seed: int
) -> None:
    d, rot_dim = head
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(s, b, heads, d, generator=gen).to(dtype)
    freqs = _freqs(s, rot_dim, gen)
    ours = _values_and_grad(rope.rope_sbhd, t, freqs)
    megatron = _values_and_grad(rope_utils._apply_rotary_pos_emb_bshd, t, freqs)
    # The same bf16 roundings in the same order (cos and sin cast to t's dtype first): exact.
    torch.testing.assert_close(ours, megatron, rtol=0, atol=0)


@st.composite
def _segments(draw: st.DrawFn) -> list[int]:
    return draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    lengths=_segments(),
    spare_rows=st.integers(0, 3),
    whole_row=st.booleans(),
    heads=st.integers(1, 4),
    head=_head_shapes(),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_thd_hook_equals_megatron(
    rope_utils: ModuleType,
    lengths: list[int],
    spare_rows: int,
    whole_row: bool,
    heads: int,
    head: tuple[int, int],
    dtype: torch.dtype,
    seed: int,
) -> None:
    d, rot_dim = head
    gen = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(sum(lengths), heads, d, generator=gen).to(dtype)
    # Megatron's two cases: `freqs` of the longest sample or more (positions restart at 0 in
    # every sample), or one row per packed token (positions run on over the row).
    freqs = _freqs(sum(lengths) if whole_row else max(lengths) + spare_rows, rot_dim, gen)
    with _eager_hooks():
        ours = _values_and_grad(rope.fused_apply_rotary_pos_emb_thd, t, cu_seqlens, freqs)

    def megatron(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_one_cp_rank())

    torch.testing.assert_close(ours, _values_and_grad(megatron, t, cu_seqlens, freqs), rtol=0, atol=0)


@pytest.mark.slow
def test_thd_freqs_of_the_whole_row_are_indexed_by_place_in_the_row(rope_utils: ModuleType) -> None:
    gen = torch.Generator().manual_seed(2)
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    t = torch.randn(9, 3, 8, generator=gen)
    freqs = _freqs(9, 8, gen)
    expected = rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_one_cp_rank())
    with _eager_hooks():
        assert torch.equal(rope.fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs), expected)
    # The per-sample positions would differ: the case matters.
    assert (rope.rope_thd(t, cu_seqlens, freqs) - expected).abs().max() > 0.1


@pytest.mark.slow
def test_interleaved_and_context_parallel_fall_back_to_megatron(rope_utils: ModuleType) -> None:
    gen = torch.Generator().manual_seed(4)
    t = torch.randn(7, 2, 3, 8, generator=gen)
    freqs = _freqs(7, 8, gen)
    expected = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    assert torch.equal(rope.fused_apply_rotary_pos_emb(t, freqs, interleaved=True), expected)
    assert not torch.equal(rope.rope_sbhd(t, freqs), expected)

    # Under context parallelism each rank holds 1/cp_size of every sample's tokens (two
    # chunks of each, for causal load balance) while cu_seqlens count whole samples.
    for interleaved, cp_size, cp_rank, bounds in ((True, 1, 0, [0, 4, 10]), (False, 2, 1, [0, 8, 20])):
        local = torch.randn(10, 3, 8, generator=gen)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        expected = rope_utils._apply_rotary_pos_emb_thd(
            local,
            cu_seqlens,
            _freqs(16, 8, torch.Generator().manual_seed(5)),
            rotary_interleaved=interleaved,
            cp_group=_one_cp_rank(cp_size, cp_rank),
        )
        ours = rope.fused_apply_rotary_pos_emb_thd(
            local,
            cu_seqlens,
            _freqs(16, 8, torch.Generator().manual_seed(5)),
            cp_size=cp_size,
            cp_rank=cp_rank,
            interleaved=interleaved,
        )
        assert torch.equal(ours, expected)


@pytest.mark.slow
def test_install_makes_apply_rope_fusion_constructible(
    rope_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron.core.transformer import TransformerConfig

    # Without Transformer Engine (as here and on our GPU hosts) the hooks are None.
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    fields: dict[str, Any] = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(**fields, apply_rope_fusion=True)
    assert not rope.installed()
    rope.install()
    rope.install()  # idempotent
    assert rope.installed()
    assert rope_utils.fused_apply_rotary_pos_emb is rope.fused_apply_rotary_pos_emb
    assert rope_utils.fused_apply_rotary_pos_emb_thd is rope.fused_apply_rotary_pos_emb_thd
    assert TransformerConfig(**fields, apply_rope_fusion=True).apply_rope_fusion


# --- a model with fused RoPE against one without (CPU, compiled) ---------------------------


def _model_with_and_without_fused_rope(r: dict[Any, Any]) -> None:
    """Check what `_scripts/rope_check.py` saved (`model_checks`: CUDA where torch sees a GPU, else CPU)."""
    assert r["apply_rope_fusion:True"] and not r["apply_rope_fusion:False"] and r["installed"]
    # Per forward, two hooks (q and k) in each of the 2 layers: padded rows went through the
    # sbhd hook (4 forwards), packed rows through the THD hook (4 forwards).
    assert r["calls"] == {"fused_apply_rotary_pos_emb": 16, "fused_apply_rotary_pos_emb_thd": 16}
    # The later inputs ran under error_on_recompile: reaching here means no recompilation.
    for phase in ("first", "later"):
        unfused, fused = r[False][phase], r[True][phase]
        assert unfused.keys() == fused.keys() and len(unfused) > 20
        for name, expected in unfused.items():
            # Compiled fp32 kernels contract multiply-adds: not bit-exact, close to fp32 rounding.
            error = (fused[name] - expected).abs().max().item()
            assert error <= 1e-4 * expected.abs().max().item() + 1e-7, (phase, name, error)
    # The control: without RoPE the logits move far more than that.
    expected = r[False]["first"]["sbhd_no_grad:logits"]
    assert (r["no_rope:logits"] - expected).abs().max().item() > 1e-3 * expected.abs().max().item()


@pytest.mark.slow
def test_a_model_with_fused_rope_computes_what_megatrons_unfused_rope_does(
    model_checks: dict[Any, Any],
) -> None:
    _model_with_and_without_fused_rope(model_checks)


@pytest.mark.gpu
def test_a_model_with_fused_rope_on_cuda(model_checks: dict[Any, Any]) -> None:
    """The same with the model on CUDA, where the fused hooks run the Triton kernel (`rope.KERNELS`)."""
    _model_with_and_without_fused_rope(model_checks)


# --- past dynamo's recompile limit ------------------------------------------------------------


def _past_the_recompile_limit(tmp_path: Path, device: str) -> None:
    """Run `_scripts/rope_recompile_check.py` on `device` and check what it found."""
    out = tmp_path / "recompile.json"
    command = [sys.executable, str(SCRIPTS / "rope_recompile_check.py"), str(out), device]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    # The control: one compiled function for all of these calls fails at the limit.
    assert r["plain_failed"] == "FailOnRecompileLimitHit"
    # Ours: every call answered, as eager does; one kernel per kind, none per size.
    assert r["agree"]
    assert r["rotate_kernels"] == r["kinds"] > 2  # more kinds than the lowered limit of 2
    assert r["eager_kinds_after_many_kinds"] == 0 and r["warnings_after_many_kinds"] == []
    # A kind that exhausts its own budget falls back to eager: the same results, one warning.
    assert r["agree_fallback"] and r["fallback_eager_kinds"] == 1
    (warning,) = r["fallback_warnings"]
    assert "recompile limit (1)" in warning and "run eagerly" in warning and f"{device} float32" in warning


@pytest.mark.slow
def test_the_compiled_hooks_never_fail_at_the_recompile_limit(tmp_path: Path) -> None:
    _past_the_recompile_limit(tmp_path, "cpu")


@pytest.mark.gpu
def test_the_compiled_hooks_never_fail_at_the_recompile_limit_on_cuda(tmp_path: Path) -> None:
    _past_the_recompile_limit(tmp_path, "cuda")


# --- compiled on a GPU, bf16 ---------------------------------------------------------------


@pytest.mark.gpu
def test_the_hooks_in_bf16_on_cuda_match_megatron(rope_utils: ModuleType) -> None:
    """The sbhd and THD hooks on CUDA (the Triton kernel) against Megatron's unfused functions, values
    and gradients.

    The kernel rounds each bf16 product as eager does, with no fused multiply-add, so the
    results are Megatron's to the bit; shapes of the 1.2 B probe, partial rotary, GQA.
    """
    gen = torch.Generator().manual_seed(6)
    cuda = torch.device("cuda")

    def check(ours: tuple[torch.Tensor, ...], megatron: tuple[torch.Tensor, ...]) -> None:
        for a, b in zip(ours, megatron, strict=True):
            assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
            assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()

    for s, b, heads, d, rot_dim in ((2048, 4, 16, 128, 128), (300, 3, 8, 128, 64), (97, 1, 2, 64, 64)):
        t = torch.randn(s, b, heads, d, generator=gen).to(cuda, torch.bfloat16)
        freqs = _freqs(s, rot_dim, gen).to(cuda)
        check(
            _values_and_grad(rope.fused_apply_rotary_pos_emb, t, freqs),
            _values_and_grad(rope_utils._apply_rotary_pos_emb_bshd, t, freqs),
        )

    def megatron_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_one_cp_rank())

    for lengths, heads in (([700, 13, 260, 1], 16), ([5, 511], 8), ([1024], 16)):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=cuda)
        t = torch.randn(sum(lengths), heads, 128, generator=gen).to(cuda, torch.bfloat16)
        freqs = _freqs(max(lengths), 128, gen).to(cuda)
        check(
            _values_and_grad(rope.fused_apply_rotary_pos_emb_thd, t, cu, freqs),
            _values_and_grad(megatron_thd, t, cu, freqs),
        )


@pytest.mark.parametrize("on_cuda", [False, True])
@pytest.mark.parametrize("fused_rope", [None, False, True])
def test_fused_rope_by_default_on_cuda_at_every_size(fused_rope: bool | None, on_cuda: bool) -> None:
    """Auto: on CUDA, where our RoPE is one Triton kernel a call (faster than Megatron's eager RoPE at
    hidden size 896 and than the compiled functions on packed rows, docs/benchmarks.md); an explicit
    choice always wins; never on CPU by default."""
    from tandem.megatron.models.networks import uses_fused_rope

    chosen = uses_fused_rope(fused_rope, on_cuda=on_cuda)
    assert chosen is (fused_rope if fused_rope is not None else on_cuda)
