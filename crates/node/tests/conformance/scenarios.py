#!/usr/bin/env python3
"""Queue-feature scenarios run by a real client (pika) against a 3-node broker.

The same script runs against RabbitMQ 3.10 (`cargo xtask conformance
--record` stores its outcomes in rabbitmq-3.10.json) and against Warren
(`crates/node/tests/conformance.rs` compares Warren's outcomes with the
recorded ones). Expected results therefore come from RabbitMQ, never by hand.

Each scenario runs in three placements, four with --failover:
  plain     a queue no mirroring policy matches; client on node 1
  master    a mirrored queue (policy `ha-all`, `^ha\\.`); client on its master's node
  mirror    the same, declared through node 1, used through node 2
  failover  as mirror, but once its queue is declared, node 1 (the master) is killed:
            the script prints `FAILOVER <queue>` on stdout and waits for a
            line on stdin; the harness waits for the queue's synchronised
            mirrors, kills node 1 abruptly, waits for a mirror to take over,
            starts node 1 again and answers. Node 3 then stands in for node 1.

The harness sets these policies before running (see POLICIES below, which the
harnesses read with `--policies`).

Usage: scenarios.py --urls U1,U2,U3 [--only NAME[,NAME…]] [--failover] > outcomes.json
       scenarios.py --policies      (prints the policies as JSON)
       scenarios.py --settings      (prints the brokers' settings as JSON)
"""

import decimal
import json
import signal
import socket
import sys
import threading
import time

import pika

# name -> (pattern, definition, priority); set by the harness.
POLICIES = {
    "ha-all": (r"^ha\.", {"ha-mode": "all", "ha-sync-mode": "automatic"}, 0),
    "ha-two": (
        r"^ha\.two\.",
        {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"},
        1,
    ),
    "ha-limits": (
        r"^ha\.limits\.",
        {
            "ha-mode": "all",
            "ha-sync-mode": "automatic",
            "max-length": 3,
            "overflow": "reject-publish",
        },
        1,
    ),
    "plain-limits": (
        r"^plain\.limits\.",
        {"max-length": 3, "overflow": "reject-publish"},
        1,
    ),
    "ha-pttl": (
        r"^ha\.pttl\.",
        {
            "ha-mode": "all",
            "ha-sync-mode": "automatic",
            "message-ttl": 100,
            "dead-letter-exchange": "",
            "dead-letter-routing-key": "dlq.pttl",
        },
        1,
    ),
    "plain-pttl": (
        r"^plain\.pttl\.",
        {
            "message-ttl": 100,
            "dead-letter-exchange": "",
            "dead-letter-routing-key": "dlq.pttl",
        },
        1,
    ),
}

# Broker settings (rabbitmq.conf keys Warren reads too) both harnesses
# start their nodes with; printed by `--settings`.
SETTINGS = {
    # Short enough for the consumer_timeout scenario to see it.
    "consumer_timeout": 3000,
}

SCENARIO_TIMEOUT_S = 30


class Timeout(Exception):
    pass


def on_alarm(_sig, _frame):
    raise Timeout()


def persistent(**kw):
    return pika.BasicProperties(delivery_mode=2, **kw)


def closed(e):
    """A broker's channel or connection close as [code, text]."""
    return [e.reply_code, e.reply_text]


class Ctx:
    """Connections for one scenario in one placement."""

    def __init__(self, urls, placement, scenario):
        self.urls = urls
        self.placement = placement
        kind = "plain" if placement == "plain" else "ha"
        self.prefix = f"{kind}."
        self.name = f"{scenario}.{placement}"
        self.conns = []
        self.failed_over = False
        self.admin = self.connect(0)
        self.use = self.connect(0 if placement in ("plain", "master") else 1)

    def declare(self, queue, durable=True, arguments=None, auto_delete=False,
                fail_over=True):
        """Declares through node 1; in the mirror placement, waits (10 s at
        most) until node 2 knows the queue. RabbitMQ knows it everywhere at
        declare-ok; Warren's other nodes learn it from the replicated
        metadata a moment later (the scenario use_right_after_declare
        records that difference)."""
        declare(self.admin, queue, durable, arguments, auto_delete)
        if self.use is self.admin:
            return
        for _ in range(100):
            if isinstance(passive_count(self.use, queue), int):
                break
            time.sleep(0.1)
        if fail_over and queue.startswith(self.prefix):
            self.fail_over(queue)

    def fail_over(self, queue):
        """In the failover placement, once per scenario: has the harness
        kill queue's master (node 1) and start it again; node 3 then serves
        as the admin connection."""
        if self.placement != "failover" or self.failed_over:
            return
        self.failed_over = True
        left = signal.alarm(0)
        print(f"FAILOVER {queue}", flush=True)
        sys.stdin.readline()
        self.admin = self.connect(2)
        signal.alarm(max(left, 1))

    def queue(self, feature=""):
        """This scenario's queue name (policies match on `feature`)."""
        return f"{self.prefix}{feature}{self.name}"

    def connect(self, node):
        c = pika.BlockingConnection(pika.URLParameters(self.urls[node]))
        self.conns.append(c)
        return c

    def channel(self, conn, confirm=False):
        ch = conn.channel()
        if confirm:
            ch.confirm_delivery()
        return ch

    def close(self):
        for c in self.conns:
            try:
                c.close()
            except Exception:
                pass


def publish_each(ch, queue, bodies, props=None, mandatory=False):
    """Publishes with confirms one by one: 'ack', 'nack' or 'returned' each."""
    out = []
    for b in bodies:
        try:
            ch.basic_publish("", queue, b, props or persistent(), mandatory=mandatory)
            out.append("ack")
        except pika.exceptions.NackError:
            out.append("nack")
        except pika.exceptions.UnroutableError:
            out.append("returned")
    return out


def take_unacked(ch, queue, n):
    """basic.get (manual ack) up to `n` times: [delivery tag, body] each."""
    taken = []
    for _ in range(n):
        m, _props, body = ch.basic_get(queue, auto_ack=False)
        if m is not None:
            taken.append((m.delivery_tag, body.decode()))
    return taken


def get_all(ch, queue, limit=100):
    """basic.get (auto-ack) until empty: [body, redelivered, priority] each."""
    got = []
    for _ in range(limit):
        m, props, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            break
        got.append([body.decode(), m.redelivered, props.priority])
    return got


def x_death(props):
    deaths = (props.headers or {}).get("x-death") or []
    return [
        {
            "reason": d.get("reason"),
            "queue": d.get("queue"),
            "count": d.get("count"),
            "exchange": d.get("exchange"),
            "routing-keys": d.get("routing-keys"),
        }
        for d in deaths
    ]


def wait_for_count(conn, queue, n, seconds=5.0):
    """Waits (at most `seconds`) until `queue` holds at least `n` messages."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        count = passive_count(conn, queue)
        if not isinstance(count, int) or count >= n:
            return
        time.sleep(0.05)


def get_dead(ch, queue):
    got = []
    for _ in range(100):
        m, props, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            break
        got.append([body.decode(), x_death(props)])
    return got


def passive_count(conn, queue):
    ch = conn.channel()
    try:
        ok = ch.queue_declare(queue, passive=True)
        n = ok.method.message_count
        ch.close()
        return n
    except pika.exceptions.ChannelClosedByBroker as e:
        return closed(e)


def passive_counts(conn, queue):
    """A passive declare's [messages, consumers]."""
    ch = conn.channel()
    try:
        ok = ch.queue_declare(queue, passive=True)
        ch.close()
        return [ok.method.message_count, ok.method.consumer_count]
    except pika.exceptions.ChannelClosedByBroker as e:
        return closed(e)


def declare(conn, queue, durable=True, arguments=None, auto_delete=False):
    ch = conn.channel()
    ch.queue_declare(queue, durable=durable, arguments=arguments, auto_delete=auto_delete)
    ch.close()


def delete(conn, queue):
    try:
        ch = conn.channel()
        ch.queue_delete(queue)
        ch.close()
    except Exception:
        pass


def settle(seconds):
    """Lets time pass (TTLs, expiry) without a client doing anything."""
    time.sleep(seconds)


# ---- scenarios: each returns a JSON-able outcome ---------------------------


def basic_get(ctx):
    q = ctx.queue()
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, [f"m{i}" for i in range(5)])
    count = passive_count(ctx.use, q)
    return {"publish": acks, "count": count, "got": get_all(ch, q)}


def missing_queue(ctx):
    return {"passive": passive_count(ctx.use, ctx.queue("missing."))}


def nondurable(ctx):
    q = ctx.queue("transient.")
    ctx.declare(q, durable=False)
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"passive": passive_count(ctx.use, q)}
    out["publish"] = publish_each(
        ch, q, ["t0", "t1"], props=pika.BasicProperties(), mandatory=True
    )
    out["got"] = get_all(ch, q)
    return out


def max_length_policy(ctx):
    q = ctx.queue("limits.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, [f"m{i}" for i in range(5)])
    return {"publish": acks, "count": passive_count(ctx.use, q), "got": get_all(ch, q)}


def max_length_drop_head(ctx):
    q = ctx.queue("dh.")
    ctx.declare(q, arguments={"x-max-length": 2})
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, [f"m{i}" for i in range(4)])
    return {"publish": acks, "got": get_all(ch, q)}


def overflow_reject_publish(ctx):
    q = ctx.queue("rp.")
    ctx.declare(q, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, [f"m{i}" for i in range(4)])
    return {"publish": acks, "got": get_all(ch, q)}


def ttl_dead_letter(ctx):
    q = ctx.queue("ttl.")
    dlq = f"dlq.{ctx.name}"
    ctx.declare(dlq)
    args = {
        "x-message-ttl": 100,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dlq,
    }
    ctx.declare(q, arguments=args)
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, ["e0", "e1", "e2"])
    settle(1.5)
    out = {"publish": acks, "left": get_all(ch, q), "dead": get_dead(ch, dlq)}
    delete(ctx.admin, dlq)
    return out


def policy_ttl_dead_letter(ctx):
    q = ctx.queue("pttl.")
    dlq = "dlq.pttl"
    ctx.declare(dlq)
    ch = ctx.channel(ctx.use, confirm=True)
    ch.queue_purge(dlq)
    ctx.declare(q)
    acks = publish_each(ch, q, ["p0", "p1"])
    settle(1.5)
    out = {"publish": acks, "left": get_all(ch, q), "dead": get_dead(ch, dlq)}
    delete(ctx.admin, dlq)
    return out


def reject_dead_letter(ctx):
    q = ctx.queue("rej.")
    dlq = f"dlq.{ctx.name}"
    ctx.declare(dlq)
    args = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}
    ctx.declare(q, arguments=args)
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, ["r0", "r1"])
    rejected = 0
    for _ in range(2):
        m, _props, _body = ch.basic_get(q, auto_ack=False)
        if m is not None:
            ch.basic_reject(m.delivery_tag, requeue=False)
            rejected += 1
    # Dead-lettering is asynchronous (RabbitMQ's too): the dead letters may
    # reach their queue, on another node, after the client's next get.
    wait_for_count(ctx.use, dlq, rejected)
    out = {"publish": acks, "left": get_all(ch, q), "dead": get_dead(ch, dlq)}
    delete(ctx.admin, dlq)
    return out


