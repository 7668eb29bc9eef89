"""An SSE client written with httpx-sse (a peer of ours, not our code): it reads a task's
event stream from Tether's HTTP API, goes away after a few events, comes back later with
`Last-Event-ID` as an EventSource does, and reads on to the task's end; then it asks once
more with the last id and expects 204 (nothing more will come).

Usage: client.py BASE_URL TOKEN TASK FIRST GAP_FILE OUT
  FIRST     how many events to read before going away
  GAP_FILE  the client waits for this file to exist before coming back (the test makes it
            once the task has moved on while no one was reading)
Writes OUT: one JSON object per event ({"id", "event", "data", "connection"}), then a
last line {"after_end": STATUS}.
"""

import json
import os
import sys
import time

import httpx
from httpx_sse import connect_sse

base, token, task, first, gap_file, out = sys.argv[1:7]
first = int(first)
url = f"{base}/api/v1/tasks/{task}/events"
auth = {"Authorization": f"Bearer {token}"}
got = []


def read(client, connection, last_id, limit):
    headers = dict(auth)
    if last_id is not None:
        headers["Last-Event-ID"] = last_id
    with connect_sse(client, "GET", url, headers=headers) as source:
        source.response.raise_for_status()
        for sse in source.iter_sse():
            got.append({"id": sse.id, "event": sse.event, "data": json.loads(sse.data),
                        "connection": connection})
            if sse.event == "finished":
                return
            if limit is not None and len([g for g in got if g["connection"] == connection]) >= limit:
                return  # going away mid-task: the connection closes here


with httpx.Client(timeout=httpx.Timeout(120.0)) as client:
    read(client, 1, None, first)
    while not os.path.exists(gap_file):
        time.sleep(0.05)
    read(client, 2, got[-1]["id"], None)
    after = client.get(url, headers={**auth, "Accept": "text/event-stream",
                                     "Last-Event-ID": got[-1]["id"]})

with open(out, "w") as f:
    for g in got:
        f.write(json.dumps(g) + "\n")
    f.write(json.dumps({"after_end": after.status_code}) + "\n")
