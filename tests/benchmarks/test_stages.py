"""`python -m bench --stages` stays runnable: each stage and parser benchmark runs once,
and the upstream parsers it weighs (before and now) read its bytes alike. No timing is
asserted: figures belong to the benchmark."""

from __future__ import annotations

from bench import stages
from bench.upstream_before import HandWrittenChunked, parse_head_by_hand
from router.http.upstream.parser import UpstreamParser


def test_every_stage_runs() -> None:
    names = [stage.name for stage in stages.stages()]
    assert "upstream parse" in names
    for stage in stages.stages():
        assert stage.run() is not None, stage.name


def test_the_upstream_parsers_before_and_now_read_the_benchmarks_bytes_alike() -> None:
    end = stages.RESPONSE.find(b"\r\n\r\n")
    assert parse_head_by_hand(stages.RESPONSE[:end]) == UpstreamParser().parse_head(
        stages.RESPONSE[: end + 4]
    )
    assert parse_head_by_hand(stages.STREAM_HEAD[:-4]) == UpstreamParser().parse_head(
        stages.STREAM_HEAD
    )
    by_hand = HandWrittenChunked()
    with_llhttp = UpstreamParser()
    with_llhttp.parse_head(stages.STREAM_HEAD)
    with_llhttp.expect_chunked()
    for _ in range(3):
        assert (
            by_hand.take(stages.SSE_CHUNK)
            == with_llhttp.feed_chunked(stages.SSE_CHUNK)
            == stages.SSE_EVENT
        )
    assert by_hand.take(b"0\r\n\r\n") == with_llhttp.feed_chunked(b"0\r\n\r\n") == b""
    assert by_hand.ended and with_llhttp.complete and not with_llhttp.beyond
    # Each benchmark closure checks its own output.
    stages._sse_chunk_by_hand()()
    stages._sse_chunk_with_llhttp()()