def get_polled(ch, queue, tries=50):
    """basic.get (manual ack) until a message comes (dead-lettering may
    take a moment): the method frame, or None."""
    for _ in range(tries):
        m, _props, _body = ch.basic_get(queue, auto_ack=False)
        if m is not None:
            return m
        time.sleep(0.05)
    return None


def dead_letter_cycle(ctx):
    """Rejected around a cycle of two queues (a, b, a): RabbitMQ counts the
    deaths per queue and reason in x-death."""
    a = ctx.queue("dlca.")
    b = ctx.queue("dlcb.")
    ctx.declare(a, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": b})
    ctx.declare(b, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": a},
                fail_over=False)
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, a, ["c0"])
    hops = []
    for q in [a, b, a]:
        m = get_polled(ch, q)
        hops.append(m is not None)
        if m is not None:
            ch.basic_reject(m.delivery_tag, requeue=False)
    dead = []
    for _ in range(50):
        dead = get_dead(ch, b)
        if dead:
            break
        time.sleep(0.05)
    return {"publish": acks, "hops": hops, "dead": dead, "left": get_all(ch, a)}


def redeclare_other_arguments(ctx):
    """Redeclares with other arguments: which differences RabbitMQ refuses."""
    q = ctx.queue("redecl.")
    ctx.declare(q, arguments={"x-custom": 1, "x-max-length": 10})
    out = {}
    tries = [
        ("unknown changed", {"x-custom": 2, "x-max-length": 10}),
        ("unknown dropped", {"x-max-length": 10}),
        ("unknown added", {"x-custom": 1, "x-other": "y", "x-max-length": 10}),
        ("known changed", {"x-custom": 1, "x-max-length": 11}),
        ("known added", {"x-custom": 1, "x-max-length": 10, "x-message-ttl": 1000}),
    ]
    for name, args in tries:
        ch = ctx.use.channel()
        try:
            ch.queue_declare(q, durable=True, arguments=args)
            out[name] = "ok"
            ch.close()
        except pika.exceptions.ChannelClosedByBroker as e:
            out[name] = closed(e)
    return out


def redeclare_exchange_arguments(ctx):
    """Redeclares an exchange with other arguments: which differences
    RabbitMQ refuses."""
    x = ctx.queue("redeclx.")
    ch = ctx.admin.channel()
    ch.exchange_declare(x, "direct", durable=True,
                        arguments={"x-custom": 1, "alternate-exchange": "ae1"})
    ch.close()
    # Known on the node used (Warren's other nodes learn it a moment later).
    for _ in range(100):
        try:
            ch = ctx.use.channel()
            ch.exchange_declare(x, passive=True)
            ch.close()
            break
        except pika.exceptions.ChannelClosedByBroker:
            time.sleep(0.1)
    out = {}
    tries = [
        ("unknown changed", {"x-custom": 2, "alternate-exchange": "ae1"}),
        ("unknown dropped", {"alternate-exchange": "ae1"}),
        ("alternate changed", {"x-custom": 1, "alternate-exchange": "ae2"}),
        ("alternate dropped", {"x-custom": 1}),
    ]
    for name, args in tries:
        ch = ctx.use.channel()
        try:
            ch.exchange_declare(x, "direct", durable=True, arguments=args)
            out[name] = "ok"
            ch.close()
        except pika.exceptions.ChannelClosedByBroker as e:
            out[name] = closed(e)
    ch = ctx.admin.channel()
    ch.exchange_delete(x)
    ch.close()
    return out


def tx_ack_unknown_tag(ctx):
    """In a transaction, an ack of a tag never delivered: refused when it
    comes, or at tx.commit."""
    q = ctx.queue("txu.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use)
    ch.basic_publish("", q, "t0", persistent())
    ch.tx_select()
    stage = "ack"
    try:
        ch.basic_ack(999)
        # A round trip: a channel the ack closed fails here.
        ch.basic_qos(prefetch_count=0)
        stage = "commit"
        ch.tx_commit()
        stage = "none"
    except pika.exceptions.ChannelClosedByBroker as e:
        return {"closed_at": stage, "close": closed(e), "count": passive_count(ctx.use, q)}
    return {"closed_at": stage, "count": passive_count(ctx.use, q)}


def expires_with_consumer(ctx):
    q = ctx.queue("exp.")
    # Failed over with its consumer on: unused for longer than x-expires
    # during the failover, it would (rightly) be gone.
    ctx.declare(q, arguments={"x-expires": 1000}, fail_over=False)
    ch = ctx.channel(ctx.use)
    tag = ch.basic_consume(q, lambda *a: None)
    ctx.fail_over(q)
    ctx.use.process_data_events(time_limit=2.5)
    out = {"with_consumer": passive_count(ctx.admin, q)}
    ch.basic_cancel(tag)
    ctx.use.process_data_events(time_limit=2.5)
    out["after_cancel"] = passive_count(ctx.admin, q)
    return out


def auto_delete_two_consumers(ctx):
    q = ctx.queue("ad.")
    ctx.declare(q, durable=False, auto_delete=True)
    a = ctx.channel(ctx.admin)
    ta = a.basic_consume(q, lambda *x: None)
    b = ctx.channel(ctx.use)
    tb = b.basic_consume(q, lambda *x: None)
    b.basic_cancel(tb)
    ctx.use.process_data_events(time_limit=0.5)
    out = {"one_cancelled": passive_count(ctx.use, q)}
    a.basic_cancel(ta)
    # Gone once the last consumer's cancel reaches the queue (3 s at most).
    deadline = time.time() + 3
    while isinstance(passive_count(ctx.use, q), int) and time.time() < deadline:
        ctx.admin.process_data_events(time_limit=0.05)
    out["both_cancelled"] = passive_count(ctx.use, q)
    return out


def priority(ctx):
    q = ctx.queue("prio.")
    ctx.declare(q, arguments={"x-max-priority": 10})
    ch = ctx.channel(ctx.use, confirm=True)
    for p in [1, 5, 9, 3, 0]:
        publish_each(ch, q, [f"p{p}"], props=persistent(priority=p))
    return {"got": get_all(ch, q)}


def priority_requeue(ctx):
    """Requeued messages go back into their priority at their old place:
    rejected one by one, then the rest by closing the channel."""
    q = ctx.queue("prio.")
    ctx.declare(q, arguments={"x-max-priority": 10})
    ch = ctx.channel(ctx.use, confirm=True)
    for body, p in [("a2", 2), ("b7", 7), ("c2", 2), ("d7", 7), ("e0", 0), ("f9", 9)]:
        publish_each(ch, q, [body], props=persistent(priority=p))
    taker = ctx.channel(ctx.use)
    taken = []
    for _ in range(4):
        m, _props, body = taker.basic_get(q, auto_ack=False)
        if m is not None:
            taken.append((m.delivery_tag, body.decode()))
    # Taken: f9 b7 d7 a2. f9 and b7 are rejected (b7 first); d7 and a2
    # come back with the close.
    for tag, _body in reversed(taken[:2]):
        taker.basic_reject(tag, requeue=True)
    first = get_all(ch, q, limit=2)
    taker.close()
    settle(0.3)
    return {
        "taken": [b for _, b in taken],
        "after_reject": first,
        "after_close": get_all(ch, q),
    }


def priority_consume(ctx):
    """A consumer (prefetch 1) gets the highest priority first; a message
    published while it works goes ahead of lower ones already queued."""
    q = ctx.queue("prio.")
    ctx.declare(q, arguments={"x-max-priority": 5})
    ch = ctx.channel(ctx.use, confirm=True)
    for body, p in [("a1", 1), ("b0", 0), ("c4", 4), ("d1", 1)]:
        publish_each(ch, q, [body], props=persistent(priority=p))
    cons = ctx.channel(ctx.use)
    cons.basic_qos(prefetch_count=1)
    got = []
    for m, props, body in cons.consume(q, inactivity_timeout=1.0):
        if m is None:
            break
        got.append([body.decode(), props.priority])
        if body == b"c4":
            publish_each(ch, q, ["e3"], props=persistent(priority=3))
        cons.basic_ack(m.delivery_tag)
    cons.cancel()
    return {"got": got}


def priority_max_length(ctx):
    """x-max-length on a priority queue: which messages are dropped."""
    q = ctx.queue("prio.")
    ctx.declare(q, arguments={"x-max-priority": 5, "x-max-length": 3})
    ch = ctx.channel(ctx.use, confirm=True)
    for body, p in [("a1", 1), ("b3", 3), ("c5", 5), ("d0", 0), ("e5", 5), ("f2", 2)]:
        publish_each(ch, q, [body], props=persistent(priority=p))
    return {"got": get_all(ch, q)}


def priority_above_max(ctx):
    """Priorities above x-max-priority count as the maximum; the property
    itself is delivered unchanged."""
    q = ctx.queue("prio.")
    ctx.declare(q, arguments={"x-max-priority": 3})
    ch = ctx.channel(ctx.use, confirm=True)
    for body, p in [("a5", 5), ("b2", 2), ("c9", 9), ("d3", 3), ("e0", 0)]:
        publish_each(ch, q, [body], props=persistent(priority=p))
    publish_each(ch, q, ["f-none"], props=persistent())
    return {"got": get_all(ch, q)}


def priority_arguments(ctx):
    """Which x-max-priority values a declare accepts, and RabbitMQ's refusals."""
    q = ctx.queue("prio.")
    out = {}
    for value in [0, 1, 255, 256, -1, "ten", 300000]:
        ch = ctx.use.channel()
        try:
            ch.queue_declare(q, durable=True, arguments={"x-max-priority": value})
            ch.queue_delete(q)
            ch.close()
            out[str(value)] = "ok"
        except pika.exceptions.ChannelClosedByBroker as e:
            out[str(value)] = closed(e)
    declare(ctx.admin, q, arguments={"x-max-priority": 4})
    ch = ctx.use.channel()
    try:
        ch.queue_declare(q, durable=True, arguments={"x-max-priority": 5})
        out["redeclare"] = "ok"
    except pika.exceptions.ChannelClosedByBroker as e:
        out["redeclare"] = closed(e)
    return out


def queue_mode(ctx):
    """Which x-queue-mode values a declare accepts, RabbitMQ's refusals, and
    a lazy queue's messages coming back (bodies read back from disk)."""
    out = {}
    for i, value in enumerate(["default", "lazy", "eager", 1]):
        q = ctx.queue(f"mode{i}.")
        ch = ctx.use.channel()
        try:
            ch.queue_declare(q, durable=True, arguments={"x-queue-mode": value})
            ch.queue_delete(q)
            ch.close()
            out[str(value)] = "ok"
        except pika.exceptions.ChannelClosedByBroker as e:
            out[str(value)] = closed(e)
    q = ctx.queue("lazy.")
    ctx.declare(q, arguments={"x-queue-mode": "lazy"})
    ch = ctx.channel(ctx.use, confirm=True)
    out["publish"] = publish_each(ch, q, ["l0", "l1", "l2"])
    out["got"] = get_all(ch, q)
    return out


def declared_again(ctx):
    """A queue deleted and declared again at once, several times over, on
    the client's node, then declared through node 1: the last declaration
    is a queue like any other (confirms, messages kept), nothing of its
    predecessors in its way."""
    q = ctx.queue("again.")
    for _ in range(4):
        ch = ctx.use.channel()
        ch.queue_declare(q, durable=True)
        ch.queue_delete(q)
        ch.close()
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"publish": publish_each(ch, q, [f"a{i}" for i in range(5)])}
    out["got"] = get_all(ch, q)
    return out


