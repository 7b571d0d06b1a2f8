"""Precise prefix routing's data: the engines' own KV-cache events.

Owns the decoding of the engines' ZMQ event messages (`decode`), the per-model index of
which worker and DP rank holds which block under keys the router computes itself
(`index`), and the subscription task that keeps one worker rank's view in step,
repairing gaps from the engine's replay socket (`subscription`). It imports nothing
else of `router`: the fleet starts and stops subscriptions, the policy reads the index.
"""

from router.kv_events.decode import (
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
from router.kv_events.index import (
    IndexSettings,
    IndexStatistics,
    Key,
    KvIndex,
    MatchResult,
    ViewId,
    ViewState,
    chain_key,
)
from router.kv_events.subscription import (
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
    "KvIndex",
    "KvSubscription",
    "MatchResult",
    "SubscriptionSettings",
    "SubscriptionStatistics",
    "ViewId",
    "ViewState",
    "chain_key",
    "decode_batch",
    "decode_message",
    "serve_kv_subscription",
]
