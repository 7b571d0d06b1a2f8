"""A deliberately naive router for tests of the conformance runner: it forwards every
JSON request to its workers in turn and answers 500 to a body that is not JSON (the
mistake a Python peer makes), with no size limit.

    python stub_router.py --model m WORKER_URL...

Prints `stub router listening on http://127.0.0.1:PORT` once it serves (port 0 is
picked by the kernel).
"""

from __future__ import annotations

import argparse
import itertools
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")
    parser.add_argument("workers", nargs="+")
    args = parser.parse_args()
    turn = itertools.cycle(args.workers)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *values: object) -> None:
            return

        def answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self.answer(
                    200, json.dumps({"object": "list", "data": [{"id": args.model}]}).encode()
                )
            else:
                self.answer(404, b'{"error": {"message": "not found"}}')

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            try:
                json.loads(body)
            except ValueError:
                self.answer(
                    500, b'{"error": {"message": "internal error", "code": "internal_error"}}'
                )
                return
            request = urllib.request.Request(
                next(turn) + self.path,
                data=body,
                method="POST",
                headers={"content-type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    self.answer(
                        response.status, response.read(), response.headers.get("content-type", "")
                    )
            except urllib.error.HTTPError as failed:
                self.answer(failed.code, failed.read())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"stub router listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