def master_locator_arguments(ctx):
    """Which x-queue-master-locator values a declare accepts, and RabbitMQ's
    refusals (where the master then goes is not visible through AMQP; the
    process tests check it)."""
    q = ctx.queue("loc.")
    out = {}
    for value in ["client-local", "min-masters", "random", "least-busy", 5]:
        conn = ctx.connect(1 if ctx.placement == "mirror" else 0)
        try:
            ch = conn.channel()
            ch.queue_declare(q, durable=True, arguments={"x-queue-master-locator": value})
            ch.queue_delete(q)
            ch.close()
            out[str(value)] = "ok"
        except (
            pika.exceptions.ChannelClosedByBroker,
            pika.exceptions.ConnectionClosedByBroker,
        ) as e:
            out[str(value)] = closed(e)
    return out


def large_message(ctx):
    q = ctx.queue("large.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    body = b"x" * (6 * 1024 * 1024)
    acks = publish_each(ch, q, [body])
    m, _props, got = ch.basic_get(q, auto_ack=True)
    return {"publish": acks, "got": None if m is None else len(got)}


def publish_right_after_declare(ctx):
    q = ctx.queue("fresh.")
    ch = ctx.channel(ctx.use, confirm=True)
    ch.queue_declare(q, durable=True)
    acks = publish_each(ch, q, [f"f{i}" for i in range(50)])
    return {"acked": acks.count("ack"), "count": passive_count(ctx.use, q)}


def use_right_after_declare(ctx):
    q = ctx.queue("now.")
    declare(ctx.admin, q)
    ch = ctx.channel(ctx.use, confirm=True)
    acks = publish_each(ch, q, ["n0", "n1"])
    return {"publish": acks, "got": get_all(ch, q)}


def message_count_each_node(ctx):
    q = ctx.queue("count.")
    ctx.declare(q)
    ch = ctx.channel(ctx.admin, confirm=True)
    publish_each(ch, q, [f"c{i}" for i in range(5)])
    counts = []
    for node in range(len(ctx.urls)):
        conn = ctx.connect(node)
        counts.append(passive_count(conn, q))
    return {"counts": counts}



def refused(ch, act):
    """Runs `act` on channel `ch`, then a round trip: "ok", or the close
    that refused it."""
    try:
        act(ch)
        ch.basic_qos(prefetch_count=0)
        return "ok"
    except pika.exceptions.ChannelClosedByBroker as e:
        return closed(e)
    except pika.exceptions.ConnectionClosedByBroker as e:
        return ["connection"] + closed(e)


def argument_checks(ctx):
    """Arguments and properties a channel refuses (each on a channel of
    its own): acks past the last delivery, recover without requeue,
    expirations, TTLs, CC/BCC headers, x-match and x-priority values."""
    q = ctx.queue("args.")
    ctx.declare(q)
    out = {}
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q, ["a0", "a1"])
    pub.close()

    def got_then(settle):
        def act(ch):
            method, _, _ = ch.basic_get(q, auto_ack=False)
            settle(ch, method.delivery_tag)
        return act

    out["ack_multiple_past_last"] = refused(
        ctx.use.channel(), got_then(lambda ch, t: ch.basic_ack(t + 5, multiple=True)))
    out["nack_multiple_past_last"] = refused(
        ctx.use.channel(), got_then(lambda ch, t: ch.basic_nack(t + 5, multiple=True)))
    # A hard error: on a connection of its own.
    own = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    out["recover_no_requeue"] = refused(
        own.channel(), lambda ch: ch.basic_recover(requeue=False))
    for name, expiration in [("abc", "abc"), ("negative", "-5"), ("empty", ""),
                             ("huge", "4294967296"), ("unit", "5s"), ("ok", "60000")]:
        out[f"expiration_{name}"] = refused(
            ctx.use.channel(),
            lambda ch, e=expiration: ch.basic_publish(
                "", q, "e", pika.BasicProperties(expiration=e)))
    for name, headers in [("cc_string", {"CC": "x"}), ("bcc_number", {"BCC": 5}),
                          ("cc_list", {"CC": ["nowhere"]})]:
        out[f"headers_{name}"] = refused(
            ctx.use.channel(),
            lambda ch, h=headers: ch.basic_publish(
                "", q, "h", pika.BasicProperties(headers=h)))
    for i, (name, ttl) in enumerate([("2^32", 2**32), ("2^40", 2**40), ("2^32-1", 2**32 - 1)]):
        out[f"queue_ttl_{name}"] = refused(
            ctx.use.channel(),
            lambda ch, t=ttl, n=ctx.queue(f"args.ttl{i}."): ch.queue_declare(
                n, exclusive=True, arguments={"x-message-ttl": t}))
    x = f"{q}.hx"
    setup = ctx.use.channel()
    setup.exchange_declare(x, "headers", auto_delete=True)
    for name, match in [("bogus", "bogus"), ("number", 1), ("any", "any")]:
        out[f"x_match_{name}"] = refused(
            ctx.use.channel(),
            lambda ch, m=match: ch.queue_bind(q, x, arguments={"x-match": m, "k": "v"}))
    setup.exchange_delete(x)
    setup.close()
    for name, prio in [("string", "high"), ("number", 5)]:
        def consume(ch, p=prio):
            tag = ch.basic_consume(q, lambda *a: None, arguments={"x-priority": p})
            ch.basic_cancel(tag)
        out[f"consume_priority_{name}"] = refused(ctx.use.channel(), consume)
    # Publishes and requeues through another node reach the master a
    # moment later: wait (5 s at most) for all five, then count.
    wait_for_count(ctx.use, q, 5)
    out["count"] = passive_count(ctx.use, q)
    return out


def declare_argument_types(ctx):
    """Queue arguments of the wrong type or out of range, each declared on
    a channel of its own: RabbitMQ's refusals, word for word."""
    cases = [
        ("ttl_string", {"x-message-ttl": "ten"}),
        ("ttl_negative", {"x-message-ttl": -1}),
        ("ttl_decimal", {"x-message-ttl": decimal.Decimal("1.5")}),
        ("ttl_bool", {"x-message-ttl": True}),
        ("expires_string", {"x-expires": "ten"}),
        ("expires_negative", {"x-expires": -1}),
        ("expires_zero", {"x-expires": 0}),
        ("max_length_string", {"x-max-length": "ten"}),
        ("max_length_negative", {"x-max-length": -1}),
        ("max_length_huge", {"x-max-length": 2**40}),
        ("max_length_bytes_string", {"x-max-length-bytes": "ten"}),
        ("max_length_bytes_negative", {"x-max-length-bytes": -1}),
        ("dlx_number", {"x-dead-letter-exchange": 5}),
        ("dlrk_number", {"x-dead-letter-routing-key": 5}),
        ("dlrk_without_dlx", {"x-dead-letter-routing-key": "k"}),
        ("overflow_bogus", {"x-overflow": "bogus"}),
        ("overflow_number", {"x-overflow": 5}),
        ("single_active_string", {"x-single-active-consumer": "yes"}),
    ]
    out = {}
    for i, (name, args) in enumerate(cases):
        out[name] = refused(
            ctx.use.channel(),
            lambda ch, a=args, n=ctx.queue(f"args.{i}."): ch.queue_declare(
                n, exclusive=True, arguments=a))
    return out


def exchange_type_unknown(ctx):
    """An exchange declared with a type no plugin provides (on a
    connection of its own: RabbitMQ 3.10 closes it)."""
    own = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    return refused(
        own.channel(),
        lambda ch: ch.exchange_declare(ctx.queue("xt."), "x-nothing", auto_delete=True))


def consumers_of(ctx, q, specs, prefetch=2):
    """Registers one consumer per (tag, x-priority or None, connection or
    None: the placement's) of `specs`, each on a channel of its own, manual
    acks with `prefetch`. Returns (channels, received): each tag's
    [body, redelivered] in the order they came."""
    chans, got = {}, {}
    for tag, prio, *conn in specs:
        ch = ctx.channel(conn[0] if conn else ctx.use)
        ch.basic_qos(prefetch_count=prefetch)
        got[tag] = []
        ch.basic_consume(
            q,
            lambda _c, m, _p, body, t=tag: got[t].append([body.decode(), m.redelivered]),
            consumer_tag=tag,
            arguments=None if prio is None else {"x-priority": prio},
        )
        chans[tag] = ch
    return chans, got


def drop(conn):
    """A client dies: its socket is shut down under it, with no basic.cancel
    and no close (pika's close cancels every consumer first)."""
    conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)


