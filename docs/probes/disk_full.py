# The full-disk scenario of crates/node/tests/disk_full.rs against any broker:
# python3 docs/probes/disk_full.py PORT DIR, where DIR is on the file system
# holding the broker's data (a small tmpfs) and its disk free alarm is off.
# It publishes persistent messages with confirms, fills the file system,
# publishes until 10 are nacked (or one is left unanswered for 60 s), frees
# the space, and reports when a publish is confirmed again and whether every
# confirmed message is delivered.
import os, sys, time, pika
port, disk = int(sys.argv[1]), sys.argv[2]
params = pika.ConnectionParameters('127.0.0.1', port, heartbeat=0, blocked_connection_timeout=60)
def channel():
    c = pika.BlockingConnection(params)
    ch = c.channel()
    ch.confirm_delivery()
    ch.queue_declare('disk.q', durable=True)
    return c, ch
def publish(ch, name):
    body = (name + ' ').encode().ljust(8 << 10, b'.')
    try:
        ch.basic_publish('', 'disk.q', body, pika.BasicProperties(delivery_mode=2))
        return 'ack'
    except pika.exceptions.NackError:
        return 'nack'
    except Exception as e:
        return 'error: %s %s' % (type(e).__name__, e)
c, ch = channel()
confirmed = set()
for i in range(50):
    assert publish(ch, 'before-%d' % i) == 'ack'
    confirmed.add('before-%d' % i)
filler = os.path.join(disk, 'filler')
with open(filler, 'wb') as f:
    try:
        while True: f.write(b'\0' * 65536); f.flush()
    except OSError: pass
answers = {}
t0 = time.time()
for i in range(2000):
    a = publish(ch, 'full-%d' % i)
    answers[a] = answers.get(a, 0) + 1
    if a == 'ack': confirmed.add('full-%d' % i)
    if answers.get('nack', 0) >= 10 or a.startswith('error'): break
print('disk full: answers %s in %.1f s' % (answers, time.time() - t0))
os.remove(filler)
t0 = time.time()
state = None
while time.time() - t0 < 60:
    try:
        if c is None or not c.is_open: c, ch = channel()
        a = publish(ch, 'after')
    except Exception as e:
        a = 'error: %s %s' % (type(e).__name__, e)
    if a != state: print('%.1f s after freeing: %s' % (time.time() - t0, a)); state = a
    if a == 'ack': confirmed.add('after'); break
    if a.startswith('error'): c = None; state = a
    time.sleep(0.5)
got = set()
try:
    c, ch = channel()
    while True:
        m = ch.basic_get('disk.q', auto_ack=True)
        if m[0] is None: break
        got.add(m[2].split(b' ')[0].decode())
except Exception as e:
    print('getting: %s %s' % (type(e).__name__, e))
print('confirmed %d, delivered %d, confirmed but not delivered %d %s' % (
    len(confirmed), len(got), len(confirmed - got), sorted(confirmed - got)[:5]))
