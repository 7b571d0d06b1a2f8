"""What the `kv_aware` policies decided and what their event streams and indexes hold,
read at scrape time (`router_kv_aware_*`, `router_kv_events_*`, `router_kv_index_*`;
docs/metrics.md lists them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.engines.kv_events.fleet_views import KvEventsStatistics, KvIndexes
from router.fleet.records import Role
from router.policies.kv_aware import NO_PREDICTION_REASONS, PICK_REASONS, KvAware

_NO_STREAMS: Final = KvEventsStatistics(
    subscriptions=0,
    events={},
    batches=0,
    decode_errors=0,
    unknown_event_types=0,
    replays=0,
    replay_failures=0,
    gaps=0,
    restarts=0,
    reconnects=0,
    disconnects=0,
    unknown_views=0,
)


class KvAwareCollector(Collector):
    """The kv_aware policies' decisions, one series per role whose policy it is, and the
    event streams and indexes behind them (read at scrape time)."""

    def __init__(
        self,
        policies: Mapping[Role, KvAware],
        events: Callable[[], KvEventsStatistics] | None = None,
        indexes: KvIndexes | None = None,
    ) -> None:
        self._policies = policies
        self._events = events
        self._indexes = indexes

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        predictions = CounterMetricFamily(
            "router_kv_aware_predictions",
            "kv_aware requests whose blocks were looked up in the engines' own KV index",
            labels=["role"],
        )
        missing = CounterMetricFamily(
            "router_kv_aware_no_prediction",
            "kv_aware requests placed by load alone, by why: no_tokens (text without --kv-tokenizer, batches), chat_template (chat not rendered here: no template, Messages with tools, media, ...), template_error (the chat template raised or ran past its bounds), engine_tokenize (the engine was asked for the tokens and gave none), no_index (no event of the model yet), short_prompt (under one block)",
            labels=["role", "reason"],
        )
        picks = CounterMetricFamily(
            "router_kv_aware_picks",
            "kv_aware picks by reason: match (the winner holds blocks), load (no candidate's held blocks outweighed its load), no_prediction",
            labels=["role", "reason"],
        )
        prompt_tokens = CounterMetricFamily(
            "router_kv_aware_prompt_tokens",
            "Tokens of the requests kv_aware predicted",
            labels=["role"],
        )
        hit_tokens = CounterMetricFamily(
            "router_kv_aware_predicted_hit_tokens",
            "Of those, the tokens the chosen engine should find in its prefix cache; over the engines' own hits (vllm:prefix_cache_hits_total) it is the router's match rate",
            labels=["role"],
        )
        unknown = CounterMetricFamily(
            "router_kv_aware_unknown_candidates",
            "Candidates scored as holding nothing because their engine's view is unknown or not subscribed",
            labels=["role"],
        )
        for role, policy in self._policies.items():
            stats = policy.statistics()
            predictions.add_metric([role.value], stats["predictions"])
            unknown.add_metric([role.value], stats["unknown_candidates"])
            prompt_tokens.add_metric([role.value], stats["predicted_prompt_tokens"])
            hit_tokens.add_metric([role.value], stats["predicted_hit_tokens"])
            for reason in NO_PREDICTION_REASONS:
                missing.add_metric([role.value, reason], stats[f"no_prediction_{reason}"])
            for reason in PICK_REASONS:
                picks.add_metric([role.value, reason], stats[f"picks_by_{reason}"])
        yield predictions
        yield missing
        yield picks
        yield unknown
        yield prompt_tokens
        yield hit_tokens
        streams = self._events() if self._events is not None else _NO_STREAMS
        subscriptions = GaugeMetricFamily(
            "router_kv_events_subscriptions", "KV event subscriptions running (worker ranks)"
        )
        subscriptions.add_metric([], streams.subscriptions)
        yield subscriptions
        events = CounterMetricFamily(
            "router_kv_events_received",
            "KV-cache events applied to the index, by type",
            labels=["type"],
        )
        for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            events.add_metric([kind], streams.events.get(kind, 0))
        yield events
        for name, help_text in (
            ("batches", "KV event batches applied"),
            ("decode_errors", "KV event messages that could not be decoded"),
            ("unknown_event_types", "KV events of a type the router does not know (ignored)"),
            ("replays", "Replays asked of the engines' replay sockets"),
            ("replay_failures", "Replays that got no answer in time"),
            ("gaps", "Sequence gaps seen on the live streams"),
            ("restarts", "Engine restarts seen (sequence back to 0; over gRPC, DATA_LOSS)"),
            ("reconnects", "Reconnects of a subscription to its publisher"),
            ("disconnects", "Connections to a publisher, or gRPC event streams, lost"),
            ("unknown_views", "Times a worker rank's view became unknown"),
        ):
            family = CounterMetricFamily(f"router_kv_events_{name}", help_text)
            family.add_metric([], getattr(streams, name))
            yield family
        if self._indexes is not None:
            entries = GaugeMetricFamily(
                "router_kv_index_entries",
                "(worker rank, block) entries held by the KV index, per model",
                labels=["model"],
            )
            views = GaugeMetricFamily(
                "router_kv_index_views",
                "Worker-rank views of the KV index, per model and state",
                labels=["model", "state"],
            )
            for model, index in self._indexes.items():
                held = index.statistics()
                entries.add_metric([model], held.entries)
                views.add_metric([model, "known"], held.views_known)
                views.add_metric([model, "unknown"], held.views_unknown)
            yield entries
            yield views