def received(ctx, got, seconds=0.5, others=()):
    """Lets deliveries arrive for `seconds` on the placement's connection
    and `others` (pika's process_data_events returns after the first
    event), then what each consumer holds so far."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        for c in (ctx.use, *others):
            if c.is_open:
                c.process_data_events(time_limit=0.02)
    return {t: list(v) for t, v in got.items()}


def consumer_priority(ctx):
    """Consumers' x-priority: the highest with room under its prefetch gets
    each message, equal priorities take turns, lower ones only while the
    higher are full; an ack makes room at the top again."""
    q = ctx.queue("cprio.")
    ctx.declare(q)
    chans, got = consumers_of(
        ctx, q, [("none", None), ("five-a", 5), ("five-b", 5), ("minus", -1), ("two", 2)])
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q, [f"m{i}" for i in range(9)])
    out = {"first": received(ctx, got), "ready": passive_count(ctx.use, q)}
    publish_each(pub, q, ["n0", "n1"])
    chans["two"].basic_ack(0, multiple=True)
    chans["five-a"].basic_ack(0, multiple=True)
    out["acked"] = received(ctx, got)
    for ch in chans.values():
        ch.close()
    wait_for_count(ctx.use, q, 11)
    out["requeued"] = get_all(ctx.channel(ctx.use), q)
    return out


def single_active_consumer(ctx):
    """x-single-active-consumer: the first consumer gets every message, the
    others none; when its client dies (its socket closes), the next in
    line takes over and gets what it held back first."""
    q = ctx.queue("sac.")
    ctx.declare(q, arguments={"x-single-active-consumer": True})
    own = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    chans, got = consumers_of(ctx, q, [("a", None, own), ("b", None), ("c", None)])
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q, [f"m{i}" for i in range(5)])
    out = {"first": received(ctx, got, others=[own]), "ready": passive_counts(ctx.use, q)}
    drop(own)
    out["a gone"] = received(ctx, got)
    chans["b"].basic_ack(0, multiple=True)
    out["b acked"] = received(ctx, got)
    out["end"] = passive_counts(ctx.use, q)
    return out


def single_active_consumer_priority(ctx):
    """x-single-active-consumer with consumers' x-priority: which consumer
    is active first, and which takes over when its client dies."""
    q = ctx.queue("sac.")
    ctx.declare(q, arguments={"x-single-active-consumer": True})
    own = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    chans, got = consumers_of(ctx, q, [("low", None, own), ("high", 9), ("mid", 4)])
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q, [f"m{i}" for i in range(3)])
    out = {"first": received(ctx, got, others=[own])}
    drop(own)
    out["low gone"] = received(ctx, got)
    return out


def single_active_consumer_cancel(ctx):
    """x-single-active-consumer: the active consumer is cancelled (its
    channel stays open), then a message is published: who gets it."""
    q = ctx.queue("sac.")
    ctx.declare(q, arguments={"x-single-active-consumer": True})
    chans, got = consumers_of(ctx, q, [("a", None), ("b", None)])
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q, ["m0", "m1", "m2"])
    out = {"first": received(ctx, got)}
    chans["a"].basic_cancel("a")
    publish_each(pub, q, ["m3"])
    out["a cancelled"] = received(ctx, got)
    return out


def single_active_consumer_checks(ctx):
    """What a single-active-consumer queue refuses: an exclusive consumer,
    a non-boolean argument; a basic.get beside its active consumer."""
    q = ctx.queue("sac.")
    ctx.declare(q, arguments={"x-single-active-consumer": True})
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q, ["g0", "g1"])
    out = {"exclusive_alone": refused(
        ctx.use.channel(),
        lambda ch: ch.basic_cancel(ch.basic_consume(q, lambda *a: None, exclusive=True)))}
    holder = ctx.channel(ctx.use)
    holder.basic_qos(prefetch_count=1)
    holder.basic_consume(q, lambda *a: None, consumer_tag="holder")
    ctx.use.process_data_events(time_limit=0.3)
    out["exclusive_beside"] = refused(
        ctx.use.channel(), lambda ch: ch.basic_consume(q, lambda *a: None, exclusive=True))
    out["get_beside"] = get_all(ctx.channel(ctx.use), q)
    for name, value in [("string", "yes"), ("number", 1), ("false", False)]:
        out[f"argument_{name}"] = refused(
            ctx.use.channel(),
            lambda ch, v=value, n=ctx.queue(f"sac.arg.{name}."): ch.queue_declare(
                n, exclusive=True, arguments={"x-single-active-consumer": v}))
    holder.close()
    return out


def direct_reply_to(ctx):
    """RabbitMQ's direct reply-to: a request whose reply_to is
    amq.rabbitmq.reply-to gets a reply_to naming the requesting channel; a
    reply published there goes straight to that channel's consumer (in the
    mirror placement the RPC server is on another node)."""
    q = ctx.queue("rpc.")
    ctx.declare(q)
    client = ctx.channel(ctx.use)
    replies = []
    client.basic_consume(
        "amq.rabbitmq.reply-to",
        lambda _c, m, p, body: replies.append(
            [body.decode(), p.correlation_id, m.exchange, m.redelivered, m.routing_key]),
        auto_ack=True)
    client.basic_publish("", q, "ping", pika.BasicProperties(
        reply_to="amq.rabbitmq.reply-to", correlation_id="c1"))
    server = ctx.channel(ctx.admin, confirm=True)
    request = None
    for _ in range(50):
        request = server.basic_get(q, auto_ack=True)
        if request[0] is not None:
            break
        time.sleep(0.1)
    _m, props, body = request
    reply_to = props.reply_to or ""
    out = {"request": body.decode() if body else None,
           "reply_to": [reply_to.startswith("amq.rabbitmq.reply-to."),
                        len(reply_to) > len("amq.rabbitmq.reply-to.")]}
    out["reply"] = publish_each(
        server, reply_to, ["pong"], props=pika.BasicProperties(correlation_id="c1"),
        mandatory=True)
    deadline = time.time() + 2
    while not replies and time.time() < deadline:
        ctx.use.process_data_events(time_limit=0.1)
    out["replies"] = [r[:4] + [r[4] == reply_to] for r in replies]
    out["passive"] = passive_counts(ctx.use, "amq.rabbitmq.reply-to")
    out["second_consumer"] = refused(
        client, lambda ch: ch.basic_consume(
            "amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True))
    out["consume_with_acks"] = refused(
        ctx.use.channel(), lambda ch: ch.basic_consume(
            "amq.rabbitmq.reply-to", lambda *a: None, auto_ack=False))
    out["request_without_consumer"] = refused(
        ctx.use.channel(), lambda ch: ch.basic_publish(
            "", q, "x", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to")))
    # The requester has gone: a mandatory reply comes back.
    out["reply_to_gone"] = publish_each(
        server, reply_to, ["late"], props=pika.BasicProperties(), mandatory=True)
    out["unknown_reply_to"] = publish_each(
        server, "amq.rabbitmq.reply-to.nothing", ["x"], props=pika.BasicProperties(),
        mandatory=True)
    return out


def validated_user_id(ctx):
    """A message's user_id must be its publisher's user (RabbitMQ's
    validated user-id); one that is arrives with it."""
    q = ctx.queue("uid.")
    ctx.declare(q)
    out = {}
    for name, uid in [("own", "guest"), ("other", "mallory"), ("empty", "")]:
        out[name] = refused(
            ctx.use.channel(),
            lambda ch, u=uid: ch.basic_publish("", q, name, pika.BasicProperties(user_id=u)))
    wait_for_count(ctx.use, q, 1)
    ch = ctx.channel(ctx.use)
    got = []
    for _ in range(5):
        m, props, body = ch.basic_get(q, auto_ack=True)
        if m is None:
            break
        got.append([body.decode(), props.user_id])
    out["got"] = got
    return out


def consumer_timeout(ctx):
    """A delivery left unacknowledged past consumer_timeout (SETTINGS)
    closes its channel with 406; the message goes back, redelivered."""
    q = ctx.queue("ctimeout.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, ["slow"])
    ch = ctx.channel(ctx.use)
    ch.basic_qos(prefetch_count=1)
    got, why = [], []
    ch.basic_consume(q, lambda _c, _m, _p, body: got.append(body.decode()))
    ch._impl.add_on_close_callback(lambda _c, reason: why.append(closed(reason)))
    deadline = time.time() + 3 * SETTINGS["consumer_timeout"] / 1000
    while not why and time.time() < deadline:
        ctx.use.process_data_events(time_limit=0.1)
    wait_for_count(ctx.use, q, 1)
    return {"got": got, "closed": why, "after": get_all(ctx.channel(ctx.use), q)}


def recover_requeue(ctx):
    """basic.recover with requeue: what the channel holds unacked goes back,
    redelivered, in its place."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, ["r0", "r1", "r2"])
    ch = ctx.channel(ctx.use)
    taken = [body for _tag, body in take_unacked(ch, q, 2)]
    ch.basic_recover(requeue=True)
    return {"taken": taken, "after": get_all(ctx.channel(ctx.use), q)}


def nack_and_reject_requeue(ctx):
    """Settling out of order: basic.nack of several at once (multiple) and
    basic.reject, requeued, then the rest by closing the channel; each
    message back in its place, marked redelivered."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, [f"n{i}" for i in range(6)])
    ch = ctx.channel(ctx.use)
    tags = [tag for tag, _body in take_unacked(ch, q, 6)]
    ch.basic_nack(tags[1], multiple=True, requeue=True)
    ch.basic_reject(tags[4], requeue=True)
    ch.basic_ack(tags[2])
    other = ctx.channel(ctx.use)
    out = {"taken": len(tags), "after_settles": get_all(other, q)}
    ch.close()
    out["after_close"] = get_all(other, q)
    return out


def exclusive_consumer(ctx):
    """An exclusive consumer refuses any other, and is refused while another
    consumes."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    first = ctx.channel(ctx.use)
    tag = first.basic_consume(q, lambda *a: None, exclusive=True)
    out = {}
    try:
        ctx.channel(ctx.admin).basic_consume(q, lambda *a: None)
        out["second"] = "ok"
    except pika.exceptions.ChannelClosedByBroker as e:
        out["second"] = closed(e)
    first.basic_cancel(tag)
    plain = ctx.channel(ctx.use)
    plain.basic_consume(q, lambda *a: None)
    try:
        ctx.channel(ctx.admin).basic_consume(q, lambda *a: None, exclusive=True)
        out["exclusive_after"] = "ok"
    except pika.exceptions.ChannelClosedByBroker as e:
        out["exclusive_after"] = closed(e)
    return out


def purge_and_delete_conditions(ctx):
    """queue.purge answers the count it removed; queue.delete with if-empty
    or if-unused refuses a queue that has messages or consumers (406),
    and answers the count of what it deleted."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    publish_each(ch, q, ["p0", "p1", "p2"])
    out = {"purged": ch.queue_purge(q).method.message_count}
    out["after_purge"] = passive_count(ctx.use, q)
    publish_each(ch, q, ["d0"])
    try:
        ctx.channel(ctx.use).queue_delete(q, if_empty=True)
        out["if_empty"] = "deleted"
    except pika.exceptions.ChannelClosedByBroker as e:
        out["if_empty"] = closed(e)
    consumer = ctx.channel(ctx.use)
    tag = consumer.basic_consume(q, lambda *a: None, auto_ack=False)
    try:
        ctx.channel(ctx.use).queue_delete(q, if_unused=True)
        out["if_unused"] = "deleted"
    except pika.exceptions.ChannelClosedByBroker as e:
        out["if_unused"] = closed(e)
    consumer.basic_cancel(tag)
    consumer.close()
    # The consumer's unacked message is back (the close requeued it) before
    # the delete counts what it deletes.
    wait_for_count(ctx.use, q, 1)
    out["deleted"] = ctx.channel(ctx.use).queue_delete(q).method.message_count
    out["after_delete"] = passive_count(ctx.use, q)
    return out


def max_length_bytes(ctx):
    """x-max-length-bytes: the oldest messages go while the bodies exceed
    it."""
    q = ctx.queue("feat.")
    ctx.declare(q, arguments={"x-max-length-bytes": 10})
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"publish": publish_each(ch, q, ["aaaaa", "bbbbb", "ccccc", "dd"])}
    out["got"] = get_all(ch, q)
    return out


def alternate_exchange(ctx):
    """An exchange's alternate-exchange takes what it cannot route; a
    mandatory publish it routes that way is not returned."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    ae, x = f"ae.{ctx.name}", f"x.{ctx.name}"
    ch = ctx.channel(ctx.admin)
    ch.exchange_declare(ae, "fanout", durable=True)
    ch.queue_bind(q, ae)
    ch.exchange_declare(x, "direct", durable=True, arguments={"alternate-exchange": ae})
    pub = ctx.channel(ctx.use, confirm=True)
    out = {}
    try:
        pub.basic_publish(x, "nowhere", "via-ae", persistent(), mandatory=True)
        out["publish"] = "ack"
    except pika.exceptions.UnroutableError:
        out["publish"] = "returned"
    try:
        pub.basic_publish("", f"none.{ctx.name}", "lost", persistent(), mandatory=True)
        out["unroutable"] = "ack"
    except pika.exceptions.UnroutableError:
        out["unroutable"] = "returned"
    wait_for_count(ctx.use, q, 1)
    out["got"] = get_all(pub, q)
    ch.exchange_delete(x)
    ch.exchange_delete(ae)
    return out


