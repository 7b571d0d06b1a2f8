"""The neutral settings that every plane launched with flags so far spells the SGLang
gateway's way: `cache_aware`'s knobs (`--cache-threshold`, ...), the health check's
thresholds (`--health-failure-threshold`, `--health-success-threshold`), the client key
(`--api-key`) and the admission limit (`--max-concurrent-requests`, `--queue-size`).

A plane maps the rest itself, and stops calling a function here the day its binary spells
that setting otherwise.
"""

from __future__ import annotations

from conformance.model import CacheAwareSettings, HealthSettings, RouterSettings


def health_threshold_flags(h: HealthSettings) -> list[str]:
    """How many probes turn a worker unhealthy and healthy again; the interval and the
    probe's timeout are each plane's own."""
    flags: list[str] = []
    if h.failure_threshold is not None:
        flags += ["--health-failure-threshold", str(h.failure_threshold)]
    if h.success_threshold is not None:
        flags += ["--health-success-threshold", str(h.success_threshold)]
    return flags


def cache_aware_flags(c: CacheAwareSettings) -> list[str]:
    """The `cache_aware` settings a case sets, as flags; unset ones keep the plane's default."""
    flags: list[str] = []
    if c.cache_threshold is not None:
        flags += ["--cache-threshold", f"{c.cache_threshold:g}"]
    if c.balance_abs_threshold is not None:
        flags += ["--balance-abs-threshold", str(c.balance_abs_threshold)]
    if c.balance_rel_threshold is not None:
        flags += ["--balance-rel-threshold", f"{c.balance_rel_threshold:g}"]
    return flags


def auth_and_admission_flags(s: RouterSettings) -> list[str]:
    """The one client key the plane asks for, and how many requests it serves at once
    with how many more waiting."""
    flags: list[str] = []
    if s.api_key is not None:
        flags += ["--api-key", s.api_key]
    if s.max_concurrent is not None:
        flags += ["--max-concurrent-requests", str(s.max_concurrent)]
    if s.queue_size is not None:
        flags += ["--queue-size", str(s.queue_size)]
    return flags
