"""The fused decode's Triton kernels against their pure-torch references (`_decode_ops.ReferenceOps`).

On a CUDA host the kernels are compiled and run on the GPU. Elsewhere they run in
Triton's interpreter on CPU tensors, which must be switched on before triton is
imported: tests/test_kernels_interpreted.py runs this file in a subprocess with
TRITON_INTERPRET=1 (here they skip). The interpreter is slow: shapes are tiny and
hypothesis draws few examples.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tandem.ppo.engines import EmbeddedEngine, EngineOptions, SamplingParams
from tandem.ppo.engines._decode_ops import ReferenceOps, philox_uniform

from ..._triton_interpreter import INTERPRETED, patch_interpreter_numerics
from .conftest import make_tiny_model, random_prompts, save_model

# On a GPU host these are `gpu` tests (the GPU suite runs `-m gpu`); elsewhere they run only in the
# interpreter's subprocess, which sees no GPU.
pytestmark = [
    pytest.mark.triton_kernels,
    pytest.mark.gpu
    if torch.cuda.is_available() and not INTERPRETED
    else pytest.mark.skipif(
        not INTERPRETED, reason="no GPU: run in Triton's interpreter by tests/test_kernels_interpreted.py"
    ),
]

REFERENCE = ReferenceOps()
DTYPES = [torch.float32, torch.bfloat16]
# No shrinking: in the interpreter it takes minutes; a failure reports the example as drawn.
FEW = settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.fixture(scope="module")
def kernels() -> Iterator[tuple[Any, torch.device]]:
    """(TritonOps, device): compiled on CUDA where there is a GPU, else interpreted on the CPU."""
    from tandem.ppo.engines._decode_kernels import TritonOps

    if torch.cuda.is_available() and not INTERPRETED:
        yield TritonOps(torch.device("cuda")), torch.device("cuda")
        return
    with pytest.MonkeyPatch.context() as patch:
        patch_interpreter_numerics(patch)
        yield TritonOps(torch.device("cpu")), torch.device("cpu")


def _assert_close(got: torch.Tensor, expected: torch.Tensor, *, max_mismatch: float = 0.02) -> None:
    """fp32: close to rounding noise. bf16: at most 1 unit in the last place apart, and equal but for
    a few elements (a rounding point left out would change a large share of them)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-5)
    assert (got != expected).float().mean().item() <= max_mismatch


@FEW
@given(
    rows=st.integers(1, 4),
    hidden=st.sampled_from([8, 40, 64]),
    dtype=st.sampled_from(DTYPES),
    add=st.booleans(),
)
def test_rms_norm_adds_the_residual_in_place_and_normalizes(
    kernels: tuple[Any, torch.device], rows: int, hidden: int, dtype: torch.dtype, add: bool
) -> None:
    ops, device = kernels
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device) if add else None
    residual = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype).to(device)
    expected_residual = residual.clone()
    expected = REFERENCE.rms_norm(x, expected_residual, weight, 1e-6)
    got = ops.rms_norm(x, residual, weight, 1e-6)
    _assert_close(got, expected)
    _assert_close(residual, expected_residual)


def _rope_term_sizes(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, starts: list[int], pos: int, rotated: int
) -> torch.Tensor:
    """`|x1 cos| + |x2 sin|` (and `|x2 cos| + |x1 sin|`) of each rotated element, `(rows, rotated heads, head_dim)`:
    the size of the two products whose sum the kernel rounds (the first `rotated` heads of `qkv`: q, then k)."""
    head_dim = cos.shape[-1]
    half = head_dim // 2
    x = qkv.reshape(qkv.shape[0], -1, head_dim)[:, :rotated]
    at = torch.tensor([max(pos - s, 0) for s in starts])
    c, si = cos[at][:, None], sin[at][:, None]
    x1, x2 = x[..., :half], x[..., half:]
    first = (x1 * c[..., :half]).abs() + (x2 * si[..., :half]).abs()
    second = (x2 * c[..., half:]).abs() + (x1 * si[..., half:]).abs()
    return torch.cat([first, second], dim=-1)


