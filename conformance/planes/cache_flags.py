"""`cache_aware`'s neutral settings as flags: every plane so far spells them the SGLang
gateway's way (`--cache-threshold`, `--balance-abs-threshold`, `--balance-rel-threshold`)."""

from __future__ import annotations

from conformance.model import CacheAwareSettings


def cache_aware_flags(c: CacheAwareSettings) -> list[str]:
    """The settings a case sets, as flags; unset ones keep the plane's default."""
    flags: list[str] = []
    if c.cache_threshold is not None:
        flags += ["--cache-threshold", f"{c.cache_threshold:g}"]
    if c.balance_abs_threshold is not None:
        flags += ["--balance-abs-threshold", str(c.balance_abs_threshold)]
    if c.balance_rel_threshold is not None:
        flags += ["--balance-rel-threshold", f"{c.balance_rel_threshold:g}"]
    return flags
