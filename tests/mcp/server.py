"""An MCP test server (Python `mcp` SDK) for Tether's MCP tests.

Tools, with their annotations:
  lookup_order   readOnlyHint                       (a read)
  set_status     idempotentHint, not destructive    (an idempotent write)
  issue_refund   destructiveHint                    (a write that needs approval)
  add_note       neither                            (a non-idempotent write)

Every call that arrives is appended to the file named by ARRIVALS (one JSON line: tool, args)
before anything else happens, so a test can count arrivals. MODE changes the behaviour of
write calls: normal; drop (apply, then never answer); crash (apply, then exit at once); slow
(sleep SLOW_S seconds first). TRANSPORT is stdio (default) or http (PORT).
"""

import json
import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

ARRIVALS = os.environ.get("ARRIVALS", "")
MODE = os.environ.get("MODE", "normal")
STATE = {"refunded": {}, "status": {}, "notes": []}

server = MCPServer("tether-test")


def arrived(tool, args):
    if ARRIVALS:
        with open(ARRIVALS, "a") as f:
            f.write(json.dumps({"tool": tool, "args": args}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def write_mode():
    if MODE == "slow":
        time.sleep(float(os.environ.get("SLOW_S", "5")))


def after_apply():
    if MODE == "crash":
        os._exit(3)
    if MODE == "drop":
        time.sleep(3600)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup_order(order_id: str) -> dict:
    """Reads an order."""
    arrived("lookup_order", {"order_id": order_id})
    return {"status": "ok", "order_id": order_id, "total_cents": 15000,
            "refunded_cents": STATE["refunded"].get(order_id, 0)}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True))
def set_status(order_id: str, status: str) -> dict:
    """Sets an order's status (the same call twice has the effect of one)."""
    arrived("set_status", {"order_id": order_id, "status": status})
    write_mode()
    STATE["status"][order_id] = status
    after_apply()
    return {"status": "ok", "order_id": order_id, "order_status": status}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=False))
def issue_refund(order_id: str, amount_cents: int) -> dict:
    """Refunds an order."""
    arrived("issue_refund", {"order_id": order_id, "amount_cents": amount_cents})
    write_mode()
    STATE["refunded"][order_id] = STATE["refunded"].get(order_id, 0) + amount_cents
    after_apply()
    return {"status": "ok", "order_id": order_id, "refunded_cents": amount_cents}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False))
def add_note(order_id: str, text: str) -> dict:
    """Adds a note to an order (each call adds one)."""
    arrived("add_note", {"order_id": order_id, "text": text})
    write_mode()
    STATE["notes"].append((order_id, text))
    after_apply()
    return {"status": "ok", "notes": len(STATE["notes"])}


if __name__ == "__main__":
    if os.environ.get("TRANSPORT", "stdio") == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(os.environ["PORT"]))
    else:
        server.run()
    sys.exit(0)
