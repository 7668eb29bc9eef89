"""A Standard Webhooks receiver for Tether's callback tests.

Every request that arrives is verified with the `standardwebhooks` package (the reference
implementation, not ours) and logged as one JSON line to the log file, whatever came of it:
{"webhook_id", "verified", "error", "status", "body"}. It answers 204 to a verified request,
401 to one whose signature does not verify, and 503 to the first --fail-first requests (a
receiver having a bad moment). A receiver that deduplicates by webhook-id keeps the first.

usage: receiver.py PORT LOG_FILE SECRET [--fail-first N]
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

port, log_path, secret = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fail_first = int(sys.argv[sys.argv.index("--fail-first") + 1]) if "--fail-first" in sys.argv else 0
hook = Webhook(secret)
lock = threading.Lock()
seen = {"n": 0}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        entry = {"webhook_id": headers.get("webhook-id"), "verified": False, "error": None,
                 "body": body.decode("utf-8", "replace")}
        try:
            hook.verify(body, headers)
            entry["verified"] = True
        except WebhookVerificationError as e:
            entry["error"] = str(e)
        with lock:
            seen["n"] += 1
            if seen["n"] <= fail_first:
                status = 503
            else:
                status = 204 if entry["verified"] else 401
            entry["status"] = status
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
print(f"listening on {port}", flush=True)
server.serve_forever()