@st.composite
def _rows_and_positions(draw: st.DrawFn, length: int) -> tuple[list[int], int]:
    """Left paddings of 1-4 rows and a write position at or after the longest padding."""
    starts = draw(st.lists(st.integers(0, length // 2), min_size=1, max_size=4))
    return starts, draw(st.integers(max(starts), length - 1))


@FEW
@given(
    group=st.sampled_from([1, 2, 7]),
    kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 64]),
    dtype=st.sampled_from(DTYPES),
    rows_pos=_rows_and_positions(length=12),
)
def test_rope_rotates_q_and_k_and_writes_only_position_pos_of_the_cache(
    kernels: tuple[Any, torch.device],
    group: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    rows_pos: tuple[list[int], int],
) -> None:
    ops, device = kernels
    starts, pos = rows_pos
    rows, heads = len(starts), group * kv_heads
    g = torch.Generator().manual_seed(pos)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    angles = torch.arange(20)[:, None] * 0.3 ** torch.arange(head_dim // 2)[None, :]
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(device)
    start = torch.tensor(starts, device=device)
    position = torch.tensor([pos], device=device)
    # One spare cache row: rows past the step's must not be written either.
    cache = [torch.zeros(rows + 1, kv_heads, 12, head_dim, dtype=dtype, device=device) for _ in range(4)]
    kwargs = {"heads": heads, "kv_heads": kv_heads, "cos": cos, "sin": sin, "start": start, "pos": position}
    got = ops.rope_cache_write(qkv, **kwargs, keys=cache[0], values=cache[1])
    expected = REFERENCE.rope_cache_write(qkv, **kwargs, keys=cache[2], values=cache[3])
    if device.type == "cuda":
        # Compiled for the GPU, the kernel's sum of two rounded products may be formed from the
        # unrounded ones (the compiler drops the round trip through bf16): one rounding fewer. Where
        # the products nearly cancel, transformers' result is the less exact one, by up to half a
        # bf16 ulp of each product (2 ulps of the sum in one H200 case, 1 ulp on 13 of 448 elements
        # in another), so the bound is on the products' size.
        terms = _rope_term_sizes(
            qkv.float().cpu(), cos.float().cpu(), sin.float().cpu(), starts, pos, heads + kv_heads
        )
        for ours, theirs, size in ((got, expected, terms[:, :heads]), (cache[0], cache[2], terms[:, heads:])):
            if ours is cache[0]:
                ours, theirs = ours[:rows, :, pos], theirs[:rows, :, pos]
            error = (ours.float().cpu() - theirs.float().cpu()).abs()
            # Four half-ulps at most (three roundings of theirs, one of ours): 2^-7 of the size; twice that.
            assert (error <= 2**-6 * size + 1e-6).all(), float((error / (size + 1e-30)).max())
    else:
        _assert_close(got, expected)
        _assert_close(cache[0], cache[2])
    assert torch.equal(cache[1], cache[3])  # values are copied, not rounded
    written = torch.zeros(rows + 1, 1, 12, 1, dtype=torch.bool)
    written[:rows, :, pos] = True
    assert not cache[0].cpu().masked_fill(written, 0).any(), "only position pos of the step's rows"


@settings(FEW, max_examples=20)
@given(
    group=st.sampled_from([1, 2, 7]),
    kv_heads=st.sampled_from([1, 3]),
    dtype=st.sampled_from(DTYPES),
    splits=st.sampled_from([1, 2, 3]),
    rows_pos=_rows_and_positions(length=150),
)
def test_attention_reads_only_keys_from_start_to_pos(
    kernels: tuple[Any, torch.device],
    group: int,
    kv_heads: int,
    dtype: torch.dtype,
    splits: int,
    rows_pos: tuple[list[int], int],
) -> None:
    """Head dim 64 (Qwen2.5-0.5B's, SmolLM2's); splits that divide the keys and that do not."""
    ops, device = kernels
    starts, pos = rows_pos
    rows, heads, head_dim, length = len(starts), group * kv_heads, 64, 150
    g = torch.Generator().manual_seed(pos * 7 + splits)
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype).to(device)
    keys = torch.randn(rows + 1, kv_heads, length, head_dim, generator=g).to(dtype).to(device)
    values = torch.randn(rows + 1, kv_heads, length, head_dim, generator=g).to(dtype).to(device)
    start, position = torch.tensor(starts, device=device), torch.tensor([pos], device=device)
    expected = REFERENCE.attention(q, keys, values, start=start, pos=position, scale=0.125, splits=1)
    # Left pads, future positions and the spare row hold NaN: reading any of them shows.
    t = torch.arange(length, device=device)
    outside = (t[None, :] < start[:, None]) | (t[None, :] > pos)
    outside = torch.cat([outside, torch.ones(1, length, dtype=torch.bool, device=device)])[:, None, :, None]
    poisoned_keys, poisoned_values = (
        keys.masked_fill(outside, torch.nan),
        values.masked_fill(outside, torch.nan),
    )
    got = ops.attention(
        q, poisoned_keys, poisoned_values, start=start, pos=position, scale=0.125, splits=splits
    )
    assert got.shape == (rows, heads * head_dim) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the probabilities are rounded for P @ V
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_attention_splits_fill_the_device_and_stay_bounded(kernels: tuple[Any, torch.device]) -> None:
    ops = kernels[0]
    assert ops.attention_splits(256, 2) == 1
    assert 1 < ops.attention_splits(1, 1) <= 16
    assert ops.attention_splits(8, 2) >= ops.attention_splits(64, 2)


@FEW
@given(rows=st.integers(1, 3), inter=st.sampled_from([5, 64, 700]), dtype=st.sampled_from(DTYPES))
def test_silu_mul(kernels: tuple[Any, torch.device], rows: int, inter: int, dtype: torch.dtype) -> None:
    ops, device = kernels
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    gate_up = gate_up.to(device)
    _assert_close(ops.silu_mul(gate_up), REFERENCE.silu_mul(gate_up))


def test_philox_in_torch_is_triton_rand(kernels: tuple[Any, torch.device]) -> None:
    """The reference sampler's noise equals the kernel's bit for bit (both sample the same tokens)."""
    import triton
    import triton.language as tl

    device = kernels[1]

    @triton.jit
    def rand_kernel(seeds_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        idx = tl.arange(0, BLOCK)
        u = tl.rand(tl.load(seeds_ptr + row), idx)
        tl.store(out_ptr + row * n + idx, u, mask=idx < n)

    seeds = torch.tensor([0, 1, 2**40 + 5, 2**62 - 1], device=device)
    out = torch.empty(4, 100, device=device)
    rand_kernel[(4,)](seeds, out, 100, BLOCK=128)
    assert torch.equal(out.cpu(), philox_uniform(seeds.cpu()[:, None], torch.arange(100)[None, :]))


@FEW
@given(
    rows=st.integers(1, 3),
    vocab=st.sampled_from([7, 1024, 2500]),
    temperature=st.sampled_from([0.0, 0.6, 1.0, 1.7]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**62),
    programs=st.sampled_from([None, 1, 8, 64]),
)
def test_sampler_draws_the_references_tokens_with_their_log_probs(
    kernels: tuple[Any, torch.device],
    rows: int,
    vocab: int,
    temperature: float,
    dtype: torch.dtype,
    seed: int,
    programs: int | None,
) -> None:
    """One program a row (None, the default) or the vocabulary split over programs (down to one
    block a program): the same tokens."""
    device = kernels[1]
    ops = type(kernels[0])(device, sample_programs_per_processor=programs)
    logits = (3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))).to(dtype)
    logits = logits.to(device)
    args = {
        "temperature": torch.tensor([temperature], device=device),
        "seed": torch.tensor([seed], device=device),
    }
    tokens, log_probs = ops.sample(logits, **args)
    expected_tokens, _ = REFERENCE.sample(logits.cpu(), **{k: v.cpu() for k, v in args.items()})
    assert tokens.dtype == torch.int64 and log_probs.dtype == torch.float32
    assert tokens.cpu().tolist() == expected_tokens.tolist()
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    expected = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
    if temperature == 0:
        assert tokens.tolist() == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("programs", [None, 1, 64])
