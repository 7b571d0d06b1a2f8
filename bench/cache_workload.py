"""The shared-prefix workload of `python -m bench --cache`: multi-turn conversations.

Every conversation starts with the same system prompt; each turn sends the whole
conversation so far (system, every user message, every answer received) plus a new user
message. `users` clients run at once, each taking the next conversation and playing all
its turns in order, so conversations interleave across the fleet as a chat service's do.
Time to first token is measured by the client: from sending the request to the first
streamed content chunk.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import orjson
import trio

MODEL = "fake-model"
CHAT_PATH = "/v1/chat/completions"
_WORDS = (
    "fleet router worker cache prefix token prefill decode stream answer question model "
    "latency budget replica session context window engine queue batch page memory"
).split()


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 48
    turns: int = 12
    users: int = 8
    system_chars: int = 1500
    user_chars: int = 300
    answer_tokens: int = 8
    seed: int = 16

    def system_prompt(self) -> str:
        return _text(random.Random(self.seed), self.system_chars)

    def user_message(self, conversation: int, turn: int) -> str:
        return f"[{conversation}.{turn}] " + _text(
            random.Random(self.seed * 7919 + conversation * 131 + turn), self.user_chars
        )

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def working_set_bytes(self) -> int:
        """Bytes of distinct prompt text the fleet would have to hold to hit every time
        (the rendered fake-worker prompt, answers included; approximate)."""
        answer = len("".join(f"tok{i} " for i in range(self.answer_tokens)))
        per_turn = self.user_chars + 16 + len("<|user|>\n") + answer + len("<|assistant|>\n")
        return self.system_chars + len("<|system|>\n") + self.conversations * self.turns * per_turn


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


@dataclass
class ClientStats:
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0


async def play(
    url: str | Sequence[str], workload: Workload, *, model: str = MODEL, timeout_s: float = 60.0
) -> ClientStats:
    """Play every conversation against `url` (or several: the users take them in turn, as
    clients of router replicas behind a Service), asking for `model`; returns what the
    clients saw."""
    stats = ClientStats()
    system = workload.system_prompt()
    queue = list(range(workload.conversations))
    urls = [url] if isinstance(url, str) else list(url)
    limits = httpx.Limits(max_connections=workload.users, max_keepalive_connections=workload.users)
    clients = [httpx.AsyncClient(base_url=one, timeout=timeout_s, limits=limits) for one in urls]
    try:

        async def user(client: httpx.AsyncClient) -> None:
            while queue:
                conversation = queue.pop(0)
                await converse(client, workload, system, conversation, stats, model)

        async with trio.open_nursery() as nursery:
            for index in range(workload.users):
                nursery.start_soon(user, clients[index % len(clients)])
    finally:
        for client in clients:
            await client.aclose()
    return stats


async def converse(
    client: httpx.AsyncClient,
    workload: Workload,
    system: str,
    conversation: int,
    stats: ClientStats,
    model: str = MODEL,
) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(workload.turns):
        messages.append({"role": "user", "content": workload.user_message(conversation, turn)})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": workload.answer_tokens,
            "stream": True,
        }
        headers = {
            "x-session-id": f"conversation-{conversation}",
            "content-type": "application/json",
        }
        answer = await _stream_one(client, orjson.dumps(body), headers, stats)
        messages.append({"role": "assistant", "content": answer})


async def _stream_one(
    client: httpx.AsyncClient, body: bytes, headers: dict[str, str], stats: ClientStats
) -> str:
    stats.requests += 1
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    try:
        async with client.stream("POST", CHAT_PATH, content=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                stats.errors += 1
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if first is None:
                            first = time.perf_counter()
                        parts.append(content)
    except httpx.HTTPError:
        stats.errors += 1
        return ""
    if first is None:
        stats.errors += 1
    else:
        stats.ttft_s.append(first - started)
    return "".join(parts)


def percentile(values: Sequence[float], share: float) -> float:
    """The `share` quantile (nearest rank) of `values`; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))
    return ordered[index]
