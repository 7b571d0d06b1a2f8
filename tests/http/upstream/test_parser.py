"""A worker's response parsed by llhttp behind our checks, held against h11 as a reference:
a head we take, h11 takes alike; a chunked body decodes alike however its bytes arrive;
bytes after its end are seen whatever they are; what llhttp lets through is refused."""

from __future__ import annotations

import itertools
import tracemalloc

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http.upstream.exceptions import UpstreamProtocolError
from router.http.upstream.parser import UpstreamParser

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def parse(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], bool]:
    return UpstreamParser().parse_head(head)


def h11_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]]] | None:
    """How h11, as a client after a GET, reads `head`: status and headers, or None."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="GET", target="/", headers=[("host", "w")]))
    connection.send(h11.EndOfMessage())
    connection.receive_data(head)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    assert isinstance(event, h11.Response | h11.InformationalResponse), event
    return event.status_code, [(name, value) for name, value in event.headers]


def chunked_parser() -> UpstreamParser:
    parser = UpstreamParser()
    assert parser.parse_head(CHUNKED_HEAD)[0] == 200
    parser.expect_chunked()
    return parser


def decode(pieces: list[bytes]) -> tuple[bytes, bool, bool]:
    """Feeds `pieces` one read each; the body, whether it ended, and bytes beyond it."""
    parser = chunked_parser()
    body = b""
    for piece in pieces:
        body += parser.feed_chunked(piece)
        if parser.complete:
            break
    return body, parser.complete, parser.beyond


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, *(cut for cut in cuts if cut < len(data)), len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


# -- the head -----------------------------------------------------------------------------

TOKEN = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789!#$%&'*+.^_`|~", min_size=1, max_size=8
).map(str.encode)
TEXT = st.lists(
    st.one_of(TOKEN, st.sampled_from([b" ", b"\t", b":", b",", b'"', b"/", b"\x80", b"\xff"])),
    max_size=4,
).map(b"".join)
ODD_BYTES = [
    b"\x00",
    b"\x01",
    b"\x7f",
    b"\r",
    b"\n",
    b"\x0b",
    b"\x1f",
    b" ",
    b"\t",
    b":",
    b"\xff",
    b"0",
    b"/",
    b"\r\n",
    b"\r\n ",
]


@st.composite
def valid_heads(draw: st.DrawFn) -> bytes:
    """What a worker sends: HTTP/1.x, a status of 100-599, token names, text values (no
    framing headers: those are the connection's to judge, tested over a socket)."""
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    reason = draw(st.sampled_from([b"", b" "])) + draw(TEXT)
    lines = [
        version + b" %d" % draw(st.integers(100, 599)) + (reason and b" " + reason.lstrip(b" "))
    ]
    for _ in range(draw(st.integers(0, 5))):
        lines.append(draw(TOKEN) + draw(st.sampled_from([b":", b": ", b":\t"])) + draw(TEXT))
    return b"\r\n".join(lines).rstrip(b"\r") + b"\r\n\r\n"


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """Valid heads, and valid heads with a byte replaced or inserted anywhere, or their
    version or status changed."""
    head = bytearray(draw(valid_heads()))
    for _ in range(draw(st.integers(0, 2))):
        position = draw(st.integers(0, len(head) - 5))
        action = draw(st.sampled_from(["replace", "insert", "version", "status"]))
        if action == "replace":
            head[position : position + 1] = draw(st.sampled_from(ODD_BYTES))
        elif action == "insert":
            head[position:position] = draw(st.sampled_from(ODD_BYTES))
        elif action == "version":
            head[:8] = draw(
                st.sampled_from([b"HTTP/2.0", b"HTTP/0.9", b"http/1.1", b"HTTP/1.2", b"HTTP/1"])
            )
        elif head[9:12].isdigit():
            head[9:12] = draw(
                st.sampled_from([b"000", b"099", b"600", b"999", b"2x0", b"20", b"2000"])
            )
    # The connection cuts a head at its first CRLF CRLF: nothing else reaches the parser.
    return bytes(head).split(b"\r\n\r\n")[0] + b"\r\n\r\n"


@settings(max_examples=400, deadline=None)
@given(head=heads())
def test_a_head_we_take_h11_takes_alike(head: bytes) -> None:
    try:
        status, headers, keep_alive = parse(head)
    except UpstreamProtocolError as refused:
        assert refused.response_started is True
        return
    assert h11_head(head) == (status, headers)
    assert keep_alive is head.startswith(b"HTTP/1.1 ")


def test_a_typical_head_keeps_names_lowered_values_trimmed_and_order() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad:  v w \t\r\nx-empty:\r\n"
        b"X-Obs: caf\xc3\xa9\r\nDate: Mon, 30 Nov 2026 12:00:00 GMT\r\n\r\n"
    )
    assert parse(head) == (
        200,
        [
            (b"content-type", b"application/json"),
            (b"x-pad", b"v w"),
            (b"x-empty", b""),
            (b"x-obs", b"caf\xc3\xa9"),
            (b"date", b"Mon, 30 Nov 2026 12:00:00 GMT"),
        ],
        True,
    )
    assert parse(b"HTTP/1.0 204 No Content\r\n\r\n") == (204, [], False)
    assert parse(b"HTTP/1.1 100\r\n\r\n") == (100, [], True)
    # llhttp hands a 101's connection over at its head: parsed whole, for the caller to refuse.
    switching = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n"
    assert parse(switching) == (101, [(b"upgrade", b"h2c"), (b"connection", b"upgrade")], True)


