"""The per-model index of which worker (and DP rank) holds which KV block.

Pure and synchronous: the subscriptions feed it events, the policy asks it about a
request's tokens, and every time-dependent call takes `now` from the caller.

Keys are the router's own: a chained hash over each full block's token ids, the LoRA
name and the block's extra keys, starting from the request's first token. Engines hash
with their own seed (vLLM's `PYTHONHASHSEED`-dependent or sha256 hashes, SGLang's
own), so two workers holding the same prefix report different hashes; our keys agree.
Per view (worker, rank) a map from the engine's hashes to our keys serves
`BlockRemoved` and resolves `BlockStored.parent_block_hash` to the parent's key.

A view is `known` or `unknown`. Unknown views are reported as such by `match`, never
as holding nothing, so the policy can tell "no blocks" from "cannot say".
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from router.engines.kv_events.decode import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    ExtraKey,
    KvEvent,
)

Key = bytes
"""A block key of ours: 16 bytes of blake2b over (parent key, tokens, LoRA, extras)."""

ViewId = tuple[str, int | None]
"""(worker id, DP rank or None for a worker that is not one rank of several)."""

_ROOT = b"\x00" * 16
_PLAIN_SUFFIX = msgspec.msgpack.encode((None, None))

# vLLM names the device tier "GPU"; other media (CPU offload, disk) come with their
# own stores and removals, often without token ids. Only the device tier is indexed, so
# a CPU-tier removal never drops a block that is still on the GPU.
_INDEXED_MEDIA = (None, "GPU")


class ViewState(enum.Enum):
    KNOWN = "known"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class IndexSettings:
    max_entries: int = 1_000_000
    """Cap on (view, block) entries over all views; beyond it the least recently stored
    or matched entry goes."""
    pending_ttl_s: float = 2.0
    """How long a routed request's blocks count as held before the engine's events."""
    max_pending: int = 100_000


@dataclass(frozen=True)
class MatchResult:
    blocks: int
    """Full blocks in the request (0 while the block size is not learned)."""
    runs: dict[ViewId, int]
    """Every known view: consecutive blocks held from the start (0 included)."""
    unknown: frozenset[ViewId]
    """Views whose holdings cannot be said: excluded from `runs`."""


@dataclass(frozen=True)
class IndexStatistics:
    entries: int
    views_known: int
    views_unknown: int
    block_size: int | None
    pending: int
    stored_blocks: int
    removed_blocks: int
    cleared: int
    evicted_entries: int
    orphan_blocks: int
    """Stored blocks whose parent the view does not hold: not indexed."""
    ignored_blocks: int
    """Blocks of a medium or KV group the index does not track."""
    unknown_removals: int
    """Removals of an engine hash the view does not hold."""
    inconsistent_events: int
    """Events that could not be applied (block size, token count): view marked unknown."""


class _Held:
    """One engine hash of a view: our key for it, and how many stores of it are live."""

    __slots__ = ("count", "key")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.count = 1


class _View:
    __slots__ = ("evicted", "hashes", "pending", "reason", "state")

    def __init__(self) -> None:
        self.state = ViewState.UNKNOWN
        self.reason: str | None = "no event stream applied yet"
        self.hashes: dict[BlockHash, _Held] = {}
        self.pending: set[Key] = set()
        # Entries the cap evicted from this view: once non-zero, a parent we do not
        # know is more likely our own eviction than a lost event.
        self.evicted = 0


@dataclass
class _Counters:
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    evicted_entries: int = 0
    orphan_blocks: int = 0
    ignored_blocks: int = 0
    unknown_removals: int = 0
    inconsistent_events: int = 0


class KvIndex:
    """Block holdings of one model's workers, from their engines' events."""

    def __init__(self, settings: IndexSettings | None = None) -> None:
        self.settings = settings or IndexSettings()
        self.block_size: int | None = None
        self._views: dict[ViewId, _View] = {}
        # our key -> view -> the view's engine hashes that map to it (almost always one)
        self._holders: dict[Key, dict[ViewId, list[BlockHash]]] = {}
        # (view, engine hash) -> our key, in least-recently-used order
        self._lru: OrderedDict[tuple[ViewId, BlockHash], Key] = OrderedDict()
        self._pending: dict[Key, dict[ViewId, float]] = {}
        self._pending_order: deque[tuple[float, ViewId, Key]] = deque()
        self._counters = _Counters()

    # -- views -------------------------------------------------------------------------

    def view_state(self, view: ViewId) -> ViewState | None:
        """None for a view the index has never heard of."""
        found = self._views.get(view)
        return None if found is None else found.state

    def view_reason(self, view: ViewId) -> str | None:
        """Why a view is unknown (None when known or absent)."""
        found = self._views.get(view)
        return None if found is None or found.state is ViewState.KNOWN else found.reason

    def mark_unknown(self, view: ViewId, reason: str) -> None:
        """Stop reporting the view's holdings until something rebuilds it. Its entries
        stay (a later `AllBlocksCleared` or `clear_view` drops them)."""
        found = self._view(view)
        found.state = ViewState.UNKNOWN
        found.reason = reason

    def mark_known(self, view: ViewId) -> None:
        found = self._view(view)
        found.state = ViewState.KNOWN
        found.reason = None

    def clear_view(self, view: ViewId) -> None:
        """Drop every block of the view; its state is unchanged."""
        found = self._views.get(view)
        if found is None:
            return
        for engine_hash, held in list(found.hashes.items()):
            self._drop(view, found, engine_hash, held)
        for key in list(found.pending):
            self._unpend(key, view, found)
        found.evicted = 0

    def forget_worker(self, worker_id: str) -> None:
        """Drop every view of a worker that left the fleet."""
        for view in [v for v in self._views if v[0] == worker_id]:
            self.clear_view(view)
            del self._views[view]

    # -- events ------------------------------------------------------------------------

    def apply(self, view: ViewId, events: Sequence[KvEvent]) -> None:
        """Apply one batch's events to a view, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self.apply_stored(view, event)
            elif isinstance(event, BlockRemoved):
                self.apply_removed(view, event)
            elif isinstance(event, AllBlocksCleared):
                self.apply_cleared(view)

    def apply_stored(self, view: ViewId, event: BlockStored) -> None:
        found = self._view(view)
        count = len(event.block_hashes)
        if event.medium not in _INDEXED_MEDIA or event.group_idx not in (None, 0):
            self._counters.ignored_blocks += count
            return
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            # Keys over different token windows never match: this view cannot be read.
            self._inconsistent(view, f"block size {event.block_size} != {self.block_size}")
            return
        size = self.block_size
        if len(event.token_ids) != count * size:
            self._inconsistent(view, "BlockStored token_ids do not cover its blocks")
            return
        if event.parent_block_hash is None:
            parent = _ROOT
        else:
            held = found.hashes.get(event.parent_block_hash)
            if held is None:
                self._counters.orphan_blocks += count
                if found.evicted == 0:
                    # With nothing evicted, an unknown parent means a lost event.
                    self.mark_unknown(view, "BlockStored parent not held")
                return
            parent = held.key
        extras = event.extra_keys
        # Engines from before `lora_name` send only the adapter's numeric id: keyed by it,
        # such blocks never collide with the base model's (and match no request by name).
        lora: str | int | None = event.lora_name if event.lora_name is not None else event.lora_id
        try:
            keys = []
            for i in range(count):
                parent = chain_key(
                    parent,
                    event.token_ids[i * size : (i + 1) * size],
                    lora,
                    None if extras is None else extras[i],
                )
                keys.append(parent)
        except (OverflowError, TypeError):
            # A token id beyond 64 bits, or an extra key msgpack cannot encode.
            self._inconsistent(view, "BlockStored tokens or extra keys cannot be keyed")
            return
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            self._add(view, found, engine_hash, key)
        self._counters.stored_blocks += count

    def apply_removed(self, view: ViewId, event: BlockRemoved) -> None:
        found = self._view(view)
        if event.medium not in _INDEXED_MEDIA or event.group_idx not in (None, 0):
            self._counters.ignored_blocks += len(event.block_hashes)
            return
        for engine_hash in event.block_hashes:
            held = found.hashes.get(engine_hash)
            if held is None:
                self._counters.unknown_removals += 1
                continue
            self._counters.removed_blocks += 1
            if held.count > 1:
                # The engine caches duplicate blocks of one hash; each is removed alone.
                held.count -= 1
            else:
                self._drop(view, found, engine_hash, held)

    def apply_cleared(self, view: ViewId) -> None:
        """The engine dropped its whole cache: the view is empty, and known from here."""
        self._view(view)
        self.clear_view(view)
        self.mark_known(view)
        self._counters.cleared += 1

    # -- requests ----------------------------------------------------------------------

    def block_keys(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKey | None] | None = None,
    ) -> list[Key]:
        """Our keys for the request's full blocks; empty while the block size is unknown.
        `extra_keys`, when given, has one entry per full block, built as the engine
        builds them (multimodal ids, cache salt, ...)."""
        size = self.block_size
        if size is None:
            return []
        count = len(token_ids) // size
        # One conversion for the whole prompt, then a slice per block: this runs per
        # request.
        data = array("q", token_ids[: count * size]).tobytes()
        width = size * 8
        plain = lora_name is None and extra_keys is None
        keys: list[Key] = []
        parent = _ROOT
        for i in range(count):
            if plain:
                suffix = _PLAIN_SUFFIX
            else:
                extra = None if extra_keys is None or i >= len(extra_keys) else extra_keys[i]
                suffix = _suffix(lora_name, extra)
            parent = _chain(parent, data[i * width : (i + 1) * width], suffix)
            keys.append(parent)
        return keys

    def match(self, keys: Sequence[Key], now: float) -> MatchResult:
        """Per known view, how many of `keys` it holds consecutively from the first;
        blocks noted by `note_routed` within the TTL count as held. The blocks of the
        returned runs become the most recently used."""
        self._expire(now)
        runs: dict[ViewId, int] = {}
        unknown: set[ViewId] = set()
        for view, found in self._views.items():
            if found.state is ViewState.KNOWN:
                runs[view] = 0
            else:
                unknown.add(view)
        running = list(runs)
        depth = 0
        for key in keys:
            holders = self._holders.get(key)
            pending = self._pending.get(key)
            if holders is None and pending is None:
                break
            still: list[ViewId] = []
            for view in running:
                engine_hashes = None if holders is None else holders.get(view)
                if engine_hashes is not None:
                    self._lru.move_to_end((view, engine_hashes[0]))
                    still.append(view)
                elif pending is not None and pending.get(view, now) > now:
                    still.append(view)
                else:
                    runs[view] = depth
            running = still
            if not running:
                break
            depth += 1
        for view in running:
            runs[view] = depth
        return MatchResult(blocks=len(keys), runs=runs, unknown=frozenset(unknown))

    def note_routed(
        self, keys: Sequence[Key], worker_id: str, dp_rank: int | None, now: float
    ) -> None:
        """Count `keys` as held by the view for the TTL: the engine will store them, but
        its events arrive after the next requests of a burst are routed."""
        view: ViewId = (worker_id, dp_rank)
        found = self._views.get(view)
        if found is None:
            return
        self._expire(now)
        expiry = now + self.settings.pending_ttl_s
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None and view in holders:
                continue
            self._pending.setdefault(key, {})[view] = expiry
            found.pending.add(key)
            self._pending_order.append((expiry, view, key))
        while len(self._pending_order) > self.settings.max_pending:
            self._expire_first()

    # -- sizes -------------------------------------------------------------------------

    def __len__(self) -> int:
        """(view, block) entries held: the index-size gauge."""
        return len(self._lru)

    def statistics(self) -> IndexStatistics:
        c = self._counters
        known = sum(1 for v in self._views.values() if v.state is ViewState.KNOWN)
        return IndexStatistics(
            entries=len(self._lru),
            views_known=known,
            views_unknown=len(self._views) - known,
            block_size=self.block_size,
            pending=sum(len(v) for v in self._pending.values()),
            stored_blocks=c.stored_blocks,
            removed_blocks=c.removed_blocks,
            cleared=c.cleared,
            evicted_entries=c.evicted_entries,
            orphan_blocks=c.orphan_blocks,
            ignored_blocks=c.ignored_blocks,
            unknown_removals=c.unknown_removals,
            inconsistent_events=c.inconsistent_events,
        )

    # -- internals ---------------------------------------------------------------------

    def _view(self, view: ViewId) -> _View:
        found = self._views.get(view)
        if found is None:
            found = self._views[view] = _View()
        return found

    def _inconsistent(self, view: ViewId, reason: str) -> None:
        self._counters.inconsistent_events += 1
        self.mark_unknown(view, reason)

    def _add(self, view: ViewId, found: _View, engine_hash: BlockHash, key: Key) -> None:
        held = found.hashes.get(engine_hash)
        if held is not None and held.key == key:
            held.count += 1
            self._lru.move_to_end((view, engine_hash))
            return
        if held is not None:
            # The same engine hash over different tokens: the newer store wins.
            self._drop(view, found, engine_hash, held)
        found.hashes[engine_hash] = _Held(key)
        self._holders.setdefault(key, {}).setdefault(view, []).append(engine_hash)
        self._lru[(view, engine_hash)] = key
        if key in found.pending:
            self._unpend(key, view, found)
        while len(self._lru) > self.settings.max_entries:
            (old_view, old_hash), _ = next(iter(self._lru.items()))
            old = self._views[old_view]
            self._drop(old_view, old, old_hash, old.hashes[old_hash])
            old.evicted += 1
            self._counters.evicted_entries += 1

    def _drop(self, view: ViewId, found: _View, engine_hash: BlockHash, held: _Held) -> None:
        key = held.key
        del found.hashes[engine_hash]
        del self._lru[(view, engine_hash)]
        holders = self._holders[key]
        engine_hashes = holders[view]
        engine_hashes.remove(engine_hash)
        if not engine_hashes:
            del holders[view]
            if not holders:
                del self._holders[key]

    def _unpend(self, key: Key, view: ViewId, found: _View) -> None:
        found.pending.discard(key)
        pending = self._pending.get(key)
        if pending is not None:
            pending.pop(view, None)
            if not pending:
                del self._pending[key]

    def _expire(self, now: float) -> None:
        order = self._pending_order
        while order and order[0][0] <= now:
            self._expire_first()

    def _expire_first(self) -> None:
        expiry, view, key = self._pending_order.popleft()
        pending = self._pending.get(key)
        # A later note_routed of the same key has its own, later, entry.
        if pending is not None and pending.get(view) == expiry:
            found = self._views.get(view)
            if found is not None:
                self._unpend(key, view, found)
            else:
                del pending[view]
                if not pending:
                    del self._pending[key]


def chain_key(
    parent: Key, tokens: Sequence[int], lora_name: str | int | None, extra: ExtraKey | None
) -> Key:
    """Our key of one full block: depends on the whole prefix through `parent`, never on
    an engine's hash seed."""
    return _chain(parent, array("q", tokens).tobytes(), _suffix(lora_name, extra))


def _suffix(lora_name: str | int | None, extra: ExtraKey | None) -> bytes:
    if lora_name is None and extra is None:
        return _PLAIN_SUFFIX
    return msgspec.msgpack.encode((lora_name, extra))


def _chain(parent: Key, tokens: bytes, suffix: bytes) -> Key:
    # parent (16 bytes) + the block's token ids as int64 + msgpack((lora, extra keys))
    return hashlib.blake2b(parent + tokens + suffix, digest_size=16).digest()