def test_greedy_takes_the_first_of_tied_maxima(
    kernels: tuple[Any, torch.device], programs: int | None
) -> None:
    device = kernels[1]
    ops = type(kernels[0])(device, sample_programs_per_processor=programs)
    logits = torch.zeros(3, 3000, device=device)
    # The kernel's block is 1024: one lane sees all three of row 0; split a block a program (64),
    # each of them is in a split of its own.
    logits[0, [5, 1029, 2053]] = 4.0
    logits[1, [976, 2000]] = 4.0
    logits[2, [1500, 2999]] = 4.0
    zero = {
        "temperature": torch.zeros(1, device=device),
        "seed": torch.zeros(1, dtype=torch.long, device=device),
    }
    if programs == 64:
        assert ops.sample_splits(3, 3000)[0] == 3
    assert ops.sample(logits, **zero)[0].tolist() == [5, 976, 1500]
    assert REFERENCE.sample(logits.cpu(), **{k: v.cpu() for k, v in zero.items()})[0].tolist() == [
        5,
        976,
        1500,
    ]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 512),
    vocab=st.integers(1, 300_000),
    programs=st.integers(1, 16),
    processors=st.sampled_from([8, 132]),
)
def test_the_samplers_splits_cover_the_vocabulary_once(
    kernels: tuple[Any, torch.device], rows: int, vocab: int, programs: int, processors: int
) -> None:
    from tandem.ppo.engines import _decode_kernels

    ops = type(kernels[0])(kernels[1], sample_programs_per_processor=programs)
    ops._processors = processors
    splits, span = ops.sample_splits(rows, vocab)
    block = _decode_kernels._SAMPLE_BLOCK
    assert span % block == 0 and 1 <= splits <= _decode_kernels._MAX_SAMPLE_SPLITS
    assert (splits - 1) * span < vocab <= splits * span  # no split empty, none left out
    # At least half the programs asked for, where the vocabulary's blocks and the cap allow (equal
    # spans of whole blocks: 9 blocks over 8 programs are 5 spans of 2).
    wanted = -(-programs * processors // rows)
    assert 2 * splits >= min(wanted, -(-vocab // block), _decode_kernels._MAX_SAMPLE_SPLITS)


def test_the_engine_on_the_kernels_generates_what_transformers_and_the_reference_do(
    kernels: tuple[Any, torch.device], tmp_path: Path
) -> None:
    """fp32: the fused decoder on the kernels (in CUDA graphs on a GPU) against transformers' decode."""
    device = kernels[1]
    folder = save_model(make_tiny_model("llama", attention_bias=True), tmp_path / "llama")
    options = {"device": device.type, "dtype": "float32"}
    on_kernels = EmbeddedEngine(folder, EngineOptions(**options), decode_ops="triton")
    prompts = random_prompts(6, seed=40, min_len=1, max_len=10)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    got = on_kernels.generate(prompts, greedy)
    expected = EmbeddedEngine(folder, EngineOptions(**options, fused_decode=False)).generate(prompts, greedy)
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    for a, b in zip(got, expected, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-4)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    reference = EmbeddedEngine(folder, EngineOptions(**options), decode_ops="reference")
    assert [g.token_ids for g in on_kernels.generate(prompts, sampled)] == [
        g.token_ids for g in reference.generate(prompts, sampled)
    ]
