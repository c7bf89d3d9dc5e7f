"""Bad input before and around connection.open, on raw sockets, as a
client library would never send it: which frames the broker answers (reply
codes only: RabbitMQ's texts quote Erlang terms) and whether it closes the
socket at once or later (RabbitMQ waits 3 s before closing a connection that
failed while starting, and 10 s for a silent client; after its close-ok to a
client's connection.close it leaves the socket for the client to close).

    python3 preopen.py PORT              # prints {case: outcome} as JSON
    python3 preopen.py PORT --record     # the same, to record a broker

Recorded from RabbitMQ 3.10 in preopen-rabbitmq-3.10.json; the test
`pre_open_errors_are_answered_as_rabbitmq_answers_them` in hostile.rs runs
it against a Warren node and compares, except for DIVERGENCES.
"""
import json, socket, struct, sys, threading, time

HDR = b"AMQP\x00\x00\x09\x01"


def frame(kind, ch, payload, end=b"\xce"):
    return struct.pack(">BHI", kind, ch, len(payload)) + payload + end


def method(ch, cls, mid, args=b""):
    return frame(1, ch, struct.pack(">HH", cls, mid) + args)


def sstr(s):
    b = s.encode()
    return bytes([len(b)]) + b


def lstr(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack(">I", len(b)) + b


def table(d):
    b = b""
    for k, v in d.items():
        b += sstr(k) + (b"t\x01" if v is True else b"F" + lstr(table(v)))
    return b


def start_ok(mech="PLAIN", user="guest", pw="guest", props=b""):
    return method(0, 10, 11, lstr(props) + sstr(mech) + lstr(b"\x00" + user.encode() + b"\x00" + pw.encode()) + sstr("en_US"))


TUNE_OK = method(0, 10, 31, struct.pack(">HIH", 2047, 131072, 0))


def open_(vhost="/"):
    return method(0, 10, 40, sstr(vhost) + sstr("") + b"\x00")


def parse(data):
    out = []
    if data.startswith(b"AMQP"):
        out.append("header " + data[:8].hex())
        data = data[8:]
    while len(data) >= 7:
        kind, ch, size = struct.unpack(">BHI", data[:7])
        payload = data[7 : 7 + size]
        if len(payload) < size:
            out.append("partial")
            break
        data = data[8 + size :]
        if kind == 1:
            cls, mid = struct.unpack(">HH", payload[:4])
            if (cls, mid) in ((10, 50), (20, 40)):
                code = struct.unpack(">H", payload[4:6])[0]
                n = payload[6]
                text = payload[7 : 7 + n].decode(errors="replace")
                out.append(f"close ch{ch} {code} {text}")
            elif (cls, mid) == (10, 10):
                out.append("start")
            elif (cls, mid) == (10, 30):
                out.append("tune")
            elif (cls, mid) == (10, 41):
                out.append("open-ok")
            elif (cls, mid) == (20, 11):
                out.append(f"channel.open-ok ch{ch}")
            else:
                out.append(f"method {cls}.{mid} ch{ch}")
        else:
            out.append(f"frame type {kind} ch{ch}")
    if data:
        out.append("trailing " + data[:16].hex())
    return out


def read_for(s, seconds):
    """What the broker sends within `seconds`, and when it closed (or None)."""
    got = b""
    end = time.time() + seconds
    while time.time() < end:
        try:
            d = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return got, time.time()
        if not d:
            return got, time.time()
        got += d
    return got, None


def run(steps, wait=13.0):
    """steps: bytes to send, ("wait", seconds) to read meanwhile, or "shut"
    (end our sending side). Then reads for `wait` seconds at most."""
    s = socket.create_connection(("127.0.0.1", PORT))
    s.settimeout(0.3)
    got = b""
    t0 = time.time()
    closed_at = None
    for st in steps:
        if st == "shut":
            s.shutdown(socket.SHUT_WR)
        elif isinstance(st, tuple):
            more, closed_at = read_for(s, st[1])
            got += more
        else:
            try:
                s.sendall(st)
            except OSError:
                closed_at = time.time()
            t0 = time.time()
        if closed_at is not None:
            break
    if closed_at is None:
        more, closed_at = read_for(s, wait)
        got += more
    s.close()
    at_once = closed_at is not None and closed_at - t0 < 1.5
    reply = [r.split(" - ")[0] for r in parse(got)]
    return {"reply": reply, "socket_closed": "at once" if at_once else "later"}


CLOSE = method(0, 10, 50, struct.pack(">H", 200) + sstr("bye") + struct.pack(">HH", 0, 0))

LOGIN = [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), TUNE_OK, open_(), ("wait", 0.3)]

