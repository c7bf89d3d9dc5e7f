"""Clients past a node's socket budget, and more durable queues than it may
open files, run against a node started with an
open-files limit of 300 (`ulimit -n 300`). Prints {case: outcome} as JSON.

usage: probe.py AMQP_PORT HTTP_PORT
"""
import base64
import json
import sys
import threading
import time
import urllib.request

import pika

PORT, HTTP = int(sys.argv[1]), int(sys.argv[2])
MORE_THAN_THE_BUDGET = 250


def node():
    auth = base64.b64encode(b"guest:guest").decode()
    req = urllib.request.Request(
        "http://127.0.0.1:%d/api/nodes" % HTTP, headers={"Authorization": "Basic " + auth}
    )
    me = json.load(urllib.request.urlopen(req))[0]
    return {k: me.get(k) for k in ["fd_total", "sockets_total", "sockets_used"]}


def connect(timeout=4):
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            PORT,
            socket_timeout=timeout,
            stack_timeout=timeout,
            blocked_connection_timeout=timeout,
            connection_attempts=1,
        )
    )


out = {"idle": node()}
conns = []
for i in range(MORE_THAN_THE_BUDGET):
    try:
        conns.append(connect())
    except Exception as e:  # the first client past the budget
        out["past_the_budget"] = {"opened_before": i, "error": type(e).__name__}
        break
# RabbitMQ's management statistics lag by up to 5 s.
time.sleep(6)
out["at_the_budget"] = node()

# Durable queues and persistent, confirmed publishes while every socket of
# the budget is taken: the files they need are not starved.
ch = conns[0].channel()
ch.confirm_delivery()
try:
    for i in range(20):
        ch.queue_declare("fdlimit%d" % i, durable=True)
        ch.basic_publish("", "fdlimit%d" % i, b"x" * 100, pika.BasicProperties(delivery_mode=2))
    out["durable_queues_at_the_budget"] = "ok"
except Exception as e:
    out["durable_queues_at_the_budget"] = repr(e)

# A client waiting past the budget gets in once another leaves.
waiter = {}
left_at = [float("inf")]


def wait():
    try:
        c = connect(timeout=15)
        waiter["connected"] = True
        waiter["after_another_left"] = time.time() >= left_at[0]
        c.close()
    except Exception as e:
        waiter["connected"] = type(e).__name__


t = threading.Thread(target=wait)
t.start()
time.sleep(2)
left_at[0] = time.time()
conns.pop().close()
t.join()
out["waiting_client"] = waiter

for c in conns:
    c.close()
ch = connect().channel()
out["messages_kept"] = sum(
    ch.queue_delete("fdlimit%d" % i).method.message_count for i in range(20)
)
# More durable queues than the node may open files, each with persistent,
# confirmed messages published in two rounds (every queue's file used
# again after all the others), then read back.
QUEUES = 400
ch = connect().channel()
ch.confirm_delivery()
persistent = pika.BasicProperties(delivery_mode=2)
try:
    for i in range(QUEUES):
        ch.queue_declare("fdmany%d" % i, durable=True)
    for rnd in range(2):
        for i in range(QUEUES):
            ch.basic_publish("", "fdmany%d" % i, b"%d.%d" % (i, rnd), persistent)
    got = 0
    for i in range(QUEUES):
        for rnd in range(2):
            _, _, body = ch.basic_get("fdmany%d" % i, auto_ack=True)
            got += body == b"%d.%d" % (i, rnd)
    out["more_durable_queues_than_files"] = {"queues": QUEUES, "got_back": got}
except Exception as e:
    out["more_durable_queues_than_files"] = repr(e)
ch = connect().channel()
for i in range(QUEUES):
    ch.queue_delete("fdmany%d" % i)
print(json.dumps(out, indent=1, sort_keys=True))