def deleted_under_consumer(ctx):
    """A queue deleted under a consumer (through another node): the
    consumer is told with basic.cancel (consumer_cancel_notify)."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use)
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    ch.basic_consume(q, lambda *a: None, consumer_tag="watcher")
    ctx.channel(ctx.admin).queue_delete(q)
    deadline = time.time() + 3
    while not cancelled and time.time() < deadline:
        ctx.use.process_data_events(time_limit=0.1)
    return {"cancelled": cancelled, "after": passive_count(ctx.use, q)}


def each_node(ctx):
    """One queue used through every node, the nodes without a copy of it
    too: mirrored to two nodes of three (`ha-two`: RabbitMQ picks the
    mirror's node at random, so does Warren), or not mirrored at all (the
    plain placement). Through each node in turn: publishes, a count, a
    get, deletes with if-empty and if-unused refused (the consumer on the
    next node), a purge."""
    q = ctx.queue("two.")
    ctx.declare(q, fail_over=False)
    out = {}
    conns = [ctx.connect(i) for i in range(3)]
    for i, conn in enumerate(conns):
        ch = ctx.channel(conn, confirm=True)
        r = {"publish": publish_each(ch, q, [f"e{i}a", f"e{i}b"])}
        r["count"] = passive_count(conn, q)
        m, _props, body = ch.basic_get(q, auto_ack=True)
        r["get"] = body.decode() if m else None
        try:
            conn.channel().queue_delete(q, if_empty=True)
            r["if_empty"] = "deleted"
        except pika.exceptions.ChannelClosedByBroker as e:
            r["if_empty"] = closed(e)
        nxt = conns[(i + 1) % 3]
        consumer = nxt.channel()
        consumer.basic_qos(prefetch_count=1)
        tag = consumer.basic_consume(q, lambda *a: None)
        try:
            conn.channel().queue_delete(q, if_unused=True)
            r["if_unused"] = "deleted"
        except pika.exceptions.ChannelClosedByBroker as e:
            r["if_unused"] = closed(e)
        consumer.basic_cancel(tag)
        consumer.close()
        wait_for_count(conn, q, 1)
        r["purged"] = conn.channel().queue_purge(q).method.message_count
        out[f"node{i + 1}"] = r
    return out


def prefetch_limit(ctx):
    """basic.qos prefetch: a consumer holds at most that many unacked
    deliveries; an ack lets the next one come."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, [f"f{i}" for i in range(5)])
    ch = ctx.channel(ctx.use)
    ch.basic_qos(prefetch_count=2)
    got = []
    ch.basic_consume(q, lambda _c, m, _p, body: got.append((m.delivery_tag, body.decode())))
    events_until(ctx.use, lambda: len(got) >= 2)
    out = {"before_ack": [b for _, b in got]}
    ch.basic_ack(got[0][0])
    events_until(ctx.use, lambda: len(got) >= 3)
    out["after_ack"] = [b for _, b in got]
    return out


def events_until(conn, done, seconds=5.0, then=0.3):
    """Handles `conn`'s events until `done()` (at most `seconds`), then for
    `then` seconds more: what should not come has had time to."""
    deadline = time.time() + seconds
    while not done() and time.time() < deadline:
        conn.process_data_events(time_limit=0.05)
    deadline = time.time() + then
    while time.time() < deadline:
        conn.process_data_events(time_limit=0.05)


def cancel_on_failover(ctx):
    """A consumer with x-cancel-on-ha-failover is told (basic.cancel) when
    its queue's master fails over, and only then; one without is not."""
    q = ctx.queue("feat.")
    ctx.declare(q, fail_over=False)
    ch = ctx.channel(ctx.use)
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    ch.basic_consume(q, lambda *a: None, consumer_tag="told",
                     arguments={"x-cancel-on-ha-failover": True})
    ch.basic_consume(q, lambda *a: None, consumer_tag="untold")
    ctx.fail_over(q)
    # Only the failover placement fails over: the others wait out 1 s.
    seconds = 5.0 if ctx.placement == "failover" else 1.0
    events_until(ctx.use, lambda: bool(cancelled), seconds=seconds, then=0.5)
    return {"cancelled": cancelled}


def publish_through_failover(ctx, q, confirm):
    """A publisher on the node queue `q` is used through publishes numbered
    persistent messages one at a time while the queue's master fails over
    (in the failover placement node 1, the master, is killed under it), and
    for a second after. In confirm mode (`confirm`) it waits for each
    confirm; without, it publishes one every 2 ms, then turns confirm mode
    on and publishes one more, whose confirm says the broker has all before
    it. Returns its state (sent, acked, nacked, error, "last acked") and
    how many it had sent before the failover."""
    url = ctx.urls[0 if ctx.placement in ("plain", "master") else 1]
    state = {"sent": 0, "acked": 0, "nacked": 0, "error": None, "stop": False,
             "last acked": None}

    def one(ch):
        try:
            ch.basic_publish("", q, str(state["sent"]), persistent())
            state["acked"] += 1
            return True
        except pika.exceptions.NackError:
            state["nacked"] += 1
            return False
        finally:
            state["sent"] += 1

    def publish():
        try:
            conn = pika.BlockingConnection(pika.URLParameters(url))
        except Exception as e:
            state["error"] = type(e).__name__
            return
        try:
            ch = conn.channel()
            if confirm:
                ch.confirm_delivery()
            while not state["stop"]:
                one(ch)
                if not confirm:
                    time.sleep(0.002)
            if not confirm:
                ch.confirm_delivery()
                state["last acked"] = one(ch)
        except Exception as e:
            state["error"] = type(e).__name__
        finally:
            try:
                conn.close()
            except Exception:
                pass

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    deadline = time.time() + 5
    while state["sent"] < 50 and state["error"] is None and time.time() < deadline:
        time.sleep(0.01)
    before = state["sent"]
    ctx.fail_over(q)
    # Publishing goes on after the failover too.
    time.sleep(1.0)
    state["stop"] = True
    t.join(30)
    return state, before


def publishing_through_failover(ctx):
    """A publisher in confirm mode publishes through the queue's failover
    (`publish_through_failover`): whether any publish is nacked, and
    whether the queue then holds each publish once."""
    q = ctx.queue()
    ctx.declare(q, fail_over=False)
    state, before = publish_through_failover(ctx, q, confirm=True)
    count = passive_count(ctx.use, q)
    return {
        "published before and after": before >= 50 and state["sent"] > before,
        "nacked": state["nacked"],
        "error": state["error"],
        "each held once": count == state["sent"],
    }


def unconfirmed_publishing_through_failover(ctx):
    """A publisher not in confirm mode publishes through the queue's
    failover (`publish_through_failover`): whether the queue then holds
    each publish once, in the order sent."""
    q = ctx.queue()
    ctx.declare(q, fail_over=False)
    state, before = publish_through_failover(ctx, q, confirm=False)
    got = []
    ch = ctx.channel(ctx.use)
    ch.basic_qos(prefetch_count=500)
    ch.basic_consume(q, lambda c, m, _p, body: (got.append(int(body)),
                                                c.basic_ack(m.delivery_tag)))
    events_until(ctx.use, lambda: len(got) >= state["sent"], seconds=10.0, then=0.3)
    return {
        "published before and after": before >= 50 and state["sent"] > before,
        "error": state["error"],
        "last acked": state["last acked"],
        "each held once": sorted(got) == list(range(state["sent"])),
        "in order": got == sorted(got),
    }


def each_node_limits(ctx):
    """A queue with a length limit (reject-publish) and a dead-letter
    queue, used through every node (mirrored to two nodes of three, or not
    at all): what each node's publishes and rejections come to."""
    q = ctx.queue("two.")
    dlq = f"dlq.{ctx.name}"
    ctx.declare(dlq, fail_over=False)
    args = {
        "x-max-length": 2,
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dlq,
    }
    ctx.declare(q, arguments=args, fail_over=False)
    out = {}
    for i in range(3):
        conn = ctx.connect(i)
        ch = ctx.channel(conn, confirm=True)
        r = {"publish": publish_each(ch, q, [f"l{i}a", f"l{i}b", f"l{i}c"])}
        m, _props, _body = ch.basic_get(q, auto_ack=False)
        ch.basic_reject(m.delivery_tag, requeue=False)
        # Room for one again: the next publish fits, one more does not.
        r["after_reject"] = publish_each(ch, q, [f"l{i}d", f"l{i}e"])
        wait_for_count(conn, dlq, 1)
        r["dead"] = get_dead(ch, dlq)
        r["left"] = get_all(ch, q)
        out[f"node{i + 1}"] = r
    delete(ctx.admin, dlq)
    return out


def exchanges_across_nodes(ctx):
    """Exchanges declared and bound through one node route publishes made
    through every node: a headers exchange (x-match all and any), a topic
    exchange bound to it (exchange to exchange), an unbinding."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    hx, tx = f"hx.{ctx.name}", f"tx.{ctx.name}"
    setup = ctx.channel(ctx.admin)
    setup.exchange_declare(hx, "headers", durable=True)
    setup.exchange_declare(tx, "topic", durable=True)
    setup.queue_bind(q, hx, arguments={"x-match": "all", "kind": "a", "n": 1})
    setup.queue_bind(q, hx, arguments={"x-match": "any", "kind": "b", "n": 2})
    setup.exchange_bind(hx, tx, routing_key="orders.#")
    setup.queue_bind(q, tx, routing_key="*.audit")
    setup.queue_unbind(q, tx, routing_key="*.audit")
    out = {}
    for i in range(3):
        conn = ctx.connect(i)
        ch = ctx.channel(conn, confirm=True)
        sent = []
        for key, headers in [
            ("orders.eu", {"kind": "a", "n": 1}),
            ("orders.us", {"kind": "a", "n": 2}),
            ("orders.x", {"n": 2}),
            ("other.audit", {"kind": "a", "n": 1}),
        ]:
            props = pika.BasicProperties(delivery_mode=2, headers=headers)
            try:
                ch.basic_publish(tx, key, f"{i}:{key}", props, mandatory=True)
                sent.append("ack")
            except pika.exceptions.UnroutableError:
                sent.append("returned")
        r = {"publish": sent}
        wait_for_count(conn, q, sent.count("ack"))
        r["got"] = [b for b, _red, _prio in get_all(ch, q)]
        out[f"node{i + 1}"] = r
    setup.exchange_delete(tx)
    setup.exchange_delete(hx)
    return out


def tx_ack(ctx):
    """Acks in a transaction: a rolled back ack leaves its message unacked
    (back in the queue once the channel closes), a committed one takes
    it."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, ["x0", "x1", "x2"])
    ch = ctx.channel(ctx.use)
    tags = [tag for tag, _body in take_unacked(ch, q, 3)]
    ch.tx_select()
    ch.basic_ack(tags[0])
    ch.tx_rollback()
    ch.basic_ack(tags[1])
    ch.basic_reject(tags[2], requeue=True)
    out = {"before_commit": passive_count(ctx.use, q)}
    ch.tx_commit()
    wait_for_count(ctx.use, q, 1)
    out["after_commit"] = get_all(ctx.channel(ctx.use), q)
    ch.close()
    wait_for_count(ctx.use, q, 1)
    out["after_close"] = get_all(ctx.channel(ctx.use), q)
    return out



