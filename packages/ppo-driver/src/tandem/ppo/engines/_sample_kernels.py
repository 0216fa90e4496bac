"""The fused decode step's sampler as Triton kernels (`TritonOps.sample` launches them).

By default (`TritonOps(sample_programs_per_processor=8)`) each row's vocabulary is split over
programs; with `sample_programs_per_processor=None`, one program a row (`sample_row_kernel`). The
split: `sample_split_kernel` gives each split's best Gumbel key, that key's first index and
the split's log-sum-exp (as its max and the sum of exp below it); `sample_combine_kernel`
takes the first index of the row's largest key and the token's log-prob. The keys do not
depend on the split (the noise of index v is `tl.rand(seed + row * ROW_SEED_STRIDE, v)`), so
every way draws the same tokens as `_decode_ops.ReferenceOps.sample`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_ops import MIN_UNIFORM, ROW_SEED_STRIDE

# Kernels read module globals only as constexprs.
_MIN_UNIFORM = tl.constexpr(MIN_UNIFORM)
_ROW_SEED_STRIDE = tl.constexpr(ROW_SEED_STRIDE)


@triton.jit
def sample_row_kernel(
    logits_ptr, temperature_ptr, seed_ptr, tokens_ptr, log_probs_ptr, vocab, stride_row, BLOCK: tl.constexpr
):
    """One program a row: the row's token (the first index of its largest key) and its log-prob in
    one pass, with a running log-sum-exp per lane."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr)
    greedy = temperature <= 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr) + row.to(tl.int64) * _ROW_SEED_STRIDE
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    # Per lane: the running max and sum of exp (online log-sum-exp) and the best key so far.
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + lanes
        valid = idx < vocab
        z = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) / divisor
        u = tl.maximum(tl.rand(seed, idx), _MIN_UNIFORM)
        key = tl.where(greedy, z, z - tl.log(-tl.log(u)))
        key = tl.where(valid, key, float("-inf"))
        better = key > best_key  # strict: a lane keeps its first index on ties
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, idx, best_idx)
        new_max = tl.maximum(run_max, z)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no inf - inf on lanes without keys
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(z - shift)
        run_max = new_max
    top = tl.max(best_key, axis=0)
    token = tl.min(tl.where(best_key == top, best_idx, vocab), axis=0)  # the first index of the maximum
    m = tl.max(run_max, axis=0)
    total = tl.sum(run_sum * tl.exp(run_max - m), axis=0)
    z_token = tl.load(base + token).to(tl.float32) / divisor
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(log_probs_ptr + row, z_token - m - tl.log(total))


@triton.jit
def sample_split_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    part_ptr,
    part_idx_ptr,
    vocab,
    stride_row,
    span,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One split of a row's vocabulary: its best Gumbel key and that key's index, and its log-sum-exp
    as (max, sum of exp below it). `span` is a multiple of BLOCK."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr)
    greedy = temperature <= 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr) + row.to(tl.int64) * _ROW_SEED_STRIDE
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    lo = split * span
    hi = tl.minimum(lo + span, vocab)
    # Per lane: the best key so far (strict: a lane keeps its first index on ties). The log-sum-exp
    # is kept per program, updated once a block: one exp an element.
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    run_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    run_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for v0 in range(lo, hi, BLOCK):
        idx = v0 + lanes
        valid = idx < hi
        z = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) / divisor
        u = tl.maximum(tl.rand(seed, idx), _MIN_UNIFORM)
        key = tl.where(greedy, z, z - tl.log(-tl.log(u)))
        key = tl.where(valid, key, float("-inf"))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, idx, best_idx)
        new_max = tl.maximum(run_max, tl.max(z, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no inf - inf in a block without keys
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift), axis=0)
        run_max = new_max
    top = tl.max(best_key, axis=0)
    slot = row.to(tl.int64) * SPLITS + split
    tl.store(part_ptr + slot * 3, top)
    tl.store(part_ptr + slot * 3 + 1, run_max)
    tl.store(part_ptr + slot * 3 + 2, run_sum)
    tl.store(part_idx_ptr + slot, tl.min(tl.where(best_key == top, best_idx, vocab), axis=0))


@triton.jit
def sample_combine_kernel(
    logits_ptr,
    temperature_ptr,
    part_ptr,
    part_idx_ptr,
    tokens_ptr,
    log_probs_ptr,
    vocab,
    stride_row,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """A row's token: the first index of its largest key over the splits (so the first over the whole
    vocabulary, whatever the splits), and its log-prob from the splits' log-sum-exps."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr)
    divisor = tl.where(temperature <= 0.0, 1.0, temperature)
    s = tl.arange(0, BLOCK_S)
    here = s < SPLITS
    slot = row.to(tl.int64) * SPLITS + s
    keys = tl.load(part_ptr + slot * 3, mask=here, other=float("-inf"))
    maxes = tl.load(part_ptr + slot * 3 + 1, mask=here, other=float("-inf"))
    sums = tl.load(part_ptr + slot * 3 + 2, mask=here, other=0.0)
    idxs = tl.load(part_idx_ptr + slot, mask=here, other=vocab)
    top = tl.max(keys, axis=0)
    token = tl.min(tl.where(keys == top, idxs, vocab), axis=0)
    m = tl.max(maxes, axis=0)
    total = tl.sum(tl.where(maxes == float("-inf"), 0.0, sums * tl.exp(maxes - m)), axis=0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    z_token = tl.load(base + token).to(tl.float32) / divisor
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(log_probs_ptr + row, z_token - m - tl.log(total))
