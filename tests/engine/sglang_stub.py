"""A stand-in for ``python -m sglang.launch_server`` speaking SGLang's documented HTTP shapes.

Used by test_sglang_adapter.py (SGLang cannot run on CPU machines). Behaviour knobs, from the
environment: STUB_ARGV_FILE (write argv and pid there as JSON), STUB_STARTUP_DELAY (seconds of 503 on
/health), STUB_EXIT_CODE (exit at once with that code), STUB_IGNORE_SIGTERM=1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=30000)
parser.add_argument("--weight-version", default="default")
args, _unknown = parser.parse_known_args()

if os.environ.get("STUB_ARGV_FILE"):
    Path(os.environ["STUB_ARGV_FILE"]).write_text(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}))
if os.environ.get("STUB_EXIT_CODE"):
    print("stub: failing on purpose", file=sys.stderr)
    sys.exit(int(os.environ["STUB_EXIT_CODE"]))
if os.environ.get("STUB_IGNORE_SIGTERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

STATE = {"weight_version": args.weight_version, "ready_at": time.monotonic() + float(os.environ.get("STUB_STARTUP_DELAY", "0"))}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a) -> None:
        pass

    def _send(self, status: int, body: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200 if time.monotonic() >= STATE["ready_at"] else 503)
        elif self.path == "/get_weight_version":
            self._send(200, {"weight_version": STATE["weight_version"]})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/update_weights_from_disk":
            if not os.path.isdir(body.get("model_path", "")):
                self._send(400, {"success": False, "message": f"Failed to get weights iterator: {body.get('model_path')}", "num_paused_requests": 0})
                return
            if body.get("weight_version") is not None:
                STATE["weight_version"] = body["weight_version"]
            self._send(200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})
        elif self.path == "/v1/chat/completions":
            ids = body.get("input_ids") or [1]
            out = [(i * 7 + 3) % 256 for i in ids[-3:]]
            logprobs = [[-0.5 - i / 128, t] for i, t in enumerate(out)]
            meta = {"id": "stub", "finish_reason": {"type": "length"}, "prompt_tokens": len(ids), "completion_tokens": len(out),
                    "output_token_logprobs": logprobs, "weight_version": STATE["weight_version"]}
            choice = {"index": 0, "message": {"role": "assistant", "content": "abc"}, "finish_reason": "length", "meta_info": meta}
            self._send(200, {"id": "stub", "object": "chat.completion", "choices": [choice]})
        else:
            self._send(404, {"detail": "Not Found"})


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