def global_prefetch(ctx):
    """basic.qos with global: one limit for all the channel's consumers
    (RabbitMQ 3.10's meaning): two queues consumed on one channel with a
    global prefetch of 3; the first queue's messages fill it, the second's
    wait until acks make room."""
    qa, qb = ctx.queue("feat.a."), ctx.queue("feat.b.")
    ctx.declare(qa)
    ctx.declare(qb)
    ch = ctx.channel(ctx.use)
    ch.basic_qos(prefetch_count=3, global_qos=True)
    got = {"a": [], "b": []}
    tags = []
    for name, q in (("a", qa), ("b", qb)):
        ch.basic_consume(
            q,
            lambda _c, m, _p, body, n=name: (got[n].append(body.decode()),
                                             tags.append(m.delivery_tag)),
            consumer_tag=name)
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, qa, ["a0", "a1", "a2", "a3"])
    publish_each(pub, qb, ["b0", "b1"])
    out = {"first": received(ctx, got)}
    acked = []
    for step in ("after_ack", "after_second_ack"):
        # Everything delivered so far, if anything came since the last ack.
        if tags and tags[-1] not in acked:
            ch.basic_ack(tags[-1], multiple=True)
            acked.append(tags[-1])
        out[step] = received(ctx, got)
    ch.close()
    return out


def exclusive_queue_other_connection(ctx):
    """An exclusive queue is its connection's: another connection (on
    node 1) may publish to it but not declare, consume, get, bind, purge
    or delete it (405); the queue goes with its connection."""
    q = ctx.queue("feat.")
    owner = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    own = owner.channel()
    own.queue_declare(q, exclusive=True)
    other = ctx.connect(0)
    out = {}
    acts = {
        "passive": lambda ch: ch.queue_declare(q, passive=True),
        "declare": lambda ch: ch.queue_declare(q),
        "declare_exclusive": lambda ch: ch.queue_declare(q, exclusive=True),
        "consume": lambda ch: ch.basic_consume(q, lambda *a: None),
        "get": lambda ch: ch.basic_get(q),
        "bind": lambda ch: ch.queue_bind(q, "amq.fanout"),
        "purge": lambda ch: ch.queue_purge(q),
        "delete": lambda ch: ch.queue_delete(q),
    }
    for name, act in acts.items():
        out[name] = refused(other.channel(), act)
    pub = ctx.channel(other, confirm=True)
    out["publish"] = publish_each(pub, q, ["x0"])
    out["owner_get"] = get_all(own, q)
    # An RPC reply: to a server-named exclusive queue, from another node.
    reply_to = own.queue_declare("", exclusive=True).method.queue
    replies = []
    own.basic_consume(reply_to, lambda _c, _m, _p, b: replies.append(b.decode()),
                      auto_ack=True, consumer_tag="rpc")
    out["reply_publish"] = publish_each(pub, reply_to, ["pong"])
    deadline = time.time() + 3
    while not replies and time.time() < deadline:
        owner.process_data_events(time_limit=0.1)
    out["reply"] = replies
    owner.close()
    # Gone with its connection: at once on RabbitMQ; Warren's other nodes
    # learn it from the replicated metadata a moment later.
    for _ in range(50):
        out["after_owner_closed"] = passive_count(other, q)
        if not isinstance(out["after_owner_closed"], list) or out["after_owner_closed"][0] != 405:
            break
        time.sleep(0.1)
    return out


