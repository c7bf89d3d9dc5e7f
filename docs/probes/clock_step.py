# The clock-step scenario of crates/node/tests/clock.rs against any broker:
# python3 docs/probes/clock_step.py PORT, the broker started under libfaketime
# (LD_PRELOAD=.../libfaketime.so.1 FAKETIME_TIMESTAMP_FILE=/tmp/ft.txt
# FAKETIME_NO_CACHE=1 DONT_FAKE_MONOTONIC=1), which this script rewrites.
import socket, struct, sys, time, pika
port = int(sys.argv[1])
def step(s): open('/tmp/ft.txt','w').write(s + "\n")
def frame(t, ch, payload): return struct.pack('>BHI', t, ch, len(payload)) + payload + b'\xce'
def method(ch, c, m, args): return frame(1, ch, struct.pack('>HH', c, m) + args)
def sstr(s): return bytes([len(s)]) + s
step("+0")
c = pika.BlockingConnection(pika.ConnectionParameters('127.0.0.1', port))
ch = c.channel()
ch.queue_declare('expires', arguments={'x-expires': 600000})
ch.queue_declare('ttl', arguments={'x-message-ttl': 600000})
ch.basic_publish('', 'ttl', b'ten minutes')
s = socket.create_connection(('127.0.0.1', port))
s.sendall(b'AMQP\x00\x00\x09\x01')
s.recv(65536)
s.sendall(method(0, 10, 11, b'\x00\x00\x00\x00' + sstr(b'PLAIN') + struct.pack('>I', 12) + b'\x00guest\x00guest' + sstr(b'en_US')))
time.sleep(0.3); s.recv(65536)
s.sendall(method(0, 10, 31, struct.pack('>HIH', 2047, 131072, 4)))
s.sendall(method(0, 10, 40, sstr(b'/') + sstr(b'') + b'\x00'))
time.sleep(0.3); s.recv(65536)
def listen(secs, ours):
    hb, closed, buf = 0, False, b''
    end = time.time() + secs; nxt = time.time() + (ours or 1e9)
    while time.time() < end:
        s.settimeout(max(0.01, min(end, nxt) - time.time()))
        try:
            d = s.recv(65536)
            if not d: return hb, True
            buf += d
        except socket.timeout: pass
        while len(buf) >= 7:
            t, _, n = struct.unpack('>BHI', buf[:7])
            if len(buf) < 8 + n: break
            if t == 8: hb += 1
            if t == 1 and buf[7:11] == b'\x00\x0a\x00\x32': closed = True
            buf = buf[8 + n:]
        if ours and time.time() >= nxt:
            s.sendall(frame(8, 0, b'')); nxt = time.time() + ours
    return hb, closed
print("before:", listen(3, 1))
step("+1h")
print("forward (silent 3 s): heartbeats, closed =", listen(3, None))
def exists(q):
    try:
        x = c.channel(); x.queue_declare(q, passive=True); x.close(); return True
    except Exception as e: return repr(e)
print("forward: expires queue exists:", exists('expires'))
m = ch.basic_get('ttl', auto_ack=True)
print("forward: ttl message:", m[2])
step("-1h")
print("back: heartbeats, closed in 6 s =", listen(6, 1))
print("back: expires queue exists:", exists('expires'))
step("+0")
