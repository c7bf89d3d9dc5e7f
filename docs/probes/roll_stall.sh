#!/bin/bash
# How long a segment roll stalls a node whose disk is slow: one node with
# every fsync slowed by MS milliseconds (slowsync.c), lapin_perf publishing
# 1 KiB persistent messages with 200 confirms in flight and no consumer (the
# queue's log grows and rolls every 8 MiB), and pika timing a
# queue.declare(passive) every 5 ms meanwhile; the longest ping is the
# longest stall. Build first: cargo build --release --bin warren --example lapin_perf
# Usage: bash docs/probes/roll_stall.sh [MS] [WARREN_BINARY]
ms=${1:-50}; bin=${2:-target/release/warren}
here=$(cd "$(dirname "$0")" && pwd); d=$(mktemp -d)
gcc -O2 -shared -fPIC -o "$d/slowsync.so" "$here/slowsync.c" -ldl || exit 1
env SLOWSYNC_MS="$ms" LD_PRELOAD="$d/slowsync.so" "$bin" --node-name roll@localhost \
    --data-dir "$d/data" --amqp-addr 127.0.0.1:5910 --http-addr 127.0.0.1:15910 > "$d/log" 2>&1 &
pid=$!; sleep 2
target/release/examples/lapin_perf --url amqp://guest:guest@127.0.0.1:5910/%2f --queue roll \
    --size 1024 --persistent --confirms 200 --consumers 0 --duration 30 > "$d/perf.txt" 2>&1 &
perf=$!; sleep 1
python3 - <<'P'
import time, pika
ch = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5910)).channel()
ch.queue_declare("ping")
stop, lat = time.time() + 27, []
while time.time() < stop:
    t = time.time(); ch.queue_declare("ping", passive=True); lat.append(time.time() - t); time.sleep(0.005)
lat.sort()
at = lambda q: lat[min(len(lat) - 1, int(len(lat) * q))] * 1e3
print("pings %d p50 %.1f ms p99 %.1f ms p99.9 %.1f ms max %.1f ms" % (len(lat), at(.5), at(.99), at(.999), lat[-1] * 1e3))
P
wait $perf; grep result "$d/perf.txt"
kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.2; done; rm -rf "$d"
