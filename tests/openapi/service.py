#!/usr/bin/env python3
"""A help desk API written with FastAPI, for Tether's OpenAPI tools test.

Tether reads the OpenAPI document FastAPI generates from this file (`/openapi.json`) and
calls the operations as tools. Every request that reaches the server is appended to the
arrivals log (one JSON object per line: method, raw path as sent, query, the headers that
matter, body), before routing, so a request that matches no route is logged too.

Operations: read a customer (path and query parameters), open a ticket (201, honours
`Idempotency-Key`: a repeated key gets the first answer and does nothing; a ticket titled
"slow" is answered 3 s late), look up whether a key was applied, update a ticket
(PATCH), delete a ticket (DELETE, 204), and an admin route no tool may reach. Every route
needs the `X-API-Key` header.

Usage: service.py --log FILE --api-key KEY
Prints `listening on http://127.0.0.1:PORT` when ready.
"""
import argparse
import json
import socket
import sys
import threading
import time
from typing import Literal, Optional

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, Field

ARGS = None
LOCK = threading.Lock()
TICKETS = {}
BY_KEY = {}

app = FastAPI(title="Help desk", version="1.0.0")
api_key = APIKeyHeader(name="X-API-Key")


def checked(key: str = Depends(api_key)):
    if key != ARGS.api_key:
        raise HTTPException(status_code=401, detail="wrong API key")


@app.middleware("http")
async def arrivals(request: Request, call_next):
    body = await request.body()
    entry = {
        "method": request.method,
        "raw_path": request.scope.get("raw_path", b"").decode("latin-1"),
        "query": request.scope.get("query_string", b"").decode("latin-1"),
        "idempotency_key": request.headers.get("idempotency-key"),
        "api_key": request.headers.get("x-api-key"),
        "content_type": request.headers.get("content-type"),
        "body": json.loads(body) if body else None,
    }
    if request.url.path != "/openapi.json":
        with LOCK, open(ARGS.log, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return await call_next(request)


class Customer(BaseModel):
    customer_id: str
    name: str
    orders: Optional[list[str]] = None


class TicketIn(BaseModel):
    title: str = Field(max_length=120, description="One line that says what is wrong.")
    severity: Literal["low", "normal", "high"]


class TicketPatch(BaseModel):
    title: Optional[str] = None
    status: Optional[Literal["open", "closed"]] = None


class Ticket(BaseModel):
    ticket_id: str
    customer_id: str
    title: str
    severity: str
    status: str


@app.get("/customers/{customer_id}", operation_id="get_customer", summary="Read a customer",
         response_model=Customer, dependencies=[Depends(checked)])
def get_customer(customer_id: str, include_orders: bool = False):
    if customer_id != "cu_ana":
        raise HTTPException(status_code=404, detail=f"no customer {customer_id}")
    return Customer(customer_id="cu_ana", name="Ana", orders=["ord_1"] if include_orders else None)


@app.post("/customers/{customer_id}/tickets", operation_id="create_ticket", status_code=201,
          summary="Open a support ticket for a customer", response_model=Ticket,
          dependencies=[Depends(checked)])
def create_ticket(customer_id: str, ticket: TicketIn,
                  idempotency_key: Optional[str] = Header(default=None)):
    with LOCK:
        if idempotency_key and idempotency_key in BY_KEY:
            return BY_KEY[idempotency_key]
        t = Ticket(ticket_id=f"tk_{len(TICKETS) + 1}", customer_id=customer_id,
                   title=ticket.title, severity=ticket.severity, status="open")
        TICKETS[t.ticket_id] = t
        if idempotency_key:
            BY_KEY[idempotency_key] = t
    if ticket.title == "slow":
        # Done, but answered after the caller's timeout: its outcome is unknown to it.
        time.sleep(3)
    return t


@app.get("/tickets/lookup", operation_id="lookup_ticket", summary="Whether a key was applied",
         dependencies=[Depends(checked)])
def lookup_ticket(key: str):
    with LOCK:
        t = BY_KEY.get(key)
    if t is None:
        return {"applied": False}
    return {"applied": True, "result": t.model_dump()}


@app.patch("/tickets/{ticket_id}", operation_id="update_ticket", summary="Change a ticket",
           response_model=Ticket, dependencies=[Depends(checked)])
def update_ticket(ticket_id: str, patch: TicketPatch):
    with LOCK:
        t = TICKETS.get(ticket_id)
        if t is None:
            raise HTTPException(status_code=404, detail=f"no ticket {ticket_id}")
        data = t.model_dump()
        data.update({k: v for k, v in patch.model_dump().items() if v is not None})
        TICKETS[ticket_id] = Ticket(**data)
        return TICKETS[ticket_id]


@app.delete("/tickets/{ticket_id}", operation_id="delete_ticket", status_code=204,
            summary="Delete a ticket", dependencies=[Depends(checked)])
def delete_ticket(ticket_id: str):
    with LOCK:
        if TICKETS.pop(ticket_id, None) is None:
            raise HTTPException(status_code=404, detail=f"no ticket {ticket_id}")
    return Response(status_code=204)


@app.get("/admin", operation_id="admin_reset", summary="Wipe everything",
         dependencies=[Depends(checked)])
def admin_reset():
    with LOCK:
        TICKETS.clear()
    return {"wiped": True}


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("--api-key", required=True)
    ARGS = p.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning")
    server = uvicorn.Server(config)
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    sys.stdout.flush()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
