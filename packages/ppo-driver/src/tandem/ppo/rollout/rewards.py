"""Reward functions: the built-ins (`exact_match`, `math`, `none`), user functions by spec, and a checked call.

Every reward function is batched: it takes `list[RewardInput]` and returns one
float per input, in order; it may be a plain function or an `async def`.
`load_reward(spec)` resolves `--custom-rm-path` (or a built-in `--rm-type`) and `compute_rewards(fn, inputs)` calls
it and checks what comes back, so that a failure names the sample it came from.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import isfinite
from pathlib import Path
from typing import Any

RewardFunction = Callable[[list["RewardInput"]], "list[float] | Awaitable[list[float]]"]
"""A batched reward function: inputs in, one float per input out (sync or async)."""

_SPEC_FORMS = "exact_match, math, none, package.module:function or /path/to/file.py:function"

MATH_TIMEOUT_SECONDS = 5
"""math-verify's limit per parse and per comparison, where it can enforce one (see `math`)."""


@dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one sample."""

    prompt: str
    """The prompt as the model saw it (chat template applied)."""
    response: str
    """The model's response, decoded without special tokens."""
    label: Any
    """The prompt's `label` from the data file (None when it has none)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other field of the prompt's line in the data file."""
    index: int = 0
    """The sample's index in the rollout batch."""


class RewardError(RuntimeError):
    """A reward function failed or returned something other than one finite number per sample."""


# --- built-ins ------------------------------------------------------------------------------------


def exact_match(inputs: list[RewardInput]) -> list[float]:
    """1.0 where the response, stripped, equals `str(label)`, stripped; else 0.0."""
    return [float(inp.response.strip() == str(inp.label).strip()) for inp in inputs]


def math(inputs: list[RewardInput]) -> list[float]:
    """1.0 where the response's final answer equals the label mathematically (math-verify); else 0.0.

    The response is parsed as math-verify parses model output (a `\\boxed{}`
    answer first, then LaTeX or plain expressions: numbers, fractions); the label
    is parsed as it is or, failing that, as inline LaTeX (`$x+1$`). math-verify
    guards parsing and comparison with `signal.alarm`, which works only in the main
    thread; elsewhere (the driver may score in a thread) the guard is off. A label
    that cannot be parsed at all raises ValueError: the data is wrong.
    """
    from math_verify import parse, verify

    timeout = MATH_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for inp in inputs:
        label = str(inp.label).strip()
        gold = parse(label, parsing_timeout=timeout) if label else []
        if not gold and label:
            gold = parse(f"${label}$", parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"the label {inp.label!r} is not a math answer that math-verify can parse")
        answer = parse(inp.response, parsing_timeout=timeout)
        rewards.append(float(bool(answer) and verify(gold, answer, timeout_seconds=timeout)))
    return rewards


def no_reward(inputs: list[RewardInput]) -> list[float]:
    """0.0 for every sample: a run whose only signal is a teacher's (`--rm-type none`, on-policy distillation alone)."""
    return [0.0] * len(inputs)


NO_REWARD = "none"
"""The `--rm-type` of no reward at all (`no_reward`)."""

BUILTIN_REWARDS: dict[str, RewardFunction] = {"exact_match": exact_match, "math": math, NO_REWARD: no_reward}
"""Reward functions that `--rm-type` names (no module needed)."""


# --- load_reward ----------------------------------------------------------------------------------


def _spec_error(spec: str, problem: str, fix: str, flag: str = "--custom-rm-path") -> ValueError:
    return ValueError(f"{flag} {spec!r}: {problem}; {fix}")


def _load_file(spec: str, file_part: str, flag: str) -> Any:
    path = Path(file_part).expanduser().resolve()
    if not path.is_file():
        raise _spec_error(spec, f"the file {path} does not exist", "pass the path of a Python file", flag)
    # A unique, stable module name per file: two reward files named alike do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"tandem_user_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise _spec_error(spec, f"{path} cannot be imported as a module", "pass a .py file", flag)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec, as an import does: dataclasses and pickling look it up
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _spec_error(
            spec, f"importing {path} raised {exc!r}", "fix the error in that file", flag
        ) from exc
    return module


