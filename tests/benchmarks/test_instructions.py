"""`python -m bench --instructions`: where an answer ends on the wire, callgrind's parts,
and the idle work taken off each window."""

from __future__ import annotations

from pathlib import Path

from bench.baseline import Baseline
from bench.instructions import CASES, Count, _parts, answer_end, table


def test_an_answer_ends_at_its_length_or_its_last_chunk_and_not_before() -> None:
    unary = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx: y\r\n\r\nhello"
    assert answer_end(unary) == len(unary)
    assert answer_end(unary + b"HTTP/1.1 200") == len(unary)  # the next answer's start
    assert answer_end(unary[:-1]) == -1
    assert answer_end(unary[:20]) == -1
    stream = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    assert answer_end(stream) == len(stream)
    assert answer_end(stream[:-2]) == -1


def test_idle_work_is_taken_off_at_its_rate_over_the_windows_wall_time() -> None:
    count = Count("unary", requests=100, window=1_000_000, window_s=2.0, idle_per_s=50_000.0)
    assert count.per_request == 9_000.0


def test_the_parts_are_read_by_their_number_and_the_files_removed(tmp_path: Path) -> None:
    out = tmp_path / "callgrind-ours"
    for number, total in ((1, 700), (2, 900), (3, 50)):
        (tmp_path / f"callgrind-ours.{number}").write_bytes(
            b"# callgrind format\nversion: 1\npart: %d\nevents: Ir\nsummary: %d\ntotals: %d\n"
            % (number, total, total)
        )
    (tmp_path / "other.1").write_bytes(b"part: 9\nsummary: 1\n")
    assert _parts(out) == {1: 700, 2: 900, 3: 50}
    assert [p.name for p in tmp_path.iterdir()] == ["other.1"]


def test_the_table_gives_the_ratio_to_the_baseline_per_case() -> None:
    def counts(per_request: float) -> list[Count]:
        return [Count(case.name, 10, int(per_request * 10), 1.0, 0.0) for case in CASES]

    text = table({"ours": counts(900.0), "ours-base": counts(1000.0)}, None)
    assert "| unary, c=1 | 900 | 1,000 |" in text
    assert "ours / ours-base" not in text
    base = Baseline("main", "0123456789abcdef" * 2 + "01234567", Path("/tmp/tree"))
    text = table({"ours": counts(900.0), "ours-base": counts(1000.0)}, base)
    assert "| stream, c=1 | 900 | 1,000 | 0.9000 |" in text
    assert "ours-base: main (012345678)" in text