CASES = {
    "header_0_9": [b"AMQP\x01\x01\x00\x09"],
    "header_0_8": [b"AMQP\x01\x01\x08\x00"],
    "header_0_8_site": [b"AMQP\x01\x01\x09\x01"],
    "header_1_0": [b"AMQP\x00\x01\x00\x00"],
    "header_sasl": [b"AMQP\x03\x01\x00\x00"],
    "http": [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"],
    "partial_header_eof": [b"AMQP", "shut"],
    "bad_password": [HDR, ("wait", 0.3), start_ok(pw="nope")],
    "bad_password_with_capability": [HDR, ("wait", 0.3), start_ok(pw="nope", props=table({"capabilities": {"authentication_failure_close": True}}))],
    "header_then_silence": [HDR],
    "start_ok_then_silence": [HDR, ("wait", 0.3), start_ok()],
    "tune_ok_then_silence": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), TUNE_OK],
    "channel_open_before_connection_open": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), TUNE_OK, method(1, 20, 10, sstr(""))],
    "bad_frame_end_before_connection_open": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), TUNE_OK, open_()[:-1] + b"\x00"],
    "bad_tune_ok": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), method(0, 10, 31, struct.pack(">HIH", 2047, 1000000000, 0))],
    "close_before_open": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), CLOSE],
    "bad_mechanism": [HDR, ("wait", 0.3), start_ok(mech="FOO")],
    "bad_vhost": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), TUNE_OK, open_("nope")],
    "channel_open_before_tune_ok": [HDR, ("wait", 0.3), start_ok(), ("wait", 0.3), method(1, 20, 10, sstr(""))],
    "method_instead_of_start_ok": [HDR, ("wait", 0.3), open_()],
    "heartbeat_before_start_ok": [HDR, ("wait", 0.3), frame(8, 0, b"")],
    "bad_frame_end_pre_open": [HDR, ("wait", 0.3), start_ok()[:-1] + b"\x00"],
    "big_frame_pre_tune": [HDR, ("wait", 0.3), struct.pack(">BHI", 1, 0, 1 << 20) + b"\x00" * 4096],
    "unknown_frame_type": LOGIN + [frame(9, 0, b"")],
    "bad_frame_end": LOGIN + [method(1, 20, 10, sstr(""))[:-1] + b"\x00"],
    "content_header_without_method": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), frame(2, 1, struct.pack(">HHQH", 60, 0, 5, 0))],
    "body_on_channel_0": LOGIN + [frame(3, 0, b"hello")],
    "header_on_channel_0": LOGIN + [frame(2, 0, struct.pack(">HHQH", 60, 0, 5, 0))],
    "heartbeat_on_channel_1": LOGIN + [frame(8, 1, b"")],
    "connection_method_on_channel_1": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), method(1, 10, 40, sstr("/") + sstr("") + b"\x00")],
    "channel_method_on_channel_0": LOGIN + [method(0, 20, 10, sstr(""))],
    "unknown_method": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), method(1, 60, 99)],
    "unknown_class": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), method(1, 77, 10)],
    "truncated_method_args": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), method(1, 50, 10, b"\x00\x00\x05ab")],
    "method_on_unopened_channel": LOGIN + [method(3, 50, 10, b"\x00\x00" + sstr("q") + b"\x00" + lstr(b""))],
    "client_close": LOGIN + [CLOSE],
    "client_close_twice": LOGIN + [CLOSE + CLOSE],
    "client_close_then_publish": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), CLOSE + method(1, 60, 40, b"\x00\x00" + sstr("") + sstr("q") + b"\x00")],
    "frame_over_frame_max": LOGIN + [method(1, 20, 10, sstr("")), ("wait", 0.3), struct.pack(">BHI", 3, 1, 200000) + b"\x00" * 1000],
}


# Where Warren answers otherwise, and why.
DIVERGENCES = {
    # RabbitMQ speaks AMQP 0-8 to these; Warren serves 0-9-1 (and 0-9) only
    # and answers with its protocol header, as the spec asks.
    "header_0_8": "AMQP 0-8 is not served",
    "header_0_8_site": "AMQP 0-8 is not served",
    # RabbitMQ drops the socket without a word (its reader exits); Warren
    # says 540 NOT_IMPLEMENTED with the class and method ids.
    "unknown_method": "540 instead of a dropped socket",
    "unknown_class": "540 instead of a dropped socket",
    # A client's connection.close before open gets close-ok, as the spec
    # says; RabbitMQ treats it as a handshake error.
    "close_before_open": "close-ok for a client's close before open",
}


def main():
    global PORT
    PORT = int(sys.argv[1])
    results = {}

    def one(name):
        results[name] = run(CASES[name])

    threads = [threading.Thread(target=one, args=(n,)) for n in CASES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if "--record" not in sys.argv:
        for name in DIVERGENCES:
            results.pop(name, None)
    print(json.dumps(dict(sorted(results.items())), indent=1))


if __name__ == "__main__":
    main()
