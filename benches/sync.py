#!/usr/bin/env python3
"""A new mirror synchronises a large backlog (docs/benchmarks.md).

Starts two `warren` nodes (BIN, on 127.0.0.1, ports 57x1/157x1/257x1 under a
temporary directory), mirrors queues named `sync.*` to every node with
automatic synchronisation, fills the durable queue `sync.big` with COUNT
persistent messages of SIZE KiB through node 1 (its master), then starts a
third node: it gets a mirror of `sync.big` that must catch up. Meanwhile a
publisher keeps publishing with confirms to `sync.big` itself and another to
queue `sync.other`, each timing its confirms, and the resident memory
(VmRSS) of the master and of the new mirror is sampled. At the end every
node's copy of `sync.big` is compared by its digest (`?digest=true`).

    python3 benches/sync.py BIN COUNT SIZE_KIB
    python3 benches/sync.py target/release/warren 1024 1024     # 1 GiB of 1 MiB
    python3 benches/sync.py target/release/warren 100000 10     # 100,000 x 10 KiB
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pika

AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def http(port, method, path, body=None):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": AUTH, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


class Cluster:
    def __init__(self, bin_path):
        self.bin = bin_path
        self.dir = tempfile.mkdtemp(prefix="warren-sync-")
        with open(f"{self.dir}/secret", "w") as f:
            f.write("warren-sync-bench-secret\n")
        self.procs = {}

    def start(self, i):
        args = [
            self.bin,
            "--node-name", f"warren@n{i}",
            "--amqp-addr", f"127.0.0.1:57{i}1",
            "--http-addr", f"127.0.0.1:157{i}1",
            "--prometheus-addr", f"127.0.0.1:158{i}1",
            "--peer-addr", f"127.0.0.1:257{i}1",
            "--data-dir", f"{self.dir}/n{i}",
            "--cluster-secret-file", f"{self.dir}/secret",
        ]
        if i > 1:
            args += ["--join", "127.0.0.1:25711"]
        log = open(f"{self.dir}/n{i}.log", "w")
        env = dict(os.environ, RUST_LOG="info,openraft=error")
        self.procs[i] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=env)
        deadline = time.time() + 60
        while http(f"157{i}1", "GET", "/api/overview")[0] != 200:
            if time.time() > deadline or self.procs[i].poll() is not None:
                raise SystemExit(f"node {i} did not start (log: {self.dir}/n{i}.log)")
            time.sleep(0.2)

    def stop(self):
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def queue_info(port, name):
    return http(port, "GET", f"/api/queues/%2F/{name}")[1] or {}


def confirmed_publisher(port, queue, body, stop, out):
    """Publishes to `queue` with confirms, one at a time, about 50 a second,
    until `stop`: appends (start time, confirm latency) of each to `out`."""
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))
    ch = conn.channel()
    ch.confirm_delivery()
    while not stop.is_set():
        t = time.time()
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
        out.append((t, time.time() - t))
        time.sleep(0.02)
    conn.close()


def summary(lat, t0, t1):
    during = sorted(d for t, d in lat if t0 <= t <= t1)
    if not during:
        return "none during the sync"
    p = lambda q: during[min(len(during) - 1, int(q * len(during)))] * 1000
    return f"{len(during)} confirmed during the sync, p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max {during[-1] * 1000:.1f} ms"


def main():
    bin_path, count, size_kib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = Cluster(bin_path)
    try:
        c.start(1)
        c.start(2)
        status, _ = http("15711", "PUT", "/api/policies/%2F/sync", {
            "pattern": "^sync\\.",
            "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
            "apply-to": "queues",
        })
        assert status in (201, 204), f"policy: {status}"
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5711, heartbeat=0))
        ch = conn.channel()
        ch.queue_declare("sync.big", durable=True)
        ch.queue_declare("sync.other", durable=True)
        body = bytes(i % 251 for i in range(size_kib * 1024))
        t = time.time()
        for _ in range(count):
            ch.basic_publish("", "sync.big", body, pika.BasicProperties(delivery_mode=2))
        while ch.queue_declare("sync.big", passive=True).method.message_count < count:
            time.sleep(0.2)
        mib = count * size_kib / 1024
        print(f"backlog: {count} x {size_kib} KiB ({mib:.0f} MiB) published in {time.time() - t:.0f} s", flush=True)
        while len(queue_info(15711, "sync.big").get("synchronised_slave_nodes", [])) < 1:
            time.sleep(0.2)
        conn.close()

        stop = threading.Event()
        lat_big, lat_other = [], []
        small = b"x" * 1024
        pubs = [
            threading.Thread(target=confirmed_publisher, args=(5711, q, small, stop, out))
            for q, out in (("sync.big", lat_big), ("sync.other", lat_other))
        ]
        for p in pubs:
            p.start()
        time.sleep(2)
        base_master = rss_mib(c.procs[1].pid)
        t0 = time.time()
        c.start(3)
        base_mirror = rss_mib(c.procs[3].pid)
        peak_master = base_master
        peak_mirror = base_mirror
        samples = []
        while True:
            rm, rn = rss_mib(c.procs[1].pid), rss_mib(c.procs[3].pid)
            peak_master = max(peak_master, rm)
            peak_mirror = max(peak_mirror, rn)
            if not samples or time.time() - samples[-1][0] >= 1:
                samples.append((time.time(), rm, rn))
            synced = queue_info(15711, "sync.big").get("synchronised_slave_nodes", [])
            if "warren@n3" in synced:
                break
            if time.time() - t0 > 1800:
                raise SystemExit("not synchronised in 30 min")
            time.sleep(0.1)
        t1 = time.time()
        stop.set()
        for p in pubs:
            p.join()
        print(f"new mirror synchronised {t1 - t0:.1f} s after its node started", flush=True)
        print(f"RSS: master {base_master} -> peak {peak_master} MiB; new mirror {base_mirror} (ready) -> peak {peak_mirror} MiB", flush=True)
        if os.environ.get("VERBOSE"):
            print("RSS each second (s, master, new mirror):", [(round(t - t0), m, n) for t, m, n in samples], flush=True)
        print(f"publishes to sync.big (the queue being synchronised): {summary(lat_big, t0, t1)}", flush=True)
        print(f"publishes to sync.other (another queue): {summary(lat_other, t0, t1)}", flush=True)
        time.sleep(1)
        digests = {
            i: (http(f"157{i}1", "GET", "/api/queues/%2F/sync.big?digest=true")[1] or {}).get("local_digest")
            for i in (1, 2, 3)
        }
        same = len(set(digests.values())) == 1 and None not in digests.values()
        print(f"digests of sync.big per node: {digests} ({'equal' if same else 'DIFFERENT'})", flush=True)
        if not same:
            sys.exit(1)
    finally:
        c.stop()


if __name__ == "__main__":
    main()