# What llhttp takes and the worker edge does not: our checks in front of it refuse these.
REFUSED_IN_FRONT = {
    "HTTP/2.0": b"HTTP/2.0 200 OK\r\n\r\n",
    "HTTP/0.9": b"HTTP/0.9 200 OK\r\n\r\n",
    "status 000": b"HTTP/1.1 000 Zero\r\n\r\n",
    "status 099": b"HTTP/1.1 099 Low\r\n\r\n",
    "status 600": b"HTTP/1.1 600 High\r\n\r\n",
    "status 999": b"HTTP/1.1 999 Nope\r\n\r\n",
    "two-digit status": b"HTTP/1.1 55\r\n\r\n",
    "NUL in the reason": b"HTTP/1.1 200 O\x00K\r\n\r\n",
    "control byte in the reason": b"HTTP/1.1 200 O\x01K\r\n\r\n",
    "DEL in the reason": b"HTTP/1.1 200 O\x7fK\r\n\r\n",
}
# What llhttp refuses itself.
REFUSED_BY_LLHTTP = {
    "bare CR in the status line": b"HTTP/1.1 200 OK\rHTTP/1.1 200 OK\r\n\r\n",
    "no colon": b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    "space before the colon": b"HTTP/1.1 200 OK\r\nname : v\r\n\r\n",
    "obs-fold": b"HTTP/1.1 200 OK\r\nx-a: b\r\n folded\r\n\r\n",
    "control byte in a value": b"HTTP/1.1 200 OK\r\nx-a: b\x1fc\r\n\r\n",
    "DEL in a value": b"HTTP/1.1 200 OK\r\nx-a: b\x7fc\r\n\r\n",
    "bare CR in a value": b"HTTP/1.1 200 OK\r\nx-a: b\rc\r\n\r\n",
    "bare LF line end": b"HTTP/1.1 200 OK\r\nx-a: b\nx-b: c\r\n\r\n",
    "a bad field beside two content-lengths": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\nx-a: \x01\r\n\r\n"
    ),
    "a bad content-length value beside another": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\x01\r\n\r\n"
    ),
}


@pytest.mark.parametrize(
    "head",
    [*REFUSED_IN_FRONT.values(), *REFUSED_BY_LLHTTP.values()],
    ids=[*REFUSED_IN_FRONT, *REFUSED_BY_LLHTTP],
)
def test_a_malformed_head_is_refused_as_a_started_response(head: bytes) -> None:
    with pytest.raises(UpstreamProtocolError) as refused:
        parse(head)
    assert refused.value.response_started is True


@pytest.mark.parametrize(
    ("head", "lengths"),
    [
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-a: 1\r\nContent-Length: 2\r\n\r\n",
            [b"2", b"2"],
        ),
        (b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 2, 2\r\n\r\n", [b"2, 2"]),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\nx-a: 1\r\n\r\n",
            [b"2", b"3"],
        ),
        (
            b"HTTP/1.1 204 No Content\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
            [b"2"],
        ),
    ],
)
def test_content_lengths_llhttp_refuses_reach_the_framing_logic_in_place(
    head: bytes, lengths: list[bytes]
) -> None:
    """llhttp refuses a content-length sent twice (even one value) and one beside
    transfer-encoding; the connection's framing logic judges those, so the fields come
    back as sent, in their places."""
    _, headers, _ = parse(head)
    assert [value for name, value in headers if name == b"content-length"] == lengths
    assert [name for name, _ in headers] == [
        line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:-2]
    ]


