"""Header names checked once per distinct name, within a bound."""

from __future__ import annotations

from router.http.field_names import KNOWN_NAMES, known_name_count, lowered_field_name
from router.http.server.response_framing import ResponseError, encode_head
from router.http.upstream.request_encoding import encode_request


def test_a_name_is_lowered_and_a_bad_one_is_refused_every_time() -> None:
    assert lowered_field_name(b"X-Request-Id") == b"x-request-id"
    assert lowered_field_name(b"X-Request-Id") == b"x-request-id"  # from memory now
    for bad in (b"bad name", b"", b"x:y", b"caf\xc3\xa9", b"a\r\nb"):
        assert lowered_field_name(bad) is None
        assert lowered_field_name(bad) is None  # never remembered as good


def test_names_a_worker_invents_fill_the_memory_once_and_are_still_checked() -> None:
    for index in range(KNOWN_NAMES * 3):
        assert lowered_field_name(b"X-Made-Up-%d" % index) == b"x-made-up-%d" % index
    assert known_name_count() == KNOWN_NAMES
    assert lowered_field_name(b"x" * 10_000) == b"x" * 10_000  # long: checked, not kept
    assert known_name_count() == KNOWN_NAMES
    assert lowered_field_name(b"still bad") is None


def test_both_encoders_still_refuse_what_they_refused() -> None:
    for _ in range(2):  # the second time with the good names remembered
        try:
            encode_head(
                200,
                [(b"content-type", b"text/plain"), (b"bad name", b"v")],
                b"OK",
                method="GET",
                http_version=b"1.1",
                request_keep_alive=True,
            )
        except ResponseError:
            pass
        else:
            raise AssertionError("a bad response header name was written")
        for name, value in ((b"x-ok", b"a\r\nb"), (b"x-ok", b"a\x00"), (b"bad name", b"v")):
            try:
                encode_request("POST", "/v1/x", b"h", [(b"x-ok", b"v"), (name, value)], b"")
            except ValueError:
                continue
            raise AssertionError(f"sent {name!r}: {value!r}")
