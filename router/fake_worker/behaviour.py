"""What a fake worker does with the next generation request: latencies, size, scripted failures.

One `Behaviour` per worker, set from flags at start and changed at run time through
`POST /debug/behaviour`. Every setting a client may change has the same snake_case name in
the JSON body as its flag (`--fail-first` -> `fail_first`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any


class FailMode(enum.StrEnum):
    """How a scripted failure shows itself to the client."""

    STATUS = "status"  # an HTTP error status with an OpenAI-shaped error body
    RESET = "reset"  # a TCP reset (RST) before any byte of the answer
    HANG = "hang"  # no answer at all until the client leaves
    GARBAGE = "garbage"  # 200 with a body (or SSE payload) that is not JSON
    MIDSTREAM = "midstream"  # 200, `fail_after_chunks` data chunks, then the connection breaks


class InvalidBehaviour(ValueError):
    """A behaviour update that cannot be applied; the message names the field and why."""


# Generous bound on tokens per choice: keeps a typo from building gigabytes of text.
MAX_TOKENS = 1_000_000


@dataclass(slots=True)
class Behaviour:
    """The live settings of one fake worker.

    `fail_first` is what was asked for (-1: every generation request fails);
    `fail_remaining` counts down as scripted failures are served.
    """

    tokens: int = 16
    ttft_ms: float = 0.0
    token_latency_ms: float = 0.0
    fail_first: int = 0
    fail_status: int = 503
    fail_mode: FailMode = FailMode.STATUS
    fail_after_chunks: int = 0
    healthy: bool = True
    external_load: int = 0
    """Requests another sender holds on the engine: added to its running gauge."""
    lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters the engine holds now (`router.fake_worker.lora`): a list in JSON;
    setting it loads and unloads them at once."""
    fail_remaining: int = 0

    def __post_init__(self) -> None:
        for name in _UPDATABLE:
            setattr(self, name, _check(name, getattr(self, name)))
        self.fail_remaining = self.fail_first

    def take_failure(self) -> bool:
        """Decide whether this generation request gets the scripted failure, and count it."""
        if self.fail_remaining == 0:
            return False
        if self.fail_remaining > 0:
            self.fail_remaining -= 1
        return True

    def update(self, changes: Any) -> None:
        """Apply a JSON object of changes, all or nothing.

        Unknown keys and wrong types raise `InvalidBehaviour` and change nothing. Setting
        `fail_first` restarts the count: the next `fail_first` requests fail.
        """
        if not isinstance(changes, dict):
            raise InvalidBehaviour("the behaviour update must be a JSON object")
        unknown = sorted(set(changes) - set(_UPDATABLE))
        if unknown:
            raise InvalidBehaviour(
                f"unknown behaviour field(s) {', '.join(unknown)}; known: {', '.join(_UPDATABLE)}"
            )
        checked = {name: _check(name, value) for name, value in changes.items()}
        for name, value in checked.items():
            setattr(self, name, value)
        if "fail_first" in checked:
            self.fail_remaining = self.fail_first

    def to_json(self) -> dict[str, Any]:
        """The settings as `GET /debug/behaviour` shows them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_UPDATABLE = (
    "tokens",
    "ttft_ms",
    "token_latency_ms",
    "fail_first",
    "fail_status",
    "fail_mode",
    "fail_after_chunks",
    "healthy",
    "external_load",
    "lora_adapters",
)


def _check(name: str, value: Any) -> Any:
    """Validate one setting and return it in its stored type."""
    if name == "fail_mode":
        try:
            return FailMode(value)
        except ValueError:
            choices = ", ".join(m.value for m in FailMode)
            raise InvalidBehaviour(f"'fail_mode' must be one of {choices}, got {value!r}") from None
    if name == "lora_adapters":
        if not isinstance(value, list | tuple) or not all(
            isinstance(item, str) and item for item in value
        ):
            raise InvalidBehaviour(f"'lora_adapters' must be a list of names, got {value!r}")
        return tuple(dict.fromkeys(value))
    if name == "healthy":
        if not isinstance(value, bool):
            raise InvalidBehaviour(f"'healthy' must be true or false, got {value!r}")
        return value
    if name in ("ttft_ms", "token_latency_ms"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise InvalidBehaviour(f"{name!r} must be a number >= 0, got {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidBehaviour(f"{name!r} must be an integer, got {value!r}")
    if name == "fail_first" and value < -1:
        raise InvalidBehaviour(f"'fail_first' must be -1 (always) or >= 0, got {value}")
    if name == "fail_status" and not 400 <= value <= 599:
        raise InvalidBehaviour(f"'fail_status' must be an HTTP error status 400-599, got {value}")
    if name in ("tokens", "fail_after_chunks", "external_load") and not 0 <= value <= MAX_TOKENS:
        raise InvalidBehaviour(f"{name!r} must be between 0 and {MAX_TOKENS}, got {value}")
    return value
