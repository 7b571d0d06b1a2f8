"""An approximate radix tree of request text whose tenants are workers.

It remembers which worker was sent which text, so that `cache_aware` can send a request
to the worker most likely to hold its prefix in KV cache. Each edge holds a run of
characters; each node holds the set of tenants whose inserted texts pass through it.
Invariant: a tenant present on a node is present on every ancestor of it, so the deepest
node on a request's path that names a tenant gives that tenant's longest common prefix
with everything it was sent.

Memory is bounded: the characters held on edges never exceed `max_chars` after an insert
returns. When an insert goes over, the least recently used leaves are dropped (every
tenant at once) until the tree holds at most `LOW_WATER` of the budget, so the cost of an
eviction pass is spread over the many inserts that refill the headroom. "Recently used"
is a logical tick bumped by every insert, never a clock.

Pure and synchronous: nothing here blocks or reads time.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from typing import Final

LOW_WATER: Final = 0.9


class _Node:
    __slots__ = ("children", "edge", "last_used", "parent", "tenants")

    def __init__(self, edge: str, parent: _Node | None, last_used: int) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: set[str] = set()
        self.last_used = last_used


class PrefixTree:
    """Text per tenant, matched by longest common prefix, bounded to `max_chars`."""

    __slots__ = ("_root", "_sizes", "_tick", "chars", "evicted_chars", "max_chars", "nodes")

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be at least 1, got {max_chars}")
        self.max_chars = max_chars
        self._root = _Node("", None, 0)
        self._sizes: dict[str, int] = {}
        self._tick = 0
        self.chars = 0
        """Characters held on edges now (the memory the budget bounds)."""
        self.nodes = 0
        self.evicted_chars = 0

    def tenant_size(self, tenant: str) -> int:
        """Characters on the nodes that name `tenant` (0 for an unknown tenant)."""
        return self._sizes.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._sizes)

    def match(self, text: str, tenants: Collection[str]) -> dict[str, int]:
        """For each of `tenants`: the length of the longest common prefix of `text` with any
        text inserted for it (0 when none shares a first character)."""
        found = dict.fromkeys(tenants, 0)
        if not found:
            return found
        node = self._root
        pos = 0
        size = len(text)
        # (characters matched at this node, node) along the path, shallowest first.
        path: list[tuple[int, _Node]] = []
        while pos < size:
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.edge
            if text.startswith(edge, pos):
                pos += len(edge)
                path.append((pos, child))
                node = child
                continue
            pos += _common_length(text, pos, edge)
            path.append((pos, child))
            break
        missing = set(found)
        for matched, step in reversed(path):
            hit = missing & step.tenants
            for tenant in hit:
                found[tenant] = matched
            missing -= hit
            if not missing:
                break
        return found

    def insert(self, text: str, tenant: str) -> None:
        """Remember that `text` was sent to `tenant`, then evict to the budget if needed.

        A text longer than the budget is cut to the budget: it could not be kept whole.
        """
        if len(text) > self.max_chars:
            text = text[: self.max_chars]
        self._tick += 1
        tick = self._tick
        node = self._root
        node.last_used = tick
        self._add_tenant(node, tenant)
        pos = 0
        size = len(text)
        while pos < size:
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node, tick)
                node.children[text[pos]] = leaf
                self.nodes += 1
                self.chars += size - pos
                self._add_tenant(leaf, tenant)
                break
            edge = child.edge
            if not text.startswith(edge, pos):
                child = self._split(child, _common_length(text, pos, edge))
            child.last_used = tick
            self._add_tenant(child, tenant)
            pos += len(child.edge)
            node = child
        if self.chars > self.max_chars:
            self._evict(int(self.max_chars * LOW_WATER))

    def forget(self, tenant: str) -> None:
        """Drop `tenant` everywhere; nodes no tenant names any more go with it."""
        if tenant not in self._sizes:
            return
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.tenants.discard(tenant)
            for key, child in list(node.children.items()):
                if tenant not in child.tenants:
                    continue
                if len(child.tenants) == 1:
                    # By the invariant no descendant names another tenant: drop the subtree.
                    del node.children[key]
                    self._drop_subtree(child)
                else:
                    stack.append(child)
        del self._sizes[tenant]

    # -- internals ----------------------------------------------------------------------

    def _add_tenant(self, node: _Node, tenant: str) -> None:
        if tenant not in node.tenants:
            node.tenants.add(tenant)
            self._sizes[tenant] = self._sizes.get(tenant, 0) + len(node.edge)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` characters; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.edge)
        upper = _Node(child.edge[:at], parent, child.last_used)
        upper.tenants = set(child.tenants)  # sizes unchanged: the same characters, cut in two
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        self.nodes += 1
        return upper

    def _drop_subtree(self, top: _Node) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._remove_chars(node)

    def _remove_chars(self, node: _Node) -> None:
        length = len(node.edge)
        self.chars -= length
        self.nodes -= 1
        for tenant in node.tenants:
            left = self._sizes[tenant] - length
            self._sizes[tenant] = left
        node.tenants = set()

    def _evict(self, target: int) -> None:
        """Drop least recently used leaves until at most `target` characters remain."""
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last_used, id(node), node))
        heapq.heapify(heap)
        while self.chars > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.evicted_chars += len(leaf.edge)
            self._remove_chars(leaf)
            if not parent.children and parent is not self._root:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        # The root names every tenant with text; a tenant left with none leaves the tree.
        for tenant in [name for name, size in self._sizes.items() if size == 0]:
            if not any(tenant in child.tenants for child in self._root.children.values()):
                self._root.tenants.discard(tenant)
                del self._sizes[tenant]


def _common_length(text: str, pos: int, edge: str) -> int:
    """How many leading characters of `edge` equal `text[pos:]` (less than len(edge)).

    A binary search over C-level `startswith` calls: far cheaper in Python than a
    character loop over a long edge.
    """
    low, high = 0, min(len(edge), len(text) - pos)
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(edge[:middle], pos):
            low = middle
        else:
            high = middle - 1
    return low
