#!/usr/bin/env python3
"""Many durable queues on one node: how long a declare, a bind and a delete
take as their count grows (docs/benchmarks.md, "Many queues and bindings").

pika declares COUNT durable queues `mq.0` … on one channel, binds each to
`amq.topic` with its own pattern (`k.I.#`), publishes 2,000 messages
through the exchange, then deletes the queues, printing the time per
operation of each fifth.

    python3 benches/many_queues.py COUNT
    AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f python3 benches/many_queues.py 50000
"""
import os
import sys
import time

import pika

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def timed(what, count, op):
    start = last = time.time()
    for i in range(count):
        op(i)
        if (i + 1) % max(count // 5, 1) == 0:
            now = time.time()
            each = (now - last) / max(count // 5, 1) * 1e3
            print(f"{i + 1} {what}, {each:.2f} ms each", flush=True)
            last = now
    print(f"{what}: {time.time() - start:.1f} s in all", flush=True)


def main():
    count = int(sys.argv[1])
    ch = pika.BlockingConnection(pika.URLParameters(URL)).channel()
    timed("declared", count, lambda i: ch.queue_declare(f"mq.{i}", durable=True))
    timed("bound", count, lambda i: ch.queue_bind(f"mq.{i}", "amq.topic", f"k.{i}.#"))
    timed("published", 2000, lambda i: ch.basic_publish("amq.topic", f"k.{i}.x", b"x"))
    timed("deleted", count, lambda i: ch.queue_delete(f"mq.{i}"))


if __name__ == "__main__":
    main()
