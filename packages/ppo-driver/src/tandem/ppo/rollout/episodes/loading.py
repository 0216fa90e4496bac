"""`--env-path` and `--custom-generate-function-path` loaded and checked before Ray starts.

An environment factory must be callable with no argument and make an object with `reset` and
`step` methods that take one argument each (one factory call is made here, to see it); a
custom generate function must take one argument, the `EpisodeContext`. Anything else is a
ValueError naming the flag, what was found and the fix. `textarena:GameId` names a TextArena
single-player game (`textarena_env`), which needs the extra `tandem-ppo-driver[textarena]`.
"""

from __future__ import annotations

import inspect
from typing import Any

from tandem.ppo.rollout.episodes.custom import CustomGenerate
from tandem.ppo.rollout.episodes.environment import EnvFactory
from tandem.ppo.rollout.rewards import load_named

__all__ = ["TEXTARENA_PREFIX", "load_custom_generate", "load_env_factory"]

TEXTARENA_PREFIX = "textarena:"
_ENV_FORMS = "package.module:factory, /path/to/file.py:factory or textarena:GameId"


def _binds(fn: Any, arguments: int) -> tuple[bool, str]:
    """Whether `fn` can be called with `arguments` positional arguments, and its signature as text."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True, "(...)"  # a builtin without a signature to read: its first call will tell
    try:
        signature.bind(*([None] * arguments))
    except TypeError:
        return False, str(signature)
    return True, str(signature)


def load_env_factory(spec: str) -> EnvFactory:
    """The environment factory `spec` names, checked by making one environment; ValueError naming `--env-path`."""
    if spec.startswith(TEXTARENA_PREFIX):
        from tandem.ppo.rollout.episodes.textarena_env import textarena_factory

        return textarena_factory(spec[len(TEXTARENA_PREFIX) :])
    factory = load_named(
        spec, "--env-path", forms=_ENV_FORMS, expects="a callable of no argument that makes an environment"
    )
    ok, signature = _binds(factory, 0)
    if not ok:
        raise ValueError(
            f"--env-path {spec!r}: the factory's signature is {signature}, but it is called with no argument "
            "to make each episode's environment; give a class or function that takes none (functools.partial "
            "binds settings)"
        )
    try:
        env = factory()
    except Exception as exc:
        raise ValueError(
            f"--env-path {spec!r}: making an environment raised {type(exc).__name__}: {exc}; fix the factory"
        ) from exc
    check_environment(env, spec)
    return factory


def check_environment(env: Any, spec: str) -> None:
    """`env` has `reset(sample)` and `step(turn)`; ValueError naming `--env-path` otherwise."""
    for method in ("reset", "step"):
        fn = getattr(env, method, None)
        if not callable(fn):
            raise ValueError(
                f"--env-path {spec!r}: the factory made a {type(env).__name__}, which has no {method}() method; "
                "an environment has reset(sample) -> observation and step(turn) -> (observation, reward, done)"
            )
        ok, signature = _binds(fn, 1)
        if not ok:
            raise ValueError(
                f"--env-path {spec!r}: {type(env).__name__}.{method}{signature} cannot be called with one "
                f"argument; write it as {method}(self, {'sample' if method == 'reset' else 'turn'})"
            )


def load_custom_generate(spec: str) -> CustomGenerate:
    """The custom generate function `spec` names; ValueError naming `--custom-generate-function-path`."""
    fn = load_named(
        spec,
        "--custom-generate-function-path",
        forms="package.module:function or /path/to/file.py:function",
        expects="a function of one argument, the EpisodeContext, that returns the Episode",
    )
    ok, signature = _binds(fn, 1)
    if not ok:
        raise ValueError(
            f"--custom-generate-function-path {spec!r}: the function's signature is {signature}, but it is "
            "called with one argument, the EpisodeContext; write it as "
            "async def generate(ctx) -> Episode (a plain def works too)"
        )
    result: CustomGenerate = fn
    return result
