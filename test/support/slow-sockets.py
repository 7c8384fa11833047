"""Clients with a tiny TCP receive window, for the slow-client tests (test/slow-clients.test.ts).

Node cannot set socket options, so these clients are Python. Before connect they set a small receive
buffer (the kernel clamps it to its minimum, ~2.3 KB) and an Ethernet-sized MSS: on loopback the MSS is
64 KB, and Linux sizes the server's send buffer from it (~1.3 MB per connection), so a whole answer
would vanish into kernel buffers; with a 1,400-byte MSS the server's writes back up as they would
across a real network.

  slow-sockets.py stuck HOST PORT COUNT BODY_FILE
      COUNT sockets POST the body and never read; prints "sent N" once all are sent, then waits until
      stdin closes.
  slow-sockets.py slow HOST PORT BODY_FILE OUT_FILE READ_BYTES EVERY_MS
      One socket POSTs the body, then reads READ_BYTES every EVERY_MS until the server closes; writes
      everything it read to OUT_FILE and prints "done".
"""
import socket
import sys
import time


def connect(host, port, body):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
    s.connect((host, port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    s.sendall(head + body)
    return s


def main():
    mode = sys.argv[1]
    host, port = sys.argv[2], int(sys.argv[3])
    if mode == "stuck":
        count = int(sys.argv[4])
        body = open(sys.argv[5], "rb").read()
        sockets = [connect(host, port, body) for _ in range(count)]
        print(f"sent {len(sockets)}", flush=True)
        sys.stdin.read()
        for s in sockets:
            s.close()
    elif mode == "slow":
        body = open(sys.argv[4], "rb").read()
        out, read_bytes, every = sys.argv[5], int(sys.argv[6]), int(sys.argv[7]) / 1000
        s = connect(host, port, body)
        received = bytearray()
        while True:
            chunk = s.recv(read_bytes)
            if not chunk:
                break
            received += chunk
            time.sleep(every)
        open(out, "wb").write(received)
        print("done", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


main()
