"""`Box`: an ObjectRef that travels through a Ray call without being resolved."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray import ObjectRef

from tandem.value_transfer import _arguments as arguments


@dataclass(frozen=True, slots=True)
class Box[T]:
    """Carries an ObjectRef through a Ray call so that the receiver gets the ref, not the value.

    Ray resolves an ObjectRef passed as a top-level argument of a remote call (the
    callee would receive the value, fetched before the call starts). A ref nested
    inside another object is passed as a ref, and Ray still counts it (the object
    lives while a Box holding it does). Boxing it lets the callee decide when and
    where to fetch: the driver routes critic values without pulling them through
    itself, and the actor rank fetches them with one `ray.get`.
    """

    ref: ObjectRef[T]

    def __post_init__(self) -> None:
        if not isinstance(self.ref, ObjectRef):
            raise TypeError(
                f"Box.ref must be a ray.ObjectRef, got {type(self.ref).__name__}; "
                "wrap the result of ray.put(...) or of a remote call, or use Box.put(value)"
            )

    @classmethod
    def put(cls, value: T) -> Box[T]:
        """Put `value` into the object store (one `ray.put`) and box the ref."""
        return cls(ray.put(value))

    def get(self, *, timeout: float | None = None) -> T:
        """Fetch the boxed value (one `ray.get`); `timeout` in seconds, None to wait forever."""
        value: T = ray.get(self.ref, timeout=arguments.timeout("timeout", timeout))
        return value
