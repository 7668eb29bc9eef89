"""An MCP test server (Python `mcp` SDK) for Tether's MCP tests.

Tools, with their annotations:
  lookup_order   readOnlyHint                       (a read)
  set_status     idempotentHint, not destructive    (an idempotent write)
  issue_refund   destructiveHint                    (a write that needs approval)
  add_note       neither                            (a non-idempotent write)

Every call that arrives is appended to the file named by ARRIVALS (one JSON line: tool, args)
before anything else happens, so a test can count arrivals. MODE changes the behaviour of
the tools named in MODE_TOOLS (comma-separated; default the three writes): normal; drop
(apply, then never answer); crash (apply, then exit at once); slow (sleep SLOW_S seconds
first); big (apply, then answer with a result over 1 MiB); rpc_error (apply, then answer
with a JSON-RPC internal error, -32603); rpc_invalid (apply, then answer -32602, "invalid
params"); raise (apply, then raise: the SDK answers isError). With ONCE_FILE set, the mode applies to the first such call only (the file marks it
done, across restarts). VARIANT=2 changes add_note's description (a changed definition).
TRANSPORT is stdio (default) or http (PORT). LIST=endless answers every page of tools/list
with another nextCursor (a server that never ends its list). LIST_HOLD names a file: while it
exists, tools/list creates the file LIST_HELD and waits (a slow definition check a test can
hold a daemon in).
"""

import asyncio
import json
import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import ToolAnnotations

ARRIVALS = os.environ.get("ARRIVALS", "")
MODE = os.environ.get("MODE", "normal")
STATE = {"refunded": {}, "status": {}, "notes": []}

class TestServer(MCPServer):
    async def _handle_list_tools(self, ctx, params):
        hold = os.environ.get("LIST_HOLD", "")
        if hold and os.path.exists(hold):
            with open(os.environ["LIST_HELD"], "w") as f:
                f.write("held")
            while os.path.exists(hold):
                await asyncio.sleep(0.05)
        result = await super()._handle_list_tools(ctx, params)
        if os.environ.get("LIST") == "endless":
            page = int((params.cursor if params and params.cursor else "0")) + 1
            result.next_cursor = str(page)
        return result


server = TestServer("tether-test")


def arrived(tool, args):
    if ARRIVALS:
        with open(ARRIVALS, "a") as f:
            f.write(json.dumps({"tool": tool, "args": args}) + "\n")
            f.flush()
            os.fsync(f.fileno())


MODE_TOOLS = os.environ.get("MODE_TOOLS", "set_status,issue_refund,add_note").split(",")
ONCE_FILE = os.environ.get("ONCE_FILE", "")


def moded(tool):
    """Whether MODE applies to this call of `tool`."""
    if tool not in MODE_TOOLS:
        return False
    if ONCE_FILE:
        if os.path.exists(ONCE_FILE):
            return False
        with open(ONCE_FILE, "w") as f:
            f.write(tool)
    return True


def write_mode(tool):
    """Runs before the tool applies; returns whether after_apply should act too."""
    if not moded(tool):
        return False
    if MODE == "slow":
        time.sleep(float(os.environ.get("SLOW_S", "5")))
    return True


def after_apply(act):
    if not act:
        return
    if MODE == "crash":
        os._exit(3)
    if MODE == "drop":
        time.sleep(3600)
    if MODE == "rpc_error":
        raise MCPError(-32603, "internal error after the write was applied")
    if MODE == "rpc_invalid":
        raise MCPError(-32602, "invalid params, after the write was applied")
    if MODE == "raise":
        raise RuntimeError("the tool failed after the write was applied")


def answer(act, result):
    """The result, or with MODE=big a result of over 1 MiB (the write was applied)."""
    if act and MODE == "big":
        return {**result, "padding": "x" * (1100 * 1024)}
    return result


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup_order(order_id: str) -> dict:
    """Reads an order."""
    arrived("lookup_order", {"order_id": order_id})
    after_apply(write_mode("lookup_order"))
    return {"status": "ok", "order_id": order_id, "total_cents": 15000,
            "refunded_cents": STATE["refunded"].get(order_id, 0)}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True))
def set_status(order_id: str, status: str) -> dict:
    """Sets an order's status (the same call twice has the effect of one)."""
    arrived("set_status", {"order_id": order_id, "status": status})
    act = write_mode("set_status")
    STATE["status"][order_id] = status
    after_apply(act)
    return answer(act, {"status": "ok", "order_id": order_id, "order_status": status})


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=False))
def issue_refund(order_id: str, amount_cents: int, customer_id: str = "") -> dict:
    """Refunds an order."""
    arrived("issue_refund", {"order_id": order_id, "amount_cents": amount_cents,
                             "customer_id": customer_id})
    act = write_mode("issue_refund")
    STATE["refunded"][order_id] = STATE["refunded"].get(order_id, 0) + amount_cents
    after_apply(act)
    return answer(act, {"status": "ok", "order_id": order_id, "refunded_cents": amount_cents})


NOTE_DESCRIPTION = ("Adds a note to an order, and emails the customer."
                    if os.environ.get("VARIANT") == "2"
                    else "Adds a note to an order (each call adds one).")


@server.tool(description=NOTE_DESCRIPTION,
             annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False))
def add_note(order_id: str, text: str) -> dict:
    """Adds a note to an order (each call adds one)."""
    arrived("add_note", {"order_id": order_id, "text": text})
    act = write_mode("add_note")
    STATE["notes"].append((order_id, text))
    after_apply(act)
    return answer(act, {"status": "ok", "notes": len(STATE["notes"])})


if __name__ == "__main__":
    if os.environ.get("TRANSPORT", "stdio") == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(os.environ["PORT"]))
    else:
        server.run()
    sys.exit(0)
