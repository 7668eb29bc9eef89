#!/usr/bin/env python3
"""A fake model provider for Tether's tests, whose replies are the providers' own shapes.

Every reply is built with the official SDK's response types (`openai.types.chat` for Chat
Completions, `anthropic.types` for Messages) and serialized by them, so what Tether reads is
what the provider sends, not a copy of it written here. Every request is appended to the log
(one JSON object per line: path, the headers that matter, body).

Usage: fake_provider.py --api openai|anthropic --script FILE --log FILE
                        [--limit-requests N] [--limit-tokens T] [--window-ms W]
                        [--tls CERT KEY]
Prints `listening on http://127.0.0.1:PORT` when ready (`https://localhost:PORT` with --tls).

With limits it is rate limited as a provider is: a request that would take the requests it
accepted in the last W ms past N, or their billed tokens past T, is answered 429 with
`Retry-After` (whole seconds) and OpenAI's `rate_limit_exceeded` error. Each log line then
also has `at_ms` (arrival), `status` and `tokens` (what the request would be billed).

The script has one recipe per line, used in the order requests arrive (the last one repeats):
  {"call": NAME, "args": {...}}            one function call
  {"calls": [[NAME, {...}], ...]}          several calls in one reply
  {"call": NAME, "raw_args": "TEXT"}       a call whose arguments are TEXT as given
  {"text": "..."}                          text (with "call": text and a call)
  {"refusal": "..."}                       a refusal (OpenAI: message.refusal; Anthropic:
                                           stop_reason "refusal")
  {"finish": "length" | "content_filter"}  the finish reason (with any of the above)
  {"status": 429, "headers": {...}, "error": {...}}   an error answer
  {"delay_ms": MS}                         (with any of these) answered after MS ms
  {"usage": [IN, OUT]}                     the usage billed (default: the request's
                                           length / 4 in, the reply's / 4 out)
  {"policy": CENTS, "delay_ms": MS}        the next move of a refund of CENTS on the order
                                           the goal names, decided from the request alone
                                           (plan, get_order, issue_refund, send_status_email,
                                           final_answer), after MS ms: any number of tasks
                                           at once, in any order, restarted at any point
"""
import re
import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()


