#!/usr/bin/env python3
"""How fast a cluster takes queue declares, as the queue count grows
(docs/benchmarks.md).

Against a running cluster (`cargo xtask cluster up`: node 1 on 127.0.0.1,
the example policy mirroring queues named `ha.*` to every node), pika
declares COUNT durable queues one after the other on one channel, printing
the rate of each hundred, then COUNT more over CONNECTIONS connections at
once. PREFIX names the queues (`ha.` for mirrored ones).

    python3 benches/declares.py PREFIX COUNT [CONNECTIONS]
    python3 benches/declares.py plain. 300
    python3 benches/declares.py ha. 600 8

Another broker (a single node, RabbitMQ): AMQP_URL=amqp://guest:guest@HOST:PORT/%2f
"""
import os
import sys
import threading
import time

import pika

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def one_after_another(prefix, count):
    conn = pika.BlockingConnection(pika.URLParameters(URL))
    ch = conn.channel()
    start = last = time.time()
    for i in range(count):
        ch.queue_declare(f"{prefix}seq{i}", durable=True)
        if (i + 1) % 100 == 0:
            now = time.time()
            print(f"  queues {i - 98}-{i + 1}: {100 / (now - last):.1f} declares/s", flush=True)
            last = now
    print(f"one after another: {count / (time.time() - start):.1f} declares/s")
    conn.close()


def at_once(prefix, count, connections):
    def work(j):
        conn = pika.BlockingConnection(pika.URLParameters(URL))
        ch = conn.channel()
        for i in range(j, count, connections):
            ch.queue_declare(f"{prefix}par{i}", durable=True)
        conn.close()

    start = time.time()
    threads = [threading.Thread(target=work, args=(j,)) for j in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = count / (time.time() - start)
    print(f"over {connections} connections at once: {rate:.1f} declares/s")


def main():
    prefix, count = sys.argv[1], int(sys.argv[2])
    connections = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    one_after_another(prefix, count)
    at_once(prefix, count, connections)


if __name__ == "__main__":
    main()
