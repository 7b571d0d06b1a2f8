"""The pace of a fake stream: its events in order, with the pauses between them."""

from __future__ import annotations

from collections.abc import Iterator

from router.fake_worker.behaviour import Behaviour
from router.fake_worker.formats import StreamFrames
from router.fake_worker.stats import RankLoad


def paced_events(
    frames: StreamFrames, behaviour: Behaviour, load: RankLoad
) -> Iterator[bytes | float]:
    """The stream's events in order, with a float (seconds to sleep) wherever the pace needs a
    pause: the time to first token, then the latency between tokens. Counts the tokens into
    `load` as they are taken."""
    gen = frames.gen
    ttft_s = behaviour.ttft_ms / 1000 + gen.prefill_s
    between_s = behaviour.token_latency_ms / 1000
    if ttft_s > 0:
        yield ttft_s
    yield from frames.head()
    for i in range(gen.tokens):
        if i and between_s > 0:
            yield between_s
        for choice in range(gen.n):
            yield frames.token(i, choice)
        load.generation_tokens += gen.n
    yield from frames.tail()
