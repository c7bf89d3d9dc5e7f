#!/usr/bin/env python3
"""A backlog larger than memory, through pika (docs/benchmarks.md).

Publishes MIB messages of 1 MiB, persistent, with publisher confirms, into
the durable queue `backlog` of the node listening on 127.0.0.1:PORT, then
drains it with basic.get (checking every body), printing the node's
resident memory (VmRSS of process PID) as it goes.

    python3 benches/backlog.py PID MIB [PORT]
"""
import sys
import time

import pika


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return 0


def main():
    pid, mib = int(sys.argv[1]), int(sys.argv[2])
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 5672
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("backlog", durable=True)
    body = bytes(i % 251 for i in range(1 << 20))
    peak = rss_mib(pid)
    print(f"start: rss {peak} MiB", flush=True)
    t0 = time.time()
    for i in range(mib):
        ch.basic_publish("", "backlog", body, pika.BasicProperties(delivery_mode=2))
        if i % 256 == 0:
            peak = max(peak, rss_mib(pid))
    print(f"published {mib} MiB in {time.time() - t0:.0f} s, rss {rss_mib(pid)} MiB", flush=True)
    t0 = time.time()
    n = 0
    while True:
        method, _, got = ch.basic_get("backlog", auto_ack=True)
        if method is None:
            break
        assert got == body, f"message {n} came back altered"
        n += 1
        if n % 256 == 0:
            peak = max(peak, rss_mib(pid))
    print(f"drained {n} MiB in {time.time() - t0:.0f} s, rss peak {peak} MiB", flush=True)
    conn.close()


if __name__ == "__main__":
    main()
