"""The CPU's optimizer steps through torch's fused Adam kernel, as the loop it replaced would have
(`worker.optimizer.step_fused`), also after a checkpoint's `load_state_dict`.

Pure torch, in-process. The speed of both, old and new in one run: `bench/cpu_optimizer_bench.py`.
The worker's own optimizer is checked fused after a resume in tests/megatron/_scripts/resume_before_step_check.py.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.megatron.worker.optimizer import step_fused

shapes = st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=4)


def _params(dims: list[list[int]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*d, generator=g)) for d in dims]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@given(
    dims=shapes,
    seed=st.integers(0, 2**16),
    adam_w=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.1]),
    lr=st.sampled_from([1e-5, 1e-3]),
)
def test_the_fused_step_is_the_loops_step_and_stays_fused_after_a_load(
    dims: list[list[int]], seed: int, adam_w: bool, weight_decay: float, lr: float
) -> None:
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    loop_params, fused_params = _params(dims, seed), _params(dims, seed)
    loop = cls(loop_params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    fused = cls(fused_params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), eps=1e-8)
    step_fused(fused)
    assert all(g["fused"] is True and g["foreach"] is False for g in fused.param_groups)
    _steps(loop, loop_params, seed + 1, 3)
    _steps(fused, fused_params, seed + 1, 3)
    for a, b in zip(loop_params, fused_params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # A checkpoint saved by the loop's optimizer names its implementation; the load keeps the fused one, and
    # the state it brings (moments, step counts) goes on as the loop's does.
    fused.load_state_dict(copy.deepcopy(loop.state_dict()))
    assert all(g["fused"] is True and g["foreach"] is False for g in fused.param_groups)
    with torch.no_grad():
        for a, b in zip(loop_params, fused_params, strict=True):
            b.copy_(a)
    _steps(loop, loop_params, seed + 2, 2)
    _steps(fused, fused_params, seed + 2, 2)
    for a, b in zip(loop_params, fused_params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_the_fused_kernel_runs_where_the_loop_would_have() -> None:
    """Not a flag alone: torch dispatches the step to its fused kernel (`_fused_adamw_`)."""
    params = _params([[4, 3]], 0)
    opt = torch.optim.AdamW(params, lr=1e-3)
    step_fused(opt)
    called: list[str] = []
    real = torch._fused_adamw_

    def spy(*args: object, **kwargs: object) -> object:
        called.append("fused")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_fused_adamw_", spy)
        _steps(opt, params, 1, 1)
    assert called == ["fused"]


def test_the_bench_times_both_ways_and_checks_them(tmp_path: Path) -> None:
    """bench/cpu_optimizer_bench.py at a tiny shape: both steps and both norms timed, their results compared."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import cpu_optimizer_bench as bench
    finally:
        sys.path.pop(0)
    out = tmp_path / "cpu_optimizer.json"
    assert bench.main(["--shape", "tiny", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"loop", "fused", "norm_copy", "norm_read"}
    assert all(v > 0 for v in result["seconds"].values())
    assert result["max_param_difference"] <= 1e-6 and result["params"] > 0