def _load_module(spec: str, module_name: str, flag: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise _spec_error(
                spec,
                f"no module named {exc.name!r}",
                "install the package that holds it, put its folder on PYTHONPATH, or give a file path "
                "(/path/to/file.py:function)",
                flag,
            ) from exc
        raise _spec_error(
            spec, f"importing {module_name} raised {exc!r}", "install what it imports", flag
        ) from exc
    except Exception as exc:
        raise _spec_error(
            spec, f"importing {module_name} raised {exc!r}", "fix the error in that module", flag
        ) from exc


def load_reward(spec: str) -> RewardFunction:
    """Resolve `--custom-rm-path` (or `--rm-type`): a built-in name, `package.module:function`, or `/path/to/file.py:function`.

    Raises ValueError naming `--custom-rm-path` and the fix when the module, file or
    function does not exist or is not callable.
    """
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    target, sep, function_name = spec.rpartition(":")
    if not sep or not target or not function_name:
        raise _spec_error(
            spec, "not a built-in reward and not of the form X:function", f"use one of {_SPEC_FORMS}"
        )
    return load_named(
        spec,
        "--custom-rm-path",
        forms=_SPEC_FORMS,
        expects="a function that takes list[RewardInput] and returns list[float]",
    )


def load_named(spec: str, flag: str, *, forms: str, expects: str) -> Any:
    """The callable `spec` names, `package.module:name` or `/path/to/file.py:name`; ValueError naming
    `flag` and the fix when the module, file or name does not exist or is not callable. `forms`: the
    forms the flag takes, `expects`: what the callable must be (both for the messages)."""
    spec = spec.strip()
    target, sep, function_name = spec.rpartition(":")
    if not sep or not target or not function_name:
        raise _spec_error(spec, "not of the form X:name", f"use one of {forms}", flag)
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(spec, target, flag) if is_file else _load_module(spec, target, flag)
    fn = getattr(module, function_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise _spec_error(
            spec,
            f"{target} has no function {function_name!r}",
            f"name one of its functions ({', '.join(public) or 'it defines none'})",
            flag,
        )
    if not callable(fn):
        raise _spec_error(
            spec, f"{target}:{function_name} is a {type(fn).__name__}, not callable", f"name {expects}", flag
        )
    return fn


# --- compute_rewards ------------------------------------------------------------------------------


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _call(fn: RewardFunction, inputs: list[RewardInput]) -> Any:
    """Call `fn`; when it returns an awaitable, run it to completion on an event loop of its own."""
    result = fn(inputs)
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        return await result

    if not _in_running_loop():
        return asyncio.run(wait())
    # Called from inside an event loop (an async driver): asyncio.run would refuse, so use a thread.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _describe(inp: RewardInput) -> str:
    prompt = inp.prompt if len(inp.prompt) <= 60 else inp.prompt[:57] + "..."
    return f"sample {inp.index} (prompt {prompt!r}, label {inp.label!r})"


def compute_rewards(fn: RewardFunction, inputs: Sequence[RewardInput]) -> list[float]:
    """Call the batched reward function on `inputs` and check that it gives one finite number each.

    Raises RewardError naming the sample: when the batch call raises, the
    function is called again on each sample alone and the first sample that
    raises is named, its exception chained; a wrong number of rewards or a
    value that is not a finite number names its index.
    """
    inputs = list(inputs)
    if not inputs:
        return []
    try:
        result = _call(fn, inputs)
    except Exception as batch_exc:
        for inp in inputs:
            try:
                _call(fn, [inp])
            except Exception as exc:
                raise RewardError(f"reward function {_name(fn)} raised on {_describe(inp)}: {exc!r}") from exc
        raise RewardError(
            f"reward function {_name(fn)} raised {batch_exc!r} on the batch of {len(inputs)} samples "
            f"(indices {inputs[0].index}..{inputs[-1].index}) but on none of them alone"
        ) from batch_exc
    try:
        rewards = list(result)
    except TypeError:
        raise RewardError(
            f"reward function {_name(fn)} returned a {type(result).__name__}, not a list of floats "
            f"(one per sample, {len(inputs)} here)"
        ) from None
    if len(rewards) != len(inputs):
        raise RewardError(
            f"reward function {_name(fn)} returned {len(rewards)} rewards for {len(inputs)} samples; "
            "it must return one per sample, in order"
        )
    checked = []
    for inp, reward in zip(inputs, rewards, strict=True):
        value = _real(reward)
        if value is None or not isfinite(value):
            raise RewardError(
                f"reward function {_name(fn)} returned {reward!r} for {_describe(inp)}; "
                "each reward must be a finite real number (return float(...))"
            )
        checked.append(value)
    return checked


def _real(value: Any) -> float | None:
    """`value` as a float when it is one real number, else None.

    Python's numbers (bool included), and any scalar of an array library: NumPy's bool, integer and
    float scalars (`np.bool_` is no `numbers.Real`), 0-d arrays and tensors, through their `.item()`.
    """
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None