# -- the chunked body ---------------------------------------------------------------------

EXTENSIONS = st.sampled_from([b"", b";a", b";a=b", b';a="q \\" r"', b" ", b"\t"])


@st.composite
def chunked_bodies(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A body and its chunked encoding: sizes in any case and zero-padded, extensions,
    trailers."""
    body = b""
    encoded = b""
    for data in draw(st.lists(st.binary(min_size=1, max_size=40), max_size=5)):
        size = draw(st.sampled_from([b"%x", b"%X", b"00%x"])) % len(data)
        encoded += size + draw(EXTENSIONS) + b"\r\n" + data + b"\r\n"
        body += data
    trailers = draw(st.sampled_from([b"", b"x-t: 1\r\n", b"x-a: 1\r\nX-B:\r\n"]))
    return body, encoded + b"0" + draw(EXTENSIONS) + b"\r\n" + trailers + b"\r\n"


def h11_body(encoded: bytes) -> tuple[bytes, bytes] | None:
    """The body h11 decodes from a chunked response and what it leaves past its end."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="GET", target="/", headers=[("host", "w")]))
    connection.send(h11.EndOfMessage())
    connection.receive_data(CHUNKED_HEAD + encoded)
    body = b""
    try:
        while True:
            event = connection.next_event()
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return body, connection.trailing_data[0]
            elif event is h11.NEED_DATA:
                return None
    except h11.RemoteProtocolError:
        return None


@settings(max_examples=300, deadline=None)
@given(encoding=chunked_bodies(), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_a_chunked_body_decodes_as_h11_decodes_it_however_it_is_split(
    encoding: tuple[bytes, bytes], cuts: list[int]
) -> None:
    body, encoded = encoding
    assert h11_body(encoded) == (body, b"")
    assert decode(split(encoded, cuts)) == (body, True, False)


def test_spaces_before_a_chunk_extension_are_taken() -> None:
    """RFC 9112 section 7.1.1 allows BWS before the `;`; llhttp refuses it unless told
    (h11 refuses it too, where our parser before took it)."""
    assert decode([b"5 ;a=1\r\nhello\r\n0\t;z\r\n\r\n"]) == (b"hello", True, False)


def test_a_chunked_body_split_at_every_byte_decodes_alike() -> None:
    body = b'data: {"a":1}\n\ndata: [DONE]\n\n'
    encoded = (
        b"e;x=1\r\n"
        + body[:14]
        + b"\r\n"
        + b"%x\r\n" % (len(body) - 14)
        + body[14:]
        + b"\r\n0\r\nx-t: 1\r\n\r\n"
    )
    for first, second in itertools.combinations(range(1, len(encoded)), 2):
        assert decode(split(encoded, [first, second])) == (body, True, False), (first, second)


BEYOND = [
    b"\r\n",
    b"\n",
    b"\r",
    b"\r\n\r\n",
    b"X",
    b"\r\nX",
    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc",
    b"0\r\n\r\n",
]


@pytest.mark.parametrize("extra", BEYOND)
@pytest.mark.parametrize("trailer", [b"", b"x-t: 1\r\n"])
def test_bytes_after_the_last_chunk_are_seen_however_the_reads_fall(
    trailer: bytes, extra: bytes
) -> None:
    """llhttp skips CR and LF between messages without a callback: those are caught at the
    end of what was fed, anything else by the next message's start or an error."""
    encoded = b"5\r\nhello\r\n0\r\n" + trailer + b"\r\n"
    assert h11_body(encoded + extra) == (b"hello", extra)
    for cut in range(1, len(encoded + extra)):
        # Cut right at the end, the extra bytes come in a read of their own, never made:
        # the body has ended. (The pool finds such bytes before it reuses the connection.)
        seen_beyond = cut != len(encoded)
        assert decode(split(encoded + extra, [cut])) == (b"hello", True, seen_beyond), cut
    for cut in range(1, len(encoded)):
        assert decode(split(encoded, [cut])) == (b"hello", True, False), cut


def test_the_next_message_beyond_the_end_adds_nothing_to_the_body_nor_the_headers() -> None:
    parser = UpstreamParser()
    _, headers, _ = parser.parse_head(CHUNKED_HEAD)
    parser.expect_chunked()
    data = parser.feed_chunked(
        b"2\r\nok\r\n0\r\nx-t: 1\r\n\r\nHTTP/1.1 200 OK\r\nx-b: 2\r\ncontent-length: 3\r\n\r\nabc"
    )
    assert (data, parser.complete, parser.beyond) == (b"ok", True, True)
    assert headers == [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]


MALFORMED_CHUNKING = {
    "size not hex": b"zz\r\n",
    "negative size": b"-1\r\n",
    "0x prefix": b"0x5\r\nhello\r\n",
    "size over 64 bits": b"fffffffffffffffff\r\n",
    "space before the size": b" 5\r\nhello\r\n",
    "space after the extension's semicolon": b"5; a\r\nhello\r\n",
    "NUL in an extension": b"5;a\x00\r\nhello\r\n",
    "unterminated quoted extension": b'5;a="q\r\nhello\r\n',
    "bare LF after the size": b"5\nhello\r\n",
    "data not followed by CRLF": b"5\r\nhelloXX",
    "bare LF ends the body": b"0\r\n\n",
    "malformed trailer": b"0\r\nbad trailer\r\n\r\n",
    "control byte in a trailer": b"0\r\nx: a\x01b\r\n\r\n",
    "content-length in the trailer": b"0\r\ncontent-length: 5\r\n\r\n",
}


@pytest.mark.parametrize("encoded", MALFORMED_CHUNKING.values(), ids=MALFORMED_CHUNKING.keys())
def test_malformed_chunking_is_refused_as_a_started_response(encoded: bytes) -> None:
    parser = chunked_parser()
    with pytest.raises(UpstreamProtocolError) as refused:
        parser.feed_chunked(encoded)
    assert refused.value.response_started is True


def test_a_body_llhttp_does_not_read_as_chunked_is_refused_at_its_first_bytes() -> None:
    """Our framing logic takes `chunked` followed by a tab (whitespace around a value is
    not part of it); llhttp does not, and would hand the framing over as data. Refused
    rather than relayed as a body of size lines."""
    for first_read in [b"5", b"5\r\nhello\r\n0\r\n\r\n"]:
        parser = UpstreamParser()
        _, headers, _ = parser.parse_head(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\t\r\n\r\n"
        )
        assert headers == [(b"transfer-encoding", b"chunked")]
        parser.expect_chunked()
        with pytest.raises(UpstreamProtocolError, match="not read as chunked") as refused:
            parser.feed_chunked(first_read)
        assert refused.value.response_started is True


def test_trailers_are_not_kept() -> None:
    """A trailer section of tiny fields is 64 KiB of tuples if kept: ~2.5 MB."""
    parser = chunked_parser()
    assert parser.feed_chunked(b"2\r\nok\r\n0\r\n") == b"ok"
    tracemalloc.start()
    try:
        for _ in range(15):
            assert parser.feed_chunked(b"a:\r\n" * 1000) == b""
        assert parser.feed_chunked(b"\r\n") == b""
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parser.complete and not parser.beyond
    assert peak < 200_000, peak


@pytest.mark.parametrize(
    "framing",
    [b"5;" + b"a" * 70_000, b"0\r\n" + b"x-t: 1\r\n" * 9000],
    ids=["endless extension", "endless trailer"],
)
def test_framing_without_data_is_bounded(framing: bytes) -> None:
    """llhttp buffers none of it, so memory is not at stake; a worker spinning our CPU on
    bytes that carry no data is refused past 64 KiB of them."""
    parser = chunked_parser()
    assert parser.feed_chunked(b"2\r\nok\r\n") == b"ok"
    with pytest.raises(UpstreamProtocolError, match="without data") as refused:
        for piece in split(framing, list(range(0, len(framing), 4096))):
            assert parser.feed_chunked(piece) == b""
    assert refused.value.response_started is True
    # Data between them starts the count again.
    parser = chunked_parser()
    for _ in range(40):
        assert parser.feed_chunked(b"1;" + b"a" * 4000 + b"\r\nx\r\n") == b"x"