def empty_queue_name(ctx):
    """An empty queue name means the channel's last declared queue (AMQP
    0-9-1): get, bind, purge, consume and delete with "" act on it; a
    channel that declared none is refused. A server-named queue's name."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"no_declare_get": refused(ctx.use.channel(), lambda c: c.basic_get(""))}
    out["no_declare_purge"] = refused(ctx.use.channel(), lambda c: c.queue_purge(""))
    ch.queue_declare(q, passive=True)
    publish_each(ch, q, ["e0", "e1", "e2"])
    m, _, body = ch.basic_get("", auto_ack=True)
    out["get"] = body.decode() if m else None
    out["purged"] = ch.queue_purge("").method.message_count
    x = f"x.{ctx.name}"
    ch.exchange_declare(x, "fanout", auto_delete=True)
    ch.queue_bind("", x)
    ch.basic_publish(x, "any", "via-bind", persistent())
    wait_for_count(ctx.use, q, 1)
    got = []
    ch.basic_consume("", lambda _c, _m, _p, b: got.append(b.decode()), auto_ack=True,
                     consumer_tag="c")
    out["consumed"] = list(received(ctx, {"c": got})["c"])
    ch.basic_cancel("c")
    ch.exchange_delete(x)
    publish_each(ch, q, ["e3"])
    out["deleted"] = ch.queue_delete("").method.message_count
    out["after"] = passive_count(ctx.use, q)
    named = ctx.channel(ctx.use).queue_declare("", exclusive=True).method.queue
    out["server_named"] = [named[:8], len(named)]
    return out


def server_named_queue(ctx):
    """A server-named queue that is not exclusive (queue.declare with an
    empty name: amq.gen-...) is a queue like any other, declared through
    the placement's node: published to and counted through every node,
    consumed through another, deleted through a third."""
    name = ctx.channel(ctx.use).queue_declare("").method.queue
    out = {"name": [name[:8], len(name)]}
    conns = [ctx.connect(i) for i in range(3)]
    for i, conn in enumerate(conns):
        ch = ctx.channel(conn, confirm=True)
        out[f"node{i + 1}"] = {
            "publish": publish_each(ch, name, [f"s{i}"], mandatory=True),
            "count": passive_count(conn, name),
        }
    got = []
    consumer = ctx.channel(conns[1])
    consumer.basic_consume(name, lambda _c, _m, _p, b: got.append(b.decode()),
                           auto_ack=True, consumer_tag="c")
    out["consumed"] = sorted(received(ctx, {"c": got}, others=[conns[1]])["c"])
    consumer.basic_cancel("c")
    publish_each(ctx.channel(conns[0], confirm=True), name, ["left"])
    wait_for_count(conns[2], name, 1)
    out["deleted"] = ctx.channel(conns[2]).queue_delete(name).method.message_count
    after = passive_count(ctx.use, name)
    out["after"] = after[0] if isinstance(after, list) else after
    return out


def topic_and_headers_routing(ctx):
    """Topic patterns (* one word, # any number, empty words) and headers
    matching (x-match all and any, values of another type) into the queue."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    t, h = f"t.{ctx.name}", f"h.{ctx.name}"
    admin = ctx.channel(ctx.admin)
    admin.exchange_declare(t, "topic", auto_delete=True)
    admin.exchange_declare(h, "headers", auto_delete=True)
    for key in ["a.*.c", "#.z", "x.#.y", "..e"]:
        admin.queue_bind(q, t, routing_key=key)
    admin.queue_bind(q, h, arguments={"x-match": "all", "k": "v", "n": 1})
    admin.queue_bind(q, h, arguments={"x-match": "any", "p": "q", "r": "s"})
    pub = ctx.channel(ctx.use, confirm=True)
    out = {"topic": {}, "headers": {}}
    for key in ["a.b.c", "a.c", "a.b.b.c", "z", "m.z", "x.y", "x.m.n.y", "", ".", "..e",
                "a..c"]:
        before = passive_count(ctx.use, q)
        pub.basic_publish(t, key, key, persistent())
        wait_for_count(ctx.use, q, before + 1, seconds=0.5)
        out["topic"][key] = passive_count(ctx.use, q) - before
    for name, headers in [("all", {"k": "v", "n": 1}), ("all_partial", {"k": "v"}),
                          ("any_one", {"r": "s"}), ("none", {"z": "z"}),
                          ("wrong_type", {"k": "v", "n": "1"}), ("x_only", {"x-other": "1"}),
                          ("empty", None)]:
        before = passive_count(ctx.use, q)
        pub.basic_publish(h, "", name, persistent(headers=headers))
        wait_for_count(ctx.use, q, before + 1, seconds=0.5)
        out["headers"][name] = passive_count(ctx.use, q) - before
    out["got"] = [b for b, _r, _p in get_all(pub, q)]
    admin.exchange_delete(t)
    admin.exchange_delete(h)
    return out


def shown(props, body, method=None):
    """A message as a client sees it: body, every property (header values
    with their Python types), and the method's redelivered flag."""
    def value(v):
        if isinstance(v, dict):
            return {k: value(x) for k, x in sorted(v.items())}
        if isinstance(v, list):
            return [value(x) for x in v]
        if isinstance(v, bytes):
            return ["bytes", v.decode(errors="replace")]
        return [type(v).__name__, str(v)]
    fields = ["content_type", "content_encoding", "delivery_mode", "priority",
              "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
              "type", "user_id", "app_id", "cluster_id"]
    out = {f: getattr(props, f) for f in fields}
    out["headers"] = value(props.headers) if props.headers is not None else None
    out["body"] = body.decode(errors="replace")
    if method is not None:
        out["redelivered"] = method.redelivered
    return out


def properties_round_trip(ctx):
    """Every basic property, and header values of every type a client
    sends, come back as they went in: through get and through a consumer,
    on whichever node."""
    import datetime
    import decimal
    q = ctx.queue("feat.")
    ctx.declare(q)
    headers = {
        "str": "text é", "int": 7, "negative": -70000, "big": 2**40,
        "bool": True, "none": None, "bytes": b"raw", "list": [1, "two", [3], {"k": "v"}],
        "table": {"nested": {"deeper": ["x", 1]}},
        "time": datetime.datetime(2024, 1, 2, 3, 4, 5),
        "decimal": decimal.Decimal("12.345"),
    }
    props = pika.BasicProperties(
        content_type="application/json", content_encoding="gzip", headers=headers,
        delivery_mode=2, priority=3, correlation_id="corr-1", reply_to="reply.q",
        expiration="600000", message_id="id-1", timestamp=1700000000, type="kind",
        user_id="guest", app_id="app", cluster_id="cid")
    pub = ctx.channel(ctx.use, confirm=True)
    out = {"publish": publish_each(pub, q, ["first", "second"], props=props)}
    wait_for_count(ctx.use, q, 2)
    ch = ctx.channel(ctx.use)
    m, p, body = ch.basic_get(q, auto_ack=True)
    out["get"] = shown(p, body, m)
    got = []
    ch.basic_consume(q, lambda _c, m, p, b: got.append(shown(p, b, m)), auto_ack=True,
                     consumer_tag="c")
    received(ctx, {"c": got})
    out["consumed"] = got
    return out


def tx_publish(ctx):
    """Publishes in a transaction: none is routed before tx.commit, a
    rolled back one never is, committed ones are in order."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use)
    ch.tx_select()
    ch.basic_publish("", q, "t0", persistent())
    ch.basic_publish("", q, "t1", persistent())
    out = {"before_commit": passive_count(ctx.use, q)}
    ch.tx_commit()
    ch.basic_publish("", q, "rolled-back", persistent())
    ch.tx_rollback()
    ch.basic_publish("", q, "t2", persistent())
    ch.tx_commit()
    wait_for_count(ctx.use, q, 3)
    out["after"] = get_all(ctx.channel(ctx.use), q)
    return out


def prefetch_changed_after_consume(ctx):
    """basic.qos (not global) after a consumer started: the consumer keeps
    the limit it started with; a consumer started after gets the new one."""
    q1, q2 = ctx.queue("feat.a."), ctx.queue("feat.b.")
    ctx.declare(q1)
    ctx.declare(q2)
    ch = ctx.channel(ctx.use)
    ch.basic_qos(prefetch_count=2)
    got = {"first": [], "second": []}
    ch.basic_consume(q1, lambda _c, _m, _p, b: got["first"].append(b.decode()),
                     consumer_tag="first")
    ch.basic_qos(prefetch_count=4)
    ch.basic_consume(q2, lambda _c, _m, _p, b: got["second"].append(b.decode()),
                     consumer_tag="second")
    pub = ctx.channel(ctx.use, confirm=True)
    publish_each(pub, q1, [f"a{i}" for i in range(6)])
    publish_each(pub, q2, [f"b{i}" for i in range(6)])
    out = received(ctx, got)
    ch.close()
    return out


def reject_publish_dlx(ctx):
    """x-overflow reject-publish-dlx: a publish over x-max-length is nacked
    and dead-lettered (reason maxlen), the queue keeps the first ones;
    drop-head with a dead-letter exchange dead-letters the oldest."""
    q, dh = ctx.queue("rp."), ctx.queue("dh.")
    dlq = f"dlq.{ctx.name}"
    ctx.declare(dlq)
    dl = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}
    ctx.declare(q, arguments={"x-max-length": 1, "x-overflow": "reject-publish-dlx", **dl})
    ctx.declare(dh, arguments={"x-max-length": 1, **dl})
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"publish": publish_each(ch, q, ["r0", "r1", "r2"])}
    out["drop_head_publish"] = publish_each(ch, dh, ["h0", "h1"])
    wait_for_count(ctx.use, dlq, 3)
    out["kept"] = get_all(ch, q)
    out["drop_head_kept"] = get_all(ch, dh)
    out["dead"] = sorted(get_dead(ch, dlq), key=lambda d: d[0])
    delete(ctx.admin, dlq)
    return out


def get_ok_counts(ctx):
    """basic.get-ok's message count (what is left after it) and a
    passive declare's counts while deliveries are unacked, through any
    node."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, ["g0", "g1", "g2"])
    ch = ctx.channel(ctx.use)
    out = {"left": []}
    for _ in range(2):
        m, _p, _b = ch.basic_get(q, auto_ack=False)
        out["left"].append(m.message_count)
    out["passive_with_two_unacked"] = passive_counts(ctx.use, q)
    ch.basic_ack(0, multiple=True)
    out["passive_after_ack"] = passive_counts(ctx.use, q)
    return out


def consumers_counted_across_nodes(ctx):
    """A queue's consumer count (declare-ok, passive) counts the
    consumers of every node; one whose connection drops is no longer
    counted."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    conns = [ctx.connect(i) for i in range(3)]
    for i, c in enumerate(conns):
        c.channel().basic_consume(q, lambda *a: None, consumer_tag=f"on{i}")
    out = {}
    for i, c in enumerate(conns):
        for _ in range(50):
            counts = passive_counts(c, q)
            if counts[1] == 3:
                break
            time.sleep(0.1)
        out[f"through_{i}"] = counts
    drop(conns[2])
    for _ in range(50):
        out["after_drop"] = passive_counts(conns[0], q)
        if out["after_drop"][1] == 2:
            break
        time.sleep(0.1)
    return out


def dead_seen(ch, queue):
    """Each dead letter in `queue`: body, routing key, x-death, and which
    of the CC and BCC headers it still has."""
    dead = []
    for _ in range(10):
        m, props, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            break
        kept = sorted(k for k in (props.headers or {}) if k in ("CC", "BCC"))
        dead.append([body.decode(), m.routing_key, x_death(props), kept])
    return dead


def dead_letter_cc(ctx):
    """A message published with CC and BCC headers, rejected into a
    dead-letter exchange without x-dead-letter-routing-key: it is
    dead-lettered with its routing keys (CC included, BCC never shown), and
    x-death names them."""
    q = ctx.queue("rej.")
    x = f"dlx.{ctx.name}"
    dlq_a, dlq_b = f"dlqa.{ctx.name}", f"dlqb.{ctx.name}"
    for d in (dlq_a, dlq_b):
        ctx.declare(d)
    ctx.declare(q, arguments={"x-dead-letter-exchange": x})
    # After the failover placement's restart: node 3 stands in for node 1.
    admin = ctx.channel(ctx.admin)
    admin.exchange_declare(x, "direct", auto_delete=True)
    for d, key in ((dlq_a, q), (dlq_b, "cc-key")):
        admin.queue_bind(d, x, routing_key=key)
    admin.exchange_declare(f"cc.{ctx.name}", "direct", auto_delete=True)
    admin.queue_bind(q, f"cc.{ctx.name}", routing_key="cc-key")
    ch = ctx.channel(ctx.use, confirm=True)
    props = persistent(headers={"CC": ["cc-key"], "BCC": ["bcc-key"]})
    out = {"publish": publish_each(ch, q, ["c0"], props=props)}
    got = ctx.channel(ctx.use)
    got.basic_reject(get_polled(got, q).delivery_tag, requeue=False)
    for d in (dlq_a, dlq_b):
        wait_for_count(ctx.use, d, 1, seconds=2)
    out["dead"] = {"by_queue_name": dead_seen(ch, dlq_a), "by_cc": dead_seen(ch, dlq_b)}
    # With x-dead-letter-routing-key: that key, and what of CC then.
    q2 = ctx.queue("dh.")
    ctx.declare(q2, fail_over=False,
                arguments={"x-dead-letter-exchange": x, "x-dead-letter-routing-key": q})
    out["dlrk_publish"] = publish_each(ch, q2, ["c1"], props=props)
    got.basic_reject(get_polled(got, q2).delivery_tag, requeue=False)
    wait_for_count(ctx.use, dlq_a, 1, seconds=2)
    settle(0.3)
    out["dlrk_dead"] = {"by_dlrk": dead_seen(ch, dlq_a), "by_cc": dead_seen(ch, dlq_b)}
    for d in (dlq_a, dlq_b):
        delete(ctx.admin, d)
    admin.exchange_delete(x)
    admin.exchange_delete(f"cc.{ctx.name}")
    return out


def per_message_ttl_at_head(ctx):
    """Per-message TTLs (expiration): a message expires at the head of its
    queue; one with a short TTL behind a long-lived one waits for it, as
    RabbitMQ's classic queues do."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    ch = ctx.channel(ctx.use, confirm=True)
    publish_each(ch, q, ["short-first"], props=persistent(expiration="200"))
    publish_each(ch, q, ["long"], props=persistent(expiration="60000"))
    publish_each(ch, q, ["short-behind"], props=persistent(expiration="200"))
    settle(1.0)
    out = {"count_after_ttl": passive_count(ctx.use, q)}
    out["got"] = get_all(ch, q)
    return out


def ttl_zero(ctx):
    """x-message-ttl 0 and an expiration of 0: a message no consumer can
    take at once expires (dead-lettered, reason expired); with a consumer
    ready, on whichever node, it is delivered."""
    q = ctx.queue("ttl.")
    dlq = f"dlq.{ctx.name}"
    ctx.declare(dlq)
    ctx.declare(q, arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "",
                              "x-dead-letter-routing-key": dlq})
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"no_consumer": publish_each(ch, q, ["z0"])}
    wait_for_count(ctx.use, dlq, 1, seconds=2)
    got = []
    consumer = ctx.channel(ctx.use)
    consumer.basic_qos(prefetch_count=10)
    consumer.basic_consume(q, lambda _c, _m, _p, b: got.append(b.decode()), auto_ack=True,
                           consumer_tag="ready")
    settle(0.3)
    publish_each(ch, q, ["z1", "z2"])
    publish_each(ch, q, ["z3"], props=persistent(expiration="0"))
    out["consumed"] = received(ctx, {"ready": got})["ready"]
    out["dead"] = [[b, [d["reason"] for d in deaths]] for b, deaths in get_dead(ch, dlq)]
    consumer.close()
    delete(ctx.admin, dlq)
    return out


def exchange_checks(ctx):
    """What exchange methods refuse, through whichever node: a redeclare
    of another type, a passive declare of none, a reserved name, a delete
    with if-unused of one that has bindings; an unbind of a binding that is
    not there passes."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    x = f"x.{ctx.name}"
    setup = ctx.channel(ctx.admin)
    setup.exchange_declare(x, "direct", auto_delete=False)
    setup.queue_bind(q, x, routing_key="k")
    conn = ctx.use
    out = {
        "other_type": refused(conn.channel(), lambda c: c.exchange_declare(x, "fanout")),
        "passive_missing": refused(
            conn.channel(), lambda c: c.exchange_declare(f"none.{ctx.name}", passive=True)),
        "reserved": refused(conn.channel(), lambda c: c.exchange_declare(f"amq.{ctx.name}")),
        "delete_if_unused": refused(conn.channel(),
                                    lambda c: c.exchange_delete(x, if_unused=True)),
        "unbind_missing": refused(conn.channel(),
                                  lambda c: c.queue_unbind(q, x, routing_key="absent")),
        "bind_missing_exchange": refused(
            conn.channel(), lambda c: c.queue_bind(q, f"none.{ctx.name}", routing_key="k")),
    }
    setup.exchange_delete(x)
    return out


def returns_and_missing_exchange(ctx):
    """basic.return of a mandatory publish that no queue takes (with and
    without confirms), none for one routed to the queue or not mandatory;
    a publish to an exchange that is not there closes the channel."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    missing = f"missing.{ctx.name}"
    ch = ctx.channel(ctx.use, confirm=True)
    out = {"confirmed": [
        publish_each(ch, q, ["m0"], mandatory=True),
        publish_each(ch, missing, ["m1"], mandatory=True),
        publish_each(ch, missing, ["m2"]),
    ]}
    plain = ctx.channel(ctx.use)
    returned = []
    plain.add_on_return_callback(
        lambda _c, m, _p, body: returned.append(
            [m.reply_code, m.reply_text, m.exchange, m.routing_key, body.decode()]))
    plain.basic_publish("", missing, "r0", persistent(), mandatory=True)
    plain.basic_publish("", q, "r1", persistent(), mandatory=True)
    plain.basic_publish("amq.direct", missing, "r2", persistent(), mandatory=True)
    received(ctx, {})
    out["returned"] = returned
    out["missing_exchange"] = refused(
        ctx.channel(ctx.use, confirm=True),
        lambda c: c.basic_publish(f"none.{ctx.name}", q, "x", persistent()))
    wait_for_count(ctx.use, q, 2)
    out["got"] = get_all(ctx.channel(ctx.use), q)
    return out


