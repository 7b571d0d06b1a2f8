"""Where `kv_aware` gets token ids, on `/metrics`, read at scrape (requests pay nothing)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.pipeline.engine_tokens import ASK_OUTCOMES, EngineTokens
from router.prompts.token_sources import TokenSources


class TokenSourcesCollector(Collector):
    """Each model's first token source and the engine asks by outcome (registered
    whatever the policy, so the families exist: empty without `kv_aware`)."""

    def __init__(self, sources: TokenSources | None, asks: EngineTokens | None) -> None:
        self._sources = sources
        self._asks = asks

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        source = GaugeMetricFamily(
            "router_kv_aware_token_source",
            "1 per model, labelled with where kv_aware gets its token ids first: tokenizer (--kv-tokenizer), model_dir (the engine's model directory, read here), engine (the engine's /tokenize), none (placed by load alone)",
            labels=["model", "source"],
        )
        if self._sources is not None:
            for model, first in sorted(self._sources.sources().items()):
                source.add_metric([model, first.value], 1)
        asks = CounterMetricFamily(
            "router_kv_aware_engine_tokenize",
            "Asks of an engine's /tokenize for a request's token ids, by outcome: ok, timeout, refused (not 200), failed (transport), bad_answer (not token ids), busy (too many in flight: not asked), not_asked (no engine could be asked for the request's shape)",
            labels=["outcome"],
        )
        waited = CounterMetricFamily(
            "router_kv_aware_engine_tokenize_seconds",
            "Time requests waited for engines' /tokenize answers, summed",
        )
        if self._asks is not None:
            for outcome in ASK_OUTCOMES:
                asks.add_metric([outcome], self._asks.asks[outcome])
            waited.add_metric([], self._asks.ask_seconds)
        yield source
        yield asks
        yield waited
