#!/usr/bin/env python3
"""Publishers through a failover of many mirrored queues
(docs/benchmarks.md, "Publishing through a failover of many queues").

THREADS pika threads, each publishing persistent messages in confirm mode
one at a time, round robin over the `ha.c*` queues whose master is node
VICTIM (of 127.0.0.1-3, as `cargo xtask cluster up` starts them; declare
them first with `benches/many_mirrored.py COUNT declare`), through the two
other nodes, for SECONDS; SIGKILL of process PID (node VICTIM) KILL_AT
seconds in. Prints the acks and nacks answered before and after the kill,
the slowest answer, and when the last nack and the first ack of a publish
sent after the kill came.

    python3 benches/failover_publish.py SECONDS KILL_AT PID THREADS VICTIM
"""
import base64
import json
import os
import signal
import sys
import threading
import time
import urllib.request

import pika


def main():
    seconds, kill_at = float(sys.argv[1]), float(sys.argv[2])
    pid, threads, victim = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    others = [i for i in (1, 2, 3) if i != victim]
    urls = [f"amqp://guest:guest@127.0.0.{i}:5672/%2f" for i in others]
    req = urllib.request.Request(
        f"http://127.0.0.{others[0]}:15672/api/queues?columns=name,node",
        headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()},
    )
    queues = [
        q["name"]
        for q in json.load(urllib.request.urlopen(req))
        if q["name"].startswith("ha.c") and q["node"] == f"warren@127.0.0.{victim}"
    ]
    print(f"{len(queues)} queues mastered on node {victim}", flush=True)
    answers = []  # (sent at, outcome, waited), seconds from the start
    lock = threading.Lock()
    start = time.time()
    stop = start + seconds

    def publish(k):
        conn = pika.BlockingConnection(pika.URLParameters(urls[k % 2]))
        ch = conn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)
        mine = queues[k::threads]
        j = 0
        while time.time() < stop:
            sent = time.time()
            try:
                ch.basic_publish("", mine[j % len(mine)], b"m", props)
                out = "ack"
            except pika.exceptions.NackError:
                out = "nack"
            except Exception as e:  # the connection went: recorded, and this thread ends
                out = type(e).__name__
            j += 1
            with lock:
                answers.append((sent - start, out, time.time() - sent))
            if out not in ("ack", "nack"):
                break
        try:
            conn.close()
        except Exception:
            pass

    workers = [threading.Thread(target=publish, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    time.sleep(kill_at)
    os.kill(pid, signal.SIGKILL)
    killed = time.time() - start
    for w in workers:
        w.join()
    for name, after in [("before the kill", False), ("answered after the kill", True)]:
        rs = [a for a in answers if (a[0] + a[2] >= killed) == after]
        outs = {}
        for a in rs:
            outs[a[1]] = outs.get(a[1], 0) + 1
        slowest = max((a[2] for a in rs), default=0)
        print(f"{name}: {len(rs)} publishes, {outs}, slowest answer {slowest * 1e3:.0f} ms")
    nacks = [a[0] + a[2] - killed for a in answers if a[1] == "nack"]
    acks = [a[0] + a[2] - killed for a in answers if a[1] == "ack" and a[0] >= killed]
    print(f"kill at {killed:.2f} s; last nack at "
          f"{f'+{max(nacks):.2f} s' if nacks else 'none'}; first ack of a publish sent "
          f"after the kill at {f'+{min(acks):.2f} s' if acks else 'none'}")


if __name__ == "__main__":
    main()