def exchange_to_exchange(ctx):
    """Exchange-to-exchange bindings: a publish to the source reaches the
    queue through the destination's bindings; exchange.unbind stops it;
    deleting the source removes its bindings."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    src, dst = f"src.{ctx.name}", f"dst.{ctx.name}"
    setup = ctx.channel(ctx.use)
    setup.exchange_declare(src, "fanout")
    setup.exchange_declare(dst, "direct")
    setup.queue_bind(q, dst, routing_key="k")
    setup.exchange_bind(dst, src)
    ch = ctx.channel(ctx.use, confirm=True)
    out = {}
    try:
        ch.basic_publish(src, "k", "through", persistent())
        ch.basic_publish(src, "other", "filtered", persistent())
        ch.basic_publish(dst, "k", "direct", persistent())
        wait_for_count(ctx.use, q, 2)
        out["bound"] = get_all(ch, q)
        out["dst_if_unused"] = refused(ctx.channel(ctx.use),
                                       lambda c: c.exchange_delete(dst, if_unused=True))
        ctx.channel(ctx.use).exchange_unbind(dst, src)
        ch.basic_publish(src, "k", "after-unbind", persistent())
        out["unbound"] = get_all(ch, q)
        ctx.channel(ctx.use).exchange_bind(dst, src)
        ctx.channel(ctx.use).exchange_delete(src)
        out["source_deleted"] = refused(
            ctx.channel(ctx.use, confirm=True),
            lambda c: c.basic_publish(src, "k", "gone", persistent()))
        ch = ctx.channel(ctx.use, confirm=True)
        ch.basic_publish(dst, "k", "still", persistent())
        out["after"] = get_all(ch, q)
    finally:
        for x in (src, dst):
            try:
                ctx.channel(ctx.admin).exchange_delete(x)
            except Exception:
                pass
    return out


def queue_unbind(ctx):
    """queue.unbind removes one binding of several; the queue still gets
    what the others route."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    setup = ctx.channel(ctx.use)
    for key in ("a", "b"):
        setup.queue_bind(q, "amq.direct", routing_key=f"{key}.{ctx.name}")
    setup.queue_unbind(q, "amq.direct", routing_key=f"a.{ctx.name}")
    ch = ctx.channel(ctx.use, confirm=True)
    for key in ("a", "b"):
        ch.basic_publish("amq.direct", f"{key}.{ctx.name}", key, persistent())
    out = {}
    wait_for_count(ctx.use, q, 1)
    out["got"] = get_all(ch, q)
    setup.queue_unbind(q, "amq.direct", routing_key=f"b.{ctx.name}")
    return out


def ack_errors(ctx):
    """Settling what the channel does not hold: an unknown delivery tag, a
    tag acked twice, a tag of an auto-ack get; multiple with tag 0 settles
    everything the channel holds."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, [f"a{i}" for i in range(6)])
    out = {"unknown": refused(ctx.channel(ctx.use), lambda c: c.basic_ack(99))}
    ch = ctx.channel(ctx.use)
    tags = [tag for tag, _ in take_unacked(ch, q, 1)]
    ch.basic_ack(tags[0])
    out["twice"] = refused(ch, lambda c: c.basic_ack(tags[0]))
    ch = ctx.channel(ctx.use)
    m, _p, _b = ch.basic_get(q, auto_ack=True)
    out["auto_acked"] = refused(ch, lambda c: c.basic_reject(m.delivery_tag))
    ch = ctx.channel(ctx.use)
    take_unacked(ch, q, 2)
    out["nack_all"] = refused(ch, lambda c: c.basic_nack(0, multiple=True, requeue=True))
    out["after"] = get_all(ch, q)
    return out


def not_implemented(ctx):
    """What RabbitMQ does not implement closes the connection: basic.qos
    with a prefetch size, channel.flow to stop."""
    out = {}
    conn = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    out["prefetch_size"] = refused(conn.channel(),
                                   lambda c: c.basic_qos(prefetch_size=1024))
    conn = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    out["flow_stop"] = refused(conn.channel(), lambda c: c.flow(False))
    conn = ctx.connect(0 if ctx.placement in ("plain", "master") else 1)
    out["flow_go"] = refused(conn.channel(), lambda c: c.flow(True))
    return out


def settle_after_cancel(ctx):
    """After basic.cancel the channel still holds what the consumer was
    given: an ack of one settles it, the rest go back (redelivered) when
    the channel closes."""
    q = ctx.queue("feat.")
    ctx.declare(q)
    publish_each(ctx.channel(ctx.use, confirm=True), q, [f"s{i}" for i in range(5)])
    chans, got = consumers_of(ctx, q, [("c", None)], prefetch=3)
    out = {"received": received(ctx, got)}
    ch = chans["c"]
    ch.basic_cancel("c")
    ch.basic_ack(1)
    out["counts_after_cancel"] = passive_counts(ctx.use, q)
    ch.close()
    wait_for_count(ctx.use, q, 4)
    out["after_close"] = get_all(ctx.channel(ctx.use), q)
    return out


def settle_across_queues(ctx):
    """One channel consuming from two queues: delivery tags run across
    both; an ack with multiple settles both queues' deliveries up to it,
    a nack with multiple and requeue puts both queues' back."""
    qa, qb = ctx.queue("feat.a."), ctx.queue("feat.b.")
    ctx.declare(qa)
    ctx.declare(qb)
    pub = ctx.channel(ctx.use, confirm=True)
    out = {}
    for step, settle_fn in (
        ("ack", lambda c, t: c.basic_ack(t, multiple=True)),
        ("nack", lambda c, t: c.basic_nack(t, multiple=True, requeue=True)),
    ):
        publish_each(pub, qa, [f"{step}-a{i}" for i in range(2)])
        publish_each(pub, qb, [f"{step}-b{i}" for i in range(2)])
        ch = ctx.channel(ctx.use)
        taken = take_unacked(ch, qa, 1) + take_unacked(ch, qb, 1)
        taken += take_unacked(ch, qa, 1) + take_unacked(ch, qb, 1)
        settle_fn(ch, taken[2][0])
        out[step] = {
            "taken": [b for _t, b in taken],
            "counts": [passive_count(ctx.use, qa), passive_count(ctx.use, qb)],
        }
        ch.close()
        out[step]["after_close"] = [get_all(pub, qa), get_all(pub, qb)]
    return out


SCENARIOS = [
    basic_get,
    missing_queue,
    nondurable,
    max_length_policy,
    max_length_drop_head,
    overflow_reject_publish,
    ttl_dead_letter,
    policy_ttl_dead_letter,
    reject_dead_letter,
    dead_letter_cycle,
    redeclare_other_arguments,
    redeclare_exchange_arguments,
    tx_ack_unknown_tag,
    expires_with_consumer,
    auto_delete_two_consumers,
    priority,
    priority_requeue,
    priority_consume,
    priority_max_length,
    priority_above_max,
    priority_arguments,
    master_locator_arguments,
    queue_mode,
    declared_again,
    large_message,
    publish_right_after_declare,
    use_right_after_declare,
    message_count_each_node,
    argument_checks,
    declare_argument_types,
    exchange_type_unknown,
    consumer_priority,
    single_active_consumer,
    single_active_consumer_priority,
    single_active_consumer_cancel,
    single_active_consumer_checks,
    direct_reply_to,
    validated_user_id,
    consumer_timeout,
    recover_requeue,
    nack_and_reject_requeue,
    tx_publish,
    exclusive_consumer,
    purge_and_delete_conditions,
    max_length_bytes,
    alternate_exchange,
    deleted_under_consumer,
    each_node,
    prefetch_limit,
    cancel_on_failover,
    publishing_through_failover,
    unconfirmed_publishing_through_failover,
    each_node_limits,
    exchanges_across_nodes,
    tx_ack,
    global_prefetch,
    exclusive_queue_other_connection,
    empty_queue_name,
    server_named_queue,
    topic_and_headers_routing,
    properties_round_trip,
    tx_publish,
    prefetch_changed_after_consume,
    reject_publish_dlx,
    get_ok_counts,
    consumers_counted_across_nodes,
    dead_letter_cc,
    per_message_ttl_at_head,
    ttl_zero,
    exchange_checks,
    returns_and_missing_exchange,
    exchange_to_exchange,
    queue_unbind,
    ack_errors,
    not_implemented,
    settle_after_cancel,
    settle_across_queues,
]

# The queues each scenario may leave behind (deleted before and after it).
LEFTOVERS = ["", "transient.", "limits.", "dh.", "rp.", "ttl.", "pttl.", "rej.",
             "exp.", "ad.", "prio.", "loc.", "large.", "fresh.", "now.", "count.",
             "dlca.", "dlcb.", "redecl.", "txu.", "again.", "args.", "feat.", "feat.a.",
             "feat.b.", "two."]


def run_one(urls, scenario, placement):
    ctx = None
    signal.alarm(SCENARIO_TIMEOUT_S)
    try:
        ctx = Ctx(urls, placement, scenario.__name__)
        for f in LEFTOVERS:
            delete(ctx.admin, ctx.queue(f))
        return scenario(ctx)
    except Timeout:
        return {"error": "timeout"}
    except pika.exceptions.ChannelClosedByBroker as e:
        return {"error": "channel closed", "close": closed(e)}
    except pika.exceptions.ConnectionClosedByBroker as e:
        return {"error": "connection closed", "close": closed(e)}
    finally:
        signal.alarm(0)
        if ctx is not None:
            try:
                signal.alarm(SCENARIO_TIMEOUT_S)
                for f in LEFTOVERS:
                    delete(ctx.admin, ctx.queue(f))
            except Timeout:
                pass
            finally:
                signal.alarm(0)
            ctx.close()


def main(argv):
    if "--policies" in argv:
        print(json.dumps({k: {"pattern": p, "definition": d, "priority": pr}
                          for k, (p, d, pr) in POLICIES.items()}))
        return 0
    if "--settings" in argv:
        print(json.dumps(SETTINGS))
        return 0
    urls = argv[argv.index("--urls") + 1].split(",")
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    placements = ["plain", "master", "mirror"]
    if "--failover" in argv:
        placements.append("failover")
    signal.signal(signal.SIGALRM, on_alarm)
    out = {}
    for s in SCENARIOS:
        if only and s.__name__ not in only:
            continue
        for placement in placements:
            key = f"{s.__name__}/{placement}"
            started = time.time()
            out[key] = run_one(urls, s, placement)
            print(f"{key}: {time.time() - started:.1f}s {json.dumps(out[key])[:160]}",
                  file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
