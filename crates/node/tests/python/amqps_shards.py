#!/usr/bin/env python3
"""pika over TLS against a node of two shards: clients are given to the
shards in turn, and each moves to the shard of the first queue it names,
its TLS session with it.

Usage: amqps_shards.py PORT CA_FILE; prints one JSON object."""

import json
import signal
import ssl
import sys

import pika

port, ca = int(sys.argv[1]), sys.argv[2]
# A client that waits for ever fails the test instead of hanging it.
signal.alarm(60)
tls = ssl.create_default_context(cafile=ca)


def connect():
    return pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=port, ssl_options=pika.SSLOptions(tls, "localhost")))


N = 200
# In turn: shard 0, 1, 0, 1.
declarer, publisher, getter, consumer = connect(), connect(), connect(), connect()
declarer.channel().queue_declare("tls.moved", durable=True)
pub = publisher.channel()
pub.confirm_delivery()
for i in range(N):
    pub.basic_publish("", "tls.moved", f"m{i}".encode(),
                      pika.BasicProperties(delivery_mode=2))
m, _p, first = getter.channel().basic_get("tls.moved", auto_ack=True)
ch = consumer.channel()
ch.basic_qos(prefetch_count=50)
got = [first.decode()]
for method, _props, body in ch.consume("tls.moved", inactivity_timeout=5):
    if method is None:
        break
    got.append(body.decode())
    ch.basic_ack(method.delivery_tag)
    if len(got) == N:
        break
ch.cancel()
left = declarer.channel().queue_declare("tls.moved", passive=True).method.message_count
for c in (declarer, publisher, getter, consumer):
    c.close()
print(json.dumps({"in_order": got == [f"m{i}" for i in range(N)],
                  "received": len(got), "left": left}))