def openai_reply(r, n, prompt_tokens):
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice
    from openai.types.chat.chat_completion_message_function_tool_call import (
        ChatCompletionMessageFunctionToolCall,
        Function,
    )
    from openai.types.completion_usage import CompletionUsage

    calls = []
    wanted = r.get("calls") or ([[r["call"], r.get("args", {})]] if "call" in r else [])
    for i, (name, args) in enumerate(wanted):
        text = r["raw_args"] if "raw_args" in r else json.dumps(args)
        calls.append(
            ChatCompletionMessageFunctionToolCall(
                id=f"call_{n}_{i}", type="function", function=Function(name=name, arguments=text)
            )
        )
    finish = r.get("finish") or ("tool_calls" if calls else "stop")
    message = ChatCompletionMessage(
        role="assistant",
        content=r.get("text"),
        refusal=r.get("refusal"),
        tool_calls=calls or None,
    )
    out_tokens = max(1, len(message.model_dump_json()) // 4)
    usage = r.get("usage") or [prompt_tokens, out_tokens]
    c = ChatCompletion(
        id=f"chatcmpl-{n}",
        object="chat.completion",
        created=int(time.time()),
        model="gpt-4o-2024-08-06",
        choices=[Choice(index=0, finish_reason=finish, message=message, logprobs=None)],
        usage=CompletionUsage(
            prompt_tokens=usage[0], completion_tokens=usage[1], total_tokens=usage[0] + usage[1]
        ),
    )
    return c.model_dump_json()


def anthropic_reply(r, n, prompt_tokens):
    from anthropic.types import Message, TextBlock, ToolUseBlock, Usage

    blocks = []
    if r.get("text") or r.get("refusal"):
        blocks.append(TextBlock(type="text", text=r.get("text") or r.get("refusal")))
    wanted = r.get("calls") or ([[r["call"], r.get("args", {})]] if "call" in r else [])
    for i, (name, args) in enumerate(wanted):
        blocks.append(ToolUseBlock(type="tool_use", id=f"toolu_{n}_{i}", name=name, input=args))
    if r.get("refusal"):
        stop = "refusal"
    elif r.get("finish") == "length":
        stop = "max_tokens"
    else:
        stop = "tool_use" if wanted else "end_turn"
    out_tokens = max(1, sum(len(b.model_dump_json()) for b in blocks) // 4)
    usage = r.get("usage") or [prompt_tokens, out_tokens]
    m = Message(
        id=f"msg_{n}",
        type="message",
        role="assistant",
        model="claude-sonnet-4-5-20250929",
        content=blocks,
        stop_reason=stop,
        stop_sequence=None,
        usage=Usage(
            input_tokens=usage[0],
            output_tokens=usage[1],
            cache_read_input_tokens=0,
            cache_creation_input_tokens=0,
        ),
    )
    return m.model_dump_json()


def policy_move(body, cents):
    """The refund policy's next move for a Chat Completions request."""
    msgs = body["messages"]
    order = re.search(r"ord_[0-9]+", msgs[1]["content"]).group(0)
    last = None
    for m in msgs:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            last = m["tool_calls"][0]["function"]["name"]
    nxt = {
        None: ["propose_plan", {"steps": [
            {"id": "s1", "tool": "get_order", "depends_on": []},
            {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]},
            {"id": "s3", "tool": "send_status_email", "depends_on": ["s2"]}]}],
        "propose_plan": ["get_order", {"order_id": order}],
        "get_order": ["issue_refund", {"order_id": order, "amount_cents": cents}],
        "issue_refund": ["send_status_email", {"order_id": order}],
        "send_status_email": ["final_answer", {"outcome": "completed", "text": f"Refunded {order}."}],
        "final_answer": ["final_answer", {"outcome": "completed", "text": f"Refunded {order}."}],
    }[last]
    return {"call": nxt[0], "args": nxt[1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", choices=["openai", "anthropic"], required=True)
    ap.add_argument("--script", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--limit-requests", type=int)
    ap.add_argument("--limit-tokens", type=int)
    ap.add_argument("--window-ms", type=int, default=60000)
    ap.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"),
                    help="serve HTTPS with this certificate chain and key, as localhost")
    a = ap.parse_args()
    script = [json.loads(l) for l in open(a.script) if l.strip()]
    served = [0]
    accepted = []  # (at_ms, tokens) of the requests accepted in the window

    def admit(now_ms, tokens):
        """None if the request is within the limits (and counts it), else seconds to wait."""
        if a.limit_requests is None and a.limit_tokens is None:
            return None
        while accepted and accepted[0][0] + a.window_ms <= now_ms:
            accepted.pop(0)
        over_r = a.limit_requests is not None and len(accepted) + 1 > a.limit_requests
        used = sum(t for _, t in accepted)
        over_t = a.limit_tokens is not None and used + tokens > a.limit_tokens
        if not (over_r or over_t):
            accepted.append((now_ms, tokens))
            return None
        oldest = accepted[0][0] if accepted else now_ms
        return max(1, -(-(oldest + a.window_ms - now_ms) // 1000))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            with LOCK:
                n = served[0]
                served[0] += 1
                r = script[min(n, len(script) - 1)]
                billed = sum(r["usage"]) if "usage" in r else max(1, len(raw) // 4)
                now_ms = int(time.time() * 1000)
                wait = admit(now_ms, billed)
                keep = ["authorization", "x-api-key", "anthropic-version", "content-type"]
                entry = {
                    "n": n,
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items() if k.lower() in keep},
                    "body": body,
                    "at_ms": now_ms,
                    "status": 429 if wait else 200,
                    "tokens": billed,
                }
                with open(a.log, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            if wait:
                r = {"status": 429, "headers": {"Retry-After": str(wait)}, "error": {
                    "message": "Rate limit reached for gpt-4o: please try again later.",
                    "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
            time.sleep(r.get("delay_ms", 0) / 1000)
            if "policy" in r:
                r = policy_move(body, r["policy"])
            if "status" in r:
                self.send_response(r["status"])
                for k, v in (r.get("headers") or {}).items():
                    self.send_header(k, v)
                out = json.dumps({"error": r.get("error") or {"message": "error", "type": "error"}})
            else:
                self.send_response(200)
                build = openai_reply if a.api == "openai" else anthropic_reply
                out = build(r, n, max(1, len(raw) // 4))
            data = out.encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # A worker killed mid-request leaves a broken pipe: expected, not news.
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    srv = Server(("127.0.0.1", 0), Handler)
    if a.tls:
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*a.tls)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        print(f"listening on https://localhost:{srv.server_address[1]}", flush=True)
    else:
        print(f"listening on http://127.0.0.1:{srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
