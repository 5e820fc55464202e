"""A server process that dies under its first completion request, as an engine crashing on a
kernel would: it answers ``/health`` and ``/v1/models``, then exits with status 7 mid-request.

Run as ``python tests/dying_server.py PORT``; used by the probe's robustness test.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/health": {}, "/v1/models": {"object": "list", "data": [{"id": "dying"}]}}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def do_POST(self) -> None:
        print(f"fatal: simulated kernel crash under {self.path}", flush=True)
        os._exit(7)


if __name__ == "__main__":
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
