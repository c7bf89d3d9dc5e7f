#!/bin/bash
# A slow disk under one node of three: every fsync and fdatasync of node
# SLOW (a, b or c) sleeps MS milliseconds first (docs/probes/slowsync.c, an
# LD_PRELOAD shim; the kernel here has no dm-delay). Nodes on 127.0.0.1–3,
# ha.* mirrored everywhere; then run a load against 127.0.0.1:5800, e.g.
#   target/release/examples/lapin_perf --url amqp://guest:guest@127.0.0.1:5800/%2f \
#       --queue ha.perf --size 1024 --persistent --confirms 100 --duration 15
# and read the logs in /tmp/warren-slow-disk. Stop: kill $(cat /tmp/warren-slow-disk/*.pid)
# Usage: bash docs/probes/slow_disk.sh SLOW MS [WARREN_BINARY]
slow=$1; ms=$2; bin=${3:-target/release/warren}
dir=/tmp/warren-slow-disk
for n in a b c; do p=$(cat $dir/$n.pid 2>/dev/null); [ -n "$p" ] && kill $p 2>/dev/null; while [ -n "$p" ] && kill -0 $p 2>/dev/null; do sleep 0.2; done; done
rm -rf $dir; mkdir -p $dir/a $dir/b $dir/c
gcc -O2 -shared -fPIC -o $dir/slowsync.so "$(dirname "$0")/slowsync.c" -ldl || exit 1
head -c 48 /dev/urandom | base64 > $dir/secret
start() {
    n=$1; ip=$2; shift 2; pre=
    [ "$n" = "$slow" ] && pre="env SLOWSYNC_MS=$ms LD_PRELOAD=$dir/slowsync.so"
    $pre "$bin" --node-name $n@host$ip --data-dir $dir/$n/data --amqp-addr 127.0.0.$ip:5800 \
        --http-addr 127.0.0.$ip:15800 --prometheus-addr 127.0.0.$ip:15801 --peer-addr 127.0.0.$ip:25800 \
        --cluster-secret-file $dir/secret --peer-tls off "$@" >> $dir/$n.log 2>&1 &
    echo $! > $dir/$n.pid
}
start a 1; sleep 1.5; start b 2 --join 127.0.0.1:25800; start c 3 --join 127.0.0.1:25800; sleep 8
curl -s -u guest:guest -X PUT -H 'content-type: application/json' http://127.0.0.1:15800/api/policies/%2f/ha-all \
    -d '{"pattern":"^ha\\.","definition":{"ha-mode":"all","ha-sync-mode":"automatic"},"apply-to":"queues"}' -o /dev/null
echo "three nodes up, $slow's fsyncs take $ms ms"
