"""A TCP forwarder whose new connections a test can stall, for Tether's paused-send tests.

usage: forwarder.py PORT TARGET_PORT CONTROL_DIR

Forwards every connection to 127.0.0.1:PORT to 127.0.0.1:TARGET_PORT. While the file
CONTROL_DIR/clog exists it stops accepting and fills its accept queue (listen(0), plus
connections of its own that it does not accept), so a new connection's SYN is dropped and the
client waits in connect (SYN-SENT), retrying; it writes CONTROL_DIR/clogged once it is so.
When clog is removed it accepts again (the waiting client's retried SYN then gets through).
"""

import os
import socket
import sys
import threading
import time

port, target, control = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
clog, clogged = os.path.join(control, "clog"), os.path.join(control, "clogged")


def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def forward(conn):
    try:
        up = socket.create_connection(("127.0.0.1", target))
    except OSError:
        conn.close()
        return
    threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
    threading.Thread(target=pipe, args=(up, conn), daemon=True).start()


srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(0)
srv.settimeout(0.05)
fillers = []
while True:
    if os.path.exists(clog):
        if not fillers:
            # Connections no one accepts fill the accept queue.
            for _ in range(3):
                s = socket.socket()
                s.setblocking(False)
                try:
                    s.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                fillers.append(s)
            time.sleep(0.2)
            with open(clogged, "w") as f:
                f.write("clogged")
        time.sleep(0.05)
        continue
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        continue
    if fillers and conn.getpeername()[1] in {f.getsockname()[1] for f in fillers}:
        conn.close()
        continue
    conn.settimeout(None)
    forward(conn)
