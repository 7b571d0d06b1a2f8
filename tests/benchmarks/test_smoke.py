"""The bench harness runs end to end at a tiny size and writes well-formed output.

Only the shape of the output is checked, never a figure that depends on the machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[2]
CASES = ("unary-c1", "stream-c32")
CONTENDERS = ("direct", "ours", "trio-floor")
NUMBER = r"[\d,]+(?:\.\d+)?"


def test_the_load_generator_is_installed() -> None:
    # `make test` installs wrk (Debian's package); without it the harness cannot run.
    assert shutil.which("wrk"), "wrk is missing: run `make system-deps` (apt-get install -y wrk)"


def test_a_tiny_run_writes_the_table_ratios_chart_and_keeps_the_hand_written_text(
    tmp_path: Path,
) -> None:
    out = tmp_path / "perf.md"
    out.write_text(
        "# Perf\n\nWritten by hand.\n\n<!-- bench:results:start -->\nold figures\n"
        "<!-- bench:results:end -->\n\n<!-- bench:grpc:start -->\nold grpc figures\n"
        "<!-- bench:grpc:end -->\n\n## Analysis\n\nAlso by hand.\n"
    )
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--duration",
            "1",
            "--rounds",
            "1",
            "--contenders",
            ",".join(CONTENDERS),
            "--cases",
            ",".join(CASES),
            "--idle-streams",
            "100",
            "--grpc-contenders",
            "ours-grpc",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr + completed.stdout

    text = out.read_text()
    assert text.startswith("# Perf\n\nWritten by hand.\n")
    assert text.endswith("## Analysis\n\nAlso by hand.\n")
    assert "old figures" not in text
    assert text.count("<!-- bench:results:start -->") == 1
    # The gRPC rows, in their own block.
    assert "old grpc figures" not in text
    grpc = text.split("<!-- bench:grpc:start -->")[1].split("<!-- bench:grpc:end -->")[0]
    for case in ("unary-c32", "stream-c32"):
        (row,) = [line for line in grpc.splitlines() if line.startswith(f"| ours-grpc | {case} |")]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[3] == "0", row  # errors
        assert re.fullmatch(NUMBER, cells[4]) and cells[4] != "0", row  # req/CPU-s
    grpc_runs = orjson.loads(tmp_path.joinpath("perf-grpc.json").read_bytes())["rows"]
    assert {(r["contender"], r["case"]) for r in grpc_runs} == {
        ("ours-grpc", "unary-c32"),
        ("ours-grpc", "stream-c32"),
    }
    assert all(r["requests"] > 0 for r in grpc_runs)

    for case in CASES:
        for contender in CONTENDERS:
            rows = [
                line for line in text.splitlines() if line.startswith(f"| {case} | {contender} |")
            ]
            assert len(rows) == 1, (case, contender)
            cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
            assert len(cells) == 10
            assert re.fullmatch(NUMBER, cells[2]), cells  # req/s
            assert re.fullmatch(r"\*\*" + NUMBER + r"\*\*", cells[7]), cells  # req per CPU-s
    ratio = next(line for line in text.splitlines() if line.startswith("| ours / direct |"))
    assert re.fullmatch(rf"\| ours / direct \| {NUMBER} \| {NUMBER} \|", ratio)
    floor = next(line for line in text.splitlines() if line.startswith("| ours / trio-floor |"))
    assert re.fullmatch(rf"\| ours / trio-floor \| {NUMBER} \| {NUMBER} \|", floor)
    assert re.search(
        rf"Added p50 over direct at c=1 \(direct {NUMBER} ms\): ours [+-]{NUMBER} ms, "
        rf"trio-floor [+-]{NUMBER} ms\.",
        text,
    )
    assert re.search(
        rf"CPU per relayed SSE event, stream-c32: ours {NUMBER} us, trio-floor {NUMBER} us\.", text
    )
    verdicts = re.findall(
        r"^\| ours / smg req per CPU-s >= 0.85, (\S+) \| .* \| (.*) \|$", text, re.M
    )
    # smg was not among the contenders, nor unary c=32 among the cases.
    assert verdicts == [("unary-c32", "not measured"), ("stream-c32", "not measured")]
    assert "| ours | " in text.split("### Burst at c=256, then c=1")[1]
    assert re.search(r"100 of 100 SSE streams held open through `ours` \(0 failed", text)

    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](perf.png)" in text

    data = orjson.loads(out.with_suffix(".json").read_bytes())
    runs = data["measurements"]
    assert sorted((m["contender"], m["case"]) for m in runs) == sorted(
        (c, k) for c in CONTENDERS for k in CASES
    )
    assert all(m["requests"] > 0 and m["errors"] == 0 for m in runs)
    assert all(m["cpu_s"] > 0 for m in runs)
    assert [i["opened"] for i in data["idle"]] == [100]


def test_the_tracing_cost_bench_prints_both_figures() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.tracing_cost", "--iterations", "50", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert re.search(rf"^tracing off: {NUMBER} us per request", result.stdout, re.M), result.stdout
    assert re.search(rf"^tracing on:  {NUMBER} us per request", result.stdout, re.M), result.stdout
