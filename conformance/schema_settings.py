"""The `settings` part of a case: the router's behaviour in plane-neutral words
(`RouterSettings`, with its breaker, health-check and `cache_aware` blocks).

Part of the case schema (`conformance.schema`).
"""

from __future__ import annotations

from yaml.nodes import Node

from conformance.model import (
    ALL_OPEN_MODES,
    POLICIES,
    BreakerSettings,
    CacheAwareSettings,
    HealthSettings,
    RouterSettings,
)
from conformance.nodes import NodeReader, join

SETTINGS_FIELDS = (
    "policy",
    "prefill_policy",
    "decode_policy",
    "attempts",
    "breaker",
    "health",
    "max_body_bytes",
    "cache_aware",
    "api_key",
    "max_concurrent",
    "queue_size",
    "resume_limit",
    "aliases",
    "fallbacks",
    "priority_classes",
    "default_priority",
)
CACHE_AWARE_FIELDS = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
BREAKER_FIELDS = ("threshold", "cooldown_s", "max_cooldown_s", "all_open")
HEALTH_FIELDS = ("interval_s", "failure_threshold", "success_threshold")


class SettingsReader:
    """Reads the settings of one case file; raises SpecError at the first problem."""

    def __init__(self, r: NodeReader) -> None:
        self.r = r

    def settings(self, node: Node | None) -> RouterSettings:
        if node is None:
            return RouterSettings()
        r = self.r
        m = r.mapping(node, "settings", SETTINGS_FIELDS)

        def policy(key: str) -> str | None:
            return r.choice(m[key], join("settings", key), POLICIES) if key in m else None

        classes = (
            r.strings(m["priority_classes"], "settings.priority_classes")
            if "priority_classes" in m
            else ()
        )
        default_priority = (
            r.string(m["default_priority"], "settings.default_priority")
            if "default_priority" in m
            else None
        )
        if classes and default_priority not in classes:
            raise r.fail(
                m.get("default_priority", m["priority_classes"]),
                "settings.default_priority",
                f"must name one of the priority classes ({', '.join(classes)})",
            )
        if default_priority is not None and not classes:
            raise r.fail(
                m["default_priority"], "settings.default_priority", "needs priority_classes"
            )
        return RouterSettings(
            aliases=self.aliases(m["aliases"]) if "aliases" in m else {},
            fallbacks=self.fallbacks(m["fallbacks"]) if "fallbacks" in m else {},
            priority_classes=classes,
            default_priority=default_priority,
            policy=policy("policy"),
            prefill_policy=policy("prefill_policy"),
            decode_policy=policy("decode_policy"),
            attempts=r.integer(m["attempts"], "settings.attempts", 1, 100)
            if "attempts" in m
            else None,
            breaker=self.breaker(m["breaker"]) if "breaker" in m else BreakerSettings(),
            health=self.health(m["health"]) if "health" in m else HealthSettings(),
            max_body_bytes=(
                r.integer(m["max_body_bytes"], "settings.max_body_bytes", 1024)
                if "max_body_bytes" in m
                else None
            ),
            api_key=r.string(m["api_key"], "settings.api_key") if "api_key" in m else None,
            max_concurrent=r.integer(m["max_concurrent"], "settings.max_concurrent", 1)
            if "max_concurrent" in m
            else None,
            queue_size=r.integer(m["queue_size"], "settings.queue_size", 0)
            if "queue_size" in m
            else None,
            cache_aware=self.cache_aware(m["cache_aware"])
            if "cache_aware" in m
            else CacheAwareSettings(),
            resume_limit=r.integer(m["resume_limit"], "settings.resume_limit", 0, 100)
            if "resume_limit" in m
            else None,
        )

    def aliases(self, node: Node) -> dict[str, dict[str, float]]:
        """`alias: {model: weight, ...}`: each alias for served models with weights."""
        r = self.r
        aliases: dict[str, dict[str, float]] = {}
        for name, _, targets in r.items(node, "settings.aliases"):
            field = join("settings.aliases", name)
            aliases[name] = {
                model: r.number(weight, join(field, model), positive=True)
                for model, _, weight in r.items(targets, field)
            }
            if not aliases[name]:
                raise r.fail(targets, field, "names no model")
        return aliases

    def fallbacks(self, node: Node) -> dict[str, tuple[str, ...]]:
        """`model: [fallback, ...]`: what each model gives way to, in order."""
        r = self.r
        fallbacks: dict[str, tuple[str, ...]] = {}
        for name, _, models in r.items(node, "settings.fallbacks"):
            field = join("settings.fallbacks", name)
            fallbacks[name] = r.strings(models, field)
            if not fallbacks[name]:
                raise r.fail(models, field, "names no fallback")
        return fallbacks

    def cache_aware(self, node: Node) -> CacheAwareSettings:
        r = self.r
        field = "settings.cache_aware"
        m = r.mapping(node, field, CACHE_AWARE_FIELDS)
        threshold = (
            r.number(m["cache_threshold"], join(field, "cache_threshold"))
            if "cache_threshold" in m
            else None
        )
        if threshold is not None and not 0 <= threshold <= 1:
            raise r.fail(
                m["cache_threshold"], join(field, "cache_threshold"), "must be between 0 and 1"
            )
        relative = (
            r.number(m["balance_rel_threshold"], join(field, "balance_rel_threshold"))
            if "balance_rel_threshold" in m
            else None
        )
        if relative is not None and relative < 1:
            raise r.fail(
                m["balance_rel_threshold"],
                join(field, "balance_rel_threshold"),
                "must be at least 1",
            )
        return CacheAwareSettings(
            cache_threshold=threshold,
            balance_abs_threshold=(
                r.integer(m["balance_abs_threshold"], join(field, "balance_abs_threshold"), 0)
                if "balance_abs_threshold" in m
                else None
            ),
            balance_rel_threshold=relative,
        )

    def breaker(self, node: Node) -> BreakerSettings:
        r = self.r
        field = "settings.breaker"
        m = r.mapping(node, field, BREAKER_FIELDS)
        cooldown = (
            r.number(m["cooldown_s"], join(field, "cooldown_s"), positive=True)
            if "cooldown_s" in m
            else None
        )
        maximum = (
            r.number(m["max_cooldown_s"], join(field, "max_cooldown_s"), positive=True)
            if "max_cooldown_s" in m
            else None
        )
        if cooldown is not None and maximum is not None and maximum < cooldown:
            raise r.fail(
                m["max_cooldown_s"],
                join(field, "max_cooldown_s"),
                f"must be >= cooldown_s ({cooldown:g})",
            )
        return BreakerSettings(
            threshold=r.integer(m["threshold"], join(field, "threshold"), 0)
            if "threshold" in m
            else None,
            cooldown_s=cooldown,
            max_cooldown_s=maximum,
            all_open=r.choice(m["all_open"], join(field, "all_open"), ALL_OPEN_MODES)
            if "all_open" in m
            else None,
        )

    def health(self, node: Node) -> HealthSettings:
        r = self.r
        field = "settings.health"
        m = r.mapping(node, field, HEALTH_FIELDS)
        return HealthSettings(
            interval_s=r.number(m["interval_s"], join(field, "interval_s"), positive=True)
            if "interval_s" in m
            else None,
            failure_threshold=(
                r.integer(m["failure_threshold"], join(field, "failure_threshold"), 1)
                if "failure_threshold" in m
                else None
            ),
            success_threshold=(
                r.integer(m["success_threshold"], join(field, "success_threshold"), 1)
                if "success_threshold" in m
                else None
            ),
        )
