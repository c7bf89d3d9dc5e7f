#!/bin/bash
# The full disk of the node that is both the Raft leader and a mirrored
# queue's master, with release binaries (crates/node/tests/disk_full.rs runs
# the same with debug ones): three nodes on 127.0.0.1–3, A's data on a
# 48 MiB tmpfs (root), ha.q mastered on A and mirrored to B and C, 30
# messages confirmed through B, A's disk filled, then publishes through B
# for up to 40 s. Prints the answers, what B and C hold, and the queue's
# record. Usage: bash docs/probes/leader_disk_full.sh [WARREN_BINARY]
bin=${1:-target/release/warren}
dir=/tmp/warren-leader-disk
for n in a b c; do p=$(cat $dir/$n.pid 2>/dev/null); [ -n "$p" ] && kill $p 2>/dev/null; while [ -n "$p" ] && kill -0 $p 2>/dev/null; do sleep 0.2; done; done
umount -l $dir/a 2>/dev/null; rm -rf $dir; mkdir -p $dir/a $dir/b $dir/c
mount -t tmpfs -o size=48m tmpfs $dir/a || exit 1
head -c 48 /dev/urandom | base64 > $dir/secret
printf 'disk_free_limit.absolute = 0\n' > $dir/warren.conf
start() { n=$1; ip=$2; shift 2; "$bin" --node-name $n@host$ip --data-dir $dir/$n/data --config $dir/warren.conf --amqp-addr 127.0.0.$ip:5800 --http-addr 127.0.0.$ip:15800 --prometheus-addr 127.0.0.$ip:15801 --peer-addr 127.0.0.$ip:25800 --cluster-secret-file $dir/secret --peer-tls off "$@" >> $dir/$n.log 2>&1 & echo $! > $dir/$n.pid; }
start a 1; sleep 1.5; start b 2 --join 127.0.0.1:25800; start c 3 --join 127.0.0.1:25800; sleep 6
curl -s -u guest:guest -X PUT -H 'content-type: application/json' http://127.0.0.1:15800/api/policies/%2f/ha-all -d '{"pattern":"^ha\\.","definition":{"ha-mode":"all","ha-sync-mode":"automatic"},"apply-to":"queues"}' -o /dev/null
DIR=$dir python3 - <<'PY'
import os, sys, time, pika
def conn(ip):
    c = pika.BlockingConnection(pika.ConnectionParameters('127.0.0.%d' % ip, 5800, heartbeat=0, blocked_connection_timeout=60))
    ch = c.channel(); ch.confirm_delivery(); return c, ch
def pub(ch, name):
    try:
        ch.basic_publish('', 'ha.q', (name + ' ').encode().ljust(8192, b'.'), pika.BasicProperties(delivery_mode=2)); return 'ack'
    except pika.exceptions.NackError: return 'nack'
    except Exception as e: return 'error %s' % type(e).__name__
c = pika.BlockingConnection(pika.ConnectionParameters('127.0.0.1', 5800)); c.channel().queue_declare('ha.q', durable=True); c.close()
time.sleep(1)
c, ch = conn(2)
confirmed = set()
for i in range(30):
    assert pub(ch, 'before-%d' % i) == 'ack'; confirmed.add('before-%d' % i)
try:
    with open(os.path.join(os.environ['DIR'], 'a', 'filler'), 'wb') as f:
        while True: f.write(b'\0' * 65536); f.flush()
except OSError: pass
t0, last, acks = time.time(), None, 0
while time.time() - t0 < 40 and acks < 20:
    a = pub(ch, 'full-%.3f' % time.time())
    if a == 'ack': acks += 1
    if a.startswith('error'): c, ch = conn(2)
    if a != last: print('%.2f s after the fill: %s' % (time.time() - t0, a)); last = a
    time.sleep(0.02)
c, ch = conn(3)
got = 0
while ch.basic_get('ha.q', auto_ack=True)[0] is not None: got += 1
print('before the fill: 30 confirmed; messages got through C after it:', got)
PY
for n in a b c; do kill -0 $(cat $dir/$n.pid) 2>/dev/null && echo "$n running" || echo "$n stopped"; done
curl -s -u guest:guest http://127.0.0.2:15800/api/queues/%2F/ha.q | python3 -c "import json,sys; q=json.load(sys.stdin); print('ha.q record: master', q['node'], 'state', q['state'], 'mirrors', q['slave_nodes'])"
for n in a b c; do kill $(cat $dir/$n.pid) 2>/dev/null; done
