#!/usr/bin/env python3
"""Many mirrored queues on a 3-node cluster (docs/benchmarks.md, "Thousands
of mirrored queues on three nodes").

pika, one channel per node; queue `ha.cI` is declared through node I mod 3
(so each node masters a third of them: `client-local`), published to
through the next node (forwarded to its master), counted through node 1,
and deleted through node I mod 3. Prints the time per operation of each
fifth. Run on `cargo xtask cluster up` (policy `ha-all` on `^ha\\.`) or on
three RabbitMQ nodes with the same policy.

    python3 benches/many_mirrored.py COUNT PHASE [URL1 URL2 URL3]
    PHASE: declare | publish | count | delete
"""
import sys
import time

import pika

DEFAULT_URLS = [f"amqp://guest:guest@127.0.0.{i}:5672/%2f" for i in (1, 2, 3)]


def timed(what, count, op):
    start = last = time.time()
    step = max(count // 5, 1)
    for i in range(count):
        op(i)
        if (i + 1) % step == 0:
            now = time.time()
            print(f"{i + 1} {what}, {(now - last) / step * 1e3:.2f} ms each", flush=True)
            last = now
    print(f"{what}: {time.time() - start:.1f} s in all", flush=True)


def main():
    count, phase = int(sys.argv[1]), sys.argv[2]
    urls = sys.argv[3:6] or DEFAULT_URLS
    chans = [pika.BlockingConnection(pika.URLParameters(u)).channel() for u in urls]
    if phase == "declare":
        timed("declared", count, lambda i: chans[i % 3].queue_declare(f"ha.c{i}", durable=True))
    elif phase == "publish":
        for c in chans:
            c.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)
        timed("published", count,
              lambda i: chans[(i + 1) % 3].basic_publish("", f"ha.c{i}", b"m%d" % i, props))
    elif phase == "count":
        counts = {}

        def one(i):
            m = chans[0].queue_declare(f"ha.c{i}", passive=True).method.message_count
            counts[m] = counts.get(m, 0) + 1
        timed("counted", count, one)
        print("queues by message count:", counts, flush=True)
    elif phase == "delete":
        timed("deleted", count, lambda i: chans[i % 3].queue_delete(f"ha.c{i}"))
    else:
        sys.exit(f"unknown phase {phase}")


if __name__ == "__main__":
    main()
