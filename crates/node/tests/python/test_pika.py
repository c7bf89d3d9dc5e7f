"""A second opinion with pika: the `warren` binary driven by RabbitMQ's Python client.

Run:  python3 crates/node/tests/python/test_pika.py  (needs `pip install pika`)
The binary is $WARREN_BIN, or target/debug/warren under the workspace;
$WARREN_EXTRA_ARGS is added to its command line (e.g. `--shards 2`).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import base64
import json
import time
import unittest
import urllib.parse
import urllib.request

import socket

import pika
from pika import frame as pframe
from pika import spec
from pika.exceptions import ChannelClosedByBroker, UnroutableError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
BIN = os.environ.get("WARREN_BIN") or os.path.join(ROOT, "target", "debug", "warren")


class Node:
    """A running warren process on a free port."""

    def __init__(self, data_dir, extra=()):
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [BIN, "--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
             "--data-dir", data_dir, *extra,
             *os.environ.get("WARREN_EXTRA_ARGS", "").split()],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        line = self.proc.stdout.readline()
        if "AMQP on " not in line:
            raise RuntimeError(f"warren did not start: {line!r}")
        self.port = int(line.split("AMQP on ")[1].split(",")[0].rsplit(":", 1)[1])
        self.http = line.split("HTTP on ")[1].split(",")[0].strip()
        self.name = line.split("node ")[1].split(" ")[0] if "node " in line else "warren@localhost"

    def put(self, path, body):
        """PUT `body` (JSON) to the management API as guest."""
        req = urllib.request.Request(
            f"http://{self.http}{path}", data=json.dumps(body).encode(), method="PUT",
            headers={"Content-Type": "application/json",
                     "Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status

    def params(self, user="guest", password="guest", vhost="/"):
        return pika.ConnectionParameters(
            host="127.0.0.1", port=self.port, virtual_host=vhost,
            credentials=pika.PlainCredentials(user, password),
            connection_attempts=1, blocked_connection_timeout=30,
        )

    def connect(self, **kw):
        return pika.BlockingConnection(self.params(**kw))

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()

    def terminate(self):
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self.proc.stdout.close()
        return code


class RawClient:
    """AMQP over a plain socket with pika's codec: every method frame in the
    order the broker sent it (pika's adapters do not show that order)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self.expect(spec.Connection.Start)
        caps = {"capabilities": {"consumer_cancel_notify": True}}
        self.send(0, spec.Connection.StartOk(client_properties=caps, mechanism="PLAIN",
                                             response="\0guest\0guest"))
        tune = self.expect(spec.Connection.Tune)
        self.send(0, spec.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
        self.send(0, spec.Connection.Open(virtual_host="/"))
        self.expect(spec.Connection.OpenOk)

    def send(self, channel, method):
        self.sock.sendall(pframe.Method(channel, method).marshal())

    def method(self):
        while True:
            used, f = pframe.decode_frame(self.buf)
            if f is None:
                data = self.sock.recv(65536)
                if not data:
                    raise EOFError("the broker closed the socket")
                self.buf += data
                continue
            self.buf = self.buf[used:]
            if isinstance(f, pframe.Method):
                return f.method

    def expect(self, cls):
        m = self.method()
        assert isinstance(m, cls), m
        return m

    def close(self):
        self.sock.close()


class PikaTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="warren-pika-")
        self.node = Node(os.path.join(self.dir, "data"))
        self.conn = self.node.connect()
        self.ch = self.conn.channel()

    def tearDown(self):
        try:
            if self.conn is not None and self.conn.is_open:
                self.conn.close()
        finally:
            self.node.kill()
            shutil.rmtree(self.dir, ignore_errors=True)

    def assert_closed_with(self, code, fn, *args, **kw):
        with self.assertRaises(ChannelClosedByBroker) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.reply_code, code, cm.exception.reply_text)
        self.ch = self.conn.channel()

    def test_publish_consume_ack(self):
        q = self.ch.queue_declare("", exclusive=True).method.queue
        self.assertTrue(q.startswith("amq.gen-"))
        for i in range(50):
            self.ch.basic_publish("", q, str(i).encode())
        got = []

        def on_message(ch, method, props, body):
            got.append(int(body))
            ch.basic_ack(method.delivery_tag)
            if len(got) == 50:
                ch.stop_consuming()

        self.ch.basic_consume(q, on_message, consumer_tag="pika-1")
        self.ch.start_consuming()
        self.assertEqual(got, list(range(50)))
        self.assertEqual(self.ch.queue_declare(q, passive=True).method.message_count, 0)

    def test_get_empty_reject_recover(self):
        self.ch.queue_declare("g")
        self.assertEqual(self.ch.basic_get("g"), (None, None, None))
        self.ch.basic_publish("", "g", b"one")
        method, _, body = self.ch.basic_get("g")
        self.assertEqual(body, b"one")
        self.ch.basic_reject(method.delivery_tag, requeue=True)
        method, _, body = self.ch.basic_get("g")
        self.assertTrue(method.redelivered)
        self.ch.basic_recover(requeue=True)
        method, _, body = self.ch.basic_get("g", auto_ack=True)
        self.assertEqual(body, b"one")
        self.assertEqual(self.ch.queue_delete("g").method.message_count, 0)

    def test_exchanges(self):
        self.ch.exchange_declare("t", "topic")
        self.ch.exchange_declare("f", "fanout", durable=True)
        self.ch.queue_declare("tq")
        self.ch.queue_declare("fq")
        self.ch.queue_bind("tq", "t", "a.#")
        self.ch.exchange_bind("f", "t", "a.b")
        self.ch.queue_bind("fq", "f")
        self.ch.basic_publish("t", "a.b", b"both")
        self.ch.basic_publish("t", "a.c", b"topic only")
        self.assertEqual(self.ch.basic_get("tq", auto_ack=True)[2], b"both")
        self.assertEqual(self.ch.basic_get("tq", auto_ack=True)[2], b"topic only")
        self.assertEqual(self.ch.basic_get("fq", auto_ack=True)[2], b"both")
        self.assertEqual(self.ch.basic_get("fq", auto_ack=True)[0], None)
        self.ch.queue_unbind("tq", "t", "a.#")
        self.ch.basic_publish("t", "a.x", b"nowhere")
        self.assertEqual(self.ch.basic_get("tq", auto_ack=True)[0], None)

    def test_confirms_and_mandatory(self):
        self.ch.confirm_delivery()
        self.ch.queue_declare("d", durable=True)
        for i in range(100):
            self.ch.basic_publish("", "d", b"x", pika.BasicProperties(delivery_mode=2))
        self.assertEqual(self.ch.queue_declare("d", passive=True, durable=True).method.message_count, 100)
        with self.assertRaises(UnroutableError):
            self.ch.basic_publish("", "nowhere", b"x", mandatory=True)

    def test_connection_blocked_by_a_memory_alarm(self):
        events = []
        self.conn.add_on_connection_blocked_callback(lambda _c, m: events.append(("blocked", m.method.reason)))
        self.conn.add_on_connection_unblocked_callback(lambda _c, _m: events.append(("unblocked",)))
        self.ch.queue_declare("alarm", durable=True)
        limit = "/api/nodes/" + urllib.parse.quote(self.node.name, safe="") + "/memory_high_watermark"
        self.assertEqual(self.node.put(limit, {"absolute": 1}), 204)
        self.ch.basic_publish("", "alarm", b"first")
        deadline = time.time() + 30
        while not events and time.time() < deadline:
            self.conn.process_data_events(time_limit=0.1)
        self.assertEqual(events, [("blocked", "low on memory")])
        # As RabbitMQ's reader, the node stops reading this connection after
        # the content header of "first": its body waits in the socket, so
        # other connections find the queue empty while the alarm lasts.
        other = self.node.connect()
        try:
            method, _props, body = other.channel().basic_get("alarm", auto_ack=True)
            self.assertIsNone(method)
        finally:
            other.close()
        self.assertEqual(self.node.put(limit, {"relative": 0.9}), 204)
        while len(events) < 2 and time.time() < deadline:
            self.conn.process_data_events(time_limit=0.1)
        self.assertEqual(events[1:], [("unblocked",)])
        # Unblocked, "first" is completed and goes in before what follows.
        self.ch.confirm_delivery()
        self.ch.basic_publish("", "alarm", b"after")
        self.assertEqual(self.ch.basic_get("alarm", auto_ack=True)[2], b"first")
        self.assertEqual(self.ch.basic_get("alarm", auto_ack=True)[2], b"after")

    def test_errors(self):
        self.assert_closed_with(404, self.ch.queue_declare, "missing", passive=True)
        self.assert_closed_with(404, self.ch.exchange_declare, "missing", passive=True)
        self.ch.queue_declare("ttl", arguments={"x-message-ttl": 1000})
        self.assert_closed_with(406, self.ch.queue_declare, "ttl", arguments={"x-message-ttl": 5})
        self.assert_closed_with(406, self.ch.queue_declare, "ttl", durable=True, arguments={"x-message-ttl": 1000})
        self.assert_closed_with(403, self.ch.queue_declare, "amq.mine")
        self.assert_closed_with(403, self.ch.exchange_declare, "amq.mine", "direct")
        self.ch.queue_declare("excl", exclusive=True)
        other = self.node.connect()
        och = other.channel()
        with self.assertRaises(ChannelClosedByBroker) as cm:
            och.basic_consume("excl", lambda *a: None)
        self.assertEqual(cm.exception.reply_code, 405)
        other.close()
        self.ch.queue_declare("full")
        self.ch.basic_publish("", "full", b"x")
        self.assert_closed_with(406, self.ch.queue_delete, "full", if_empty=True)

    def test_bad_login(self):
        with self.assertRaises(pika.exceptions.AMQPConnectionError):
            self.node.connect(password="nope")

    def test_qos_prefetch(self):
        self.ch.queue_declare("p")
        for i in range(10):
            self.ch.basic_publish("", "p", str(i).encode())
        self.ch.basic_qos(prefetch_count=3)
        seen = []
        self.ch.basic_consume("p", lambda ch, m, p, b: seen.append(m.delivery_tag))
        deadline = time.time() + 30
        while len(seen) < 3 and time.time() < deadline:
            self.conn.process_data_events(time_limit=0.05)
        self.conn.process_data_events(time_limit=0.2)
        self.assertEqual(len(seen), 3)
        self.ch.basic_ack(seen[-1], multiple=True)
        while len(seen) < 6 and time.time() < deadline:
            self.conn.process_data_events(time_limit=0.05)
        self.assertEqual(len(seen), 6)

    def test_tx(self):
        self.ch.queue_declare("tx")
        self.ch.tx_select()
        self.ch.basic_publish("", "tx", b"a")
        self.ch.tx_rollback()
        self.ch.basic_publish("", "tx", b"b")
        self.ch.tx_commit()
        self.assertEqual(self.ch.basic_get("tx", auto_ack=True)[2], b"b")
        self.assertEqual(self.ch.basic_get("tx", auto_ack=True)[0], None)

    def test_dead_letter(self):
        self.ch.queue_declare("dead")
        self.ch.queue_declare("live", arguments={"x-dead-letter-exchange": "",
                                                 "x-dead-letter-routing-key": "dead"})
        self.ch.basic_publish("", "live", b"bye")
        method, _, _ = self.ch.basic_get("live")
        self.ch.basic_nack(method.delivery_tag, requeue=False)
        method, props, body = self.ch.basic_get("dead", auto_ack=True)
        self.assertEqual(body, b"bye")
        self.assertEqual(props.headers["x-death"][0]["reason"], "rejected")

    def test_dead_letter_keeps_original_expiration(self):
        # RabbitMQ 3.10 strips a dead letter's per-message TTL and keeps it
        # in x-death as original-expiration (aio-pika's test_expiration).
        self.ch.queue_declare("dead")
        self.ch.queue_declare("short", arguments={"x-dead-letter-exchange": "",
                                                  "x-dead-letter-routing-key": "dead"})
        self.ch.basic_publish("", "short", b"late", pika.BasicProperties(expiration="100"))
        deadline = time.monotonic() + 10
        method = None
        while method is None and time.monotonic() < deadline:
            method, props, body = self.ch.basic_get("dead", auto_ack=True)
            time.sleep(0.05)
        self.assertIsNotNone(method, "no dead letter within 10 s")
        death = props.headers["x-death"][0]
        self.assertEqual((death["reason"], death["original-expiration"]), ("expired", "100"))
        self.assertIsNone(props.expiration)

    def test_queue_delete_ok_precedes_the_consumers_cancel(self):
        # RabbitMQ 3.10 answers queue.delete-ok first, then sends basic.cancel
        # to the queue's consumers, those of the deleting channel too
        # (kombu's test_ack_from_another_thread waits on delete-ok).
        raw = RawClient(self.node.port)
        try:
            raw.send(1, spec.Channel.Open())
            raw.expect(spec.Channel.OpenOk)
            raw.send(1, spec.Queue.Declare(queue="gone"))
            raw.expect(spec.Queue.DeclareOk)
            raw.send(1, spec.Basic.Consume(queue="gone", consumer_tag="t"))
            raw.expect(spec.Basic.ConsumeOk)
            raw.send(1, spec.Queue.Delete(queue="gone"))
            got = [type(raw.method()).__name__ for _ in range(2)]
            self.assertEqual(got, ["DeleteOk", "Cancel"])
        finally:
            raw.close()

    def test_frames_sent_behind_a_connection_close_are_read_not_reset(self):
        # A client may still write what it queued behind its connection.close
        # (amqplib's publishes) after close-ok: RabbitMQ 3.10 reads on until
        # the client hangs up, so those writes never fail with EPIPE.
        raw = RawClient(self.node.port)
        try:
            raw.send(1, spec.Channel.Open())
            raw.expect(spec.Channel.OpenOk)
            raw.send(0, spec.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
            raw.expect(spec.Connection.CloseOk)
            publish = pframe.Method(1, spec.Basic.Publish(routing_key="q")).marshal()
            for _ in range(5):
                time.sleep(0.1)
                raw.sock.sendall(publish)
            self.assertEqual(raw.sock.recv(1), b"", "the broker ends with a clean EOF")
        finally:
            raw.close()

    def test_unbind_of_a_missing_queue_or_exchange_is_ok(self):
        # Unbinding is idempotent in RabbitMQ 3.10 (aio-pika's cleanups unbind
        # after deleting); binding a missing queue is still 404.
        self.ch.exchange_declare("ux", "direct")
        self.ch.queue_declare("uq")
        self.ch.queue_unbind("missing-q", "ux", "k")
        self.ch.queue_unbind("uq", "missing-x", "k")
        self.ch.exchange_unbind("missing-x", "ux", "k")
        self.ch.exchange_unbind("ux", "missing-x", "k")
        self.assert_closed_with(404, self.ch.queue_bind, "missing-q", "ux", "k")
        self.assert_closed_with(403, self.ch.queue_unbind, "uq", "", "uq")

    def test_exclusivity_differing_on_redeclare_is_405(self):
        # RabbitMQ 3.10: 405 RESOURCE_LOCKED either way, checked before durable,
        # and an exclusive declare's durable flag is ignored (aiormq's
        # test_exclusive_queue_locked).
        self.ch.queue_declare("ex", exclusive=True)
        self.assert_closed_with(405, self.ch.queue_declare, "ex")
        self.assert_closed_with(405, self.ch.queue_declare, "ex", durable=True)
        self.ch.queue_declare("ex", exclusive=True, durable=True)
        self.ch.queue_declare("plain")
        self.assert_closed_with(405, self.ch.queue_declare, "plain", exclusive=True, durable=True)

    def test_sigkill_keeps_confirmed(self):
        self.ch.confirm_delivery()
        self.ch.queue_declare("keep", durable=True)
        for i in range(300):
            self.ch.basic_publish("", "keep", str(i).encode(), pika.BasicProperties(delivery_mode=2))
        self.conn = None
        self.node.kill()
        self.node = Node(self.node.data_dir)
        self.conn = self.node.connect()
        self.ch = self.conn.channel()
        self.assertEqual(self.ch.queue_declare("keep", passive=True).method.message_count, 300)
        self.assertEqual(self.ch.basic_get("keep", auto_ack=True)[2], b"0")

    def test_sigterm(self):
        self.ch.queue_declare("keep", durable=True)
        self.ch.basic_publish("", "keep", b"m", pika.BasicProperties(delivery_mode=2))
        self.ch.queue_declare("keep", passive=True)
        self.conn = None
        self.assertEqual(self.node.terminate(), 0)
        self.node = Node(self.node.data_dir)
        self.conn = self.node.connect()
        self.ch = self.conn.channel()
        self.assertEqual(self.ch.basic_get("keep", auto_ack=True)[2], b"m")


if __name__ == "__main__":
    if not os.path.exists(BIN):
        sys.exit(f"no warren binary at {BIN}: build it or set WARREN_BIN")
    unittest.main(verbosity=2)
