"""Precise prefix routing's data: the engines' own KV-cache events.

Owns the decoding of the engines' ZMQ event messages (`decode`), the per-model index of
which worker and DP rank holds which block under keys the router computes itself
(`index`), and the subscription task that keeps one worker rank's view in step,
repairing gaps from the engine's replay socket (`subscription`), and the service that
runs one subscription per worker rank while the worker is in the fleet
(`fleet_views`, the only module here that reads `router.fleet`). The policy
(`router.policies.kv_aware`) reads the indexes.
"""

from router.engines.kv_events.decode import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    EventMessage,
    KvEvent,
    decode_batch,
    decode_message,
)
from router.engines.kv_events.fleet_views import (
    KvEvents,
    KvEventsSettings,
    KvEventsStatistics,
    KvIndexes,
    serve_kv_events,
    worker_sources,
)
from router.engines.kv_events.index import (
    IndexSettings,
    IndexStatistics,
    Key,
    KvIndex,
    MatchResult,
    ViewId,
    ViewState,
    chain_key,
)
from router.engines.kv_events.subscription import (
    KvEventSource,
    KvSubscription,
    SubscriptionSettings,
    SubscriptionStatistics,
    serve_kv_subscription,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "EventBatch",
    "EventMessage",
    "IndexSettings",
    "IndexStatistics",
    "Key",
    "KvEvent",
    "KvEventSource",
    "KvEvents",
    "KvEventsSettings",
    "KvEventsStatistics",
    "KvIndex",
    "KvIndexes",
    "KvSubscription",
    "MatchResult",
    "SubscriptionSettings",
    "SubscriptionStatistics",
    "ViewId",
    "ViewState",
    "chain_key",
    "decode_batch",
    "decode_message",
    "serve_kv_events",
    "serve_kv_subscription",
    "worker_sources",
]
