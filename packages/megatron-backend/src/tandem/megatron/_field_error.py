"""`FieldError`: a config value that breaks a rule, as a pair of the field and the message."""

from __future__ import annotations

from collections.abc import Callable


class FieldError(ValueError):
    """A `WorkerConfig` value that breaks a rule: the field, and a message that says why and the fix.

    The message names each other field it mentions in backticks (`` `kl_coef` ``), and `mentions`
    lists those fields, so that whoever shows the error names them in its own terms: `str(error)`
    is `field: message` in the config's field names; the driver's `render(flag)` gives
    `--field: message` with every mentioned field as its flag. Nothing is parsed back out of
    the text.
    """

    def __init__(self, field: str, message: str, *mentions: str) -> None:
        missing = [name for name in mentions if f"`{name}`" not in message]
        if missing:
            raise TypeError(
                f"FieldError({field!r}): mentions {missing} do not appear in backticks in {message!r}"
            )
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.mentions = mentions

    def __reduce__(self) -> tuple[type[FieldError], tuple[str, ...]]:
        # Rebuilt from its parts when pickled (a worker's error reaches the driver through Ray).
        return (FieldError, (self.field, self.message, *self.mentions))

    def render(self, name: Callable[[str], str]) -> str:
        """The error with the field and each mentioned field written as `name(field)` (e.g. a CLI flag)."""
        field, message = name(self.field), self.message
        for mentioned in self.mentions:
            message = message.replace(f"`{mentioned}`", name(mentioned))
        return f"{field}: {message}"
