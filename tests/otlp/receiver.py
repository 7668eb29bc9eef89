"""An OTLP/HTTP trace receiver for Tether's tests.

Every request to /v1/traces is decoded with the official protobuf schema (the
`opentelemetry-proto` package) and each span is appended to the file named by OUT as one JSON
line (ids in hex, attributes as a dict, the resource's attributes, the Authorization header).
Anything else is refused: another path (404), another content type (415), a body that does not
decode (400). PORT is the port on 127.0.0.1. DELAY_MS (default 0) makes it a slow receiver:
it answers each request that long after it wrote the spans down.
"""

import json
import os
import threading
import time

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OUT = os.environ["OUT"]
PORT = int(os.environ["PORT"])
DELAY_S = int(os.environ.get("DELAY_MS", "0")) / 1000
WRITE = threading.Lock()


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def refuse(self, code, why):
        body = why.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            return self.refuse(404, "no such path")
        if self.headers.get("Content-Type") != "application/x-protobuf":
            return self.refuse(415, "Unsupported content type")
        req = ExportTraceServiceRequest()
        try:
            req.ParseFromString(body)
        except Exception as e:  # noqa: BLE001 - any decoding failure is the client's
            return self.refuse(400, f"does not decode: {e}")
        lines = []
        for rs in req.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    lines.append({
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "attributes": {kv.key: value(kv.value) for kv in s.attributes},
                        "status": {"code": s.status.code, "message": s.status.message},
                        "resource": resource,
                        "scope": ss.scope.name,
                        "authorization": self.headers.get("Authorization"),
                    })
        with WRITE, open(OUT, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        time.sleep(DELAY_S)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
