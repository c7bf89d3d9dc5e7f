"""The management API's message operations and smaller endpoints, as client
libraries' own suites use them (AMQPStorm's functional tests): publish and
get over HTTP (by a user who may read but not write, too), the aliveness
test, a queue's bindings, a binding by its
properties key, per-user and per-vhost permissions, bulk user deletion, the
older node health check, a connection's client properties, and the
parameter and vhost-limit lists rabbitmqadmin reads. Prints
{case: outcome} as JSON: status codes and the fields that do not depend on
the broker (no node names, no timestamps).

    python3 probe.py AMQP_PORT HTTP_PORT > rabbitmq-3.10.json   # record a broker

Recorded from RabbitMQ 3.10 in rabbitmq-3.10.json; the test
`management_api_answers_as_rabbitmq_does` in `tests/http_api.rs` runs it
against a Warren node and compares. Needs pika (for the connection's
client properties) and the standard library only.
"""
import base64, json, sys, time, urllib.error, urllib.request

import pika

AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def call(method, path, body=None, auth=AUTH):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method)
    req.add_header("Authorization", auth)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if text else None)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text) if text else None
        except ValueError:
            return e.code, text


def status(method, path, body=None):
    return call(method, path, body)[0]


MESSAGE_FIELDS = ["payload", "payload_encoding", "payload_bytes", "redelivered", "exchange", "routing_key", "message_count", "properties"]
BINDING_FIELDS = ["source", "vhost", "destination", "destination_type", "routing_key", "arguments", "properties_key"]


def messages(r):
    code, body = r
    return [code, [{k: m.get(k) for k in MESSAGE_FIELDS} for m in body or []]]


def bindings(r):
    code, body = r
    return [code, sorted(({k: b.get(k) for k in BINDING_FIELDS} for b in body or []), key=json.dumps)]


def permissions(r):
    code, body = r
    return [code, sorted(json.dumps(p, sort_keys=True) for p in body or [])]


def main():
    global BASE
    amqp_port, http_port = int(sys.argv[1]), int(sys.argv[2])
    BASE = "http://127.0.0.1:%d/api" % http_port
    out = {}
    out["aliveness"] = call("GET", "/aliveness-test/%2F")
    out["aliveness_missing_vhost"] = status("GET", "/aliveness-test/nope")
    status("DELETE", "/queues/%2F/probe.q")
    out["declare"] = status("PUT", "/queues/%2F/probe.q", {"durable": False})
    pub = "/exchanges/%2F/amq.default/publish"
    out["publish_string"] = call("POST", pub, {"routing_key": "probe.q", "payload": "hello", "payload_encoding": "string",
                                               "properties": {"delivery_mode": 2, "headers": {"h": "v", "n": 1}, "content_type": "text/plain"}})
    out["publish_base64"] = call("POST", pub, {"routing_key": "probe.q", "payload": base64.b64encode(b"\x00\xffbin").decode(),
                                               "payload_encoding": "base64", "properties": {}})
    out["publish_third"] = call("POST", pub, {"routing_key": "probe.q", "payload": "third", "payload_encoding": "string",
                                              "properties": {"correlation_id": "c1", "priority": 3}})
    out["publish_unroutable"] = call("POST", pub, {"routing_key": "probe.nowhere", "payload": "x", "payload_encoding": "string", "properties": {}})
    out["publish_missing_exchange"] = call("POST", "/exchanges/%2F/probe.none/publish",
                                             {"routing_key": "k", "payload": "x", "payload_encoding": "string", "properties": {}})
    # A user who may read but not write "/": the broker's own check refuses
    # the publish, the get goes through.
    status("PUT", "/users/probe-ro", {"password": "ro", "tags": "management"})
    status("PUT", "/permissions/%2F/probe-ro", {"configure": "", "write": "", "read": ".*"})
    ro = "Basic " + base64.b64encode(b"probe-ro:ro").decode()
    out["publish_without_write_permission"] = call("POST", pub, {"routing_key": "probe.q", "payload": "x",
                                                                 "payload_encoding": "string", "properties": {}}, auth=ro)
    out["get_with_read_permission"] = messages(call("POST", "/queues/%2F/probe.q/get",
                                                    {"count": 1, "ackmode": "reject_requeue_true", "encoding": "auto"}, auth=ro))
    status("DELETE", "/users/probe-ro")
    get = "/queues/%2F/probe.q/get"
    out["get_requeue"] = messages(call("POST", get, {"count": 2, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 50000}))
    out["get_truncated"] = messages(call("POST", get, {"count": 1, "ackmode": "reject_requeue_true", "encoding": "auto", "truncate": 3}))
    out["get_ack_base64"] = messages(call("POST", get, {"count": 5, "ackmode": "ack_requeue_false", "encoding": "base64"}))
    out["get_empty"] = messages(call("POST", get, {"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"}))
    out["get_missing_queue"] = status("POST", "/queues/%2F/probe.none/get", {"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"})

    out["bind_queue"] = status("POST", "/bindings/%2F/e/amq.direct/q/probe.q", {"routing_key": "k1", "arguments": {}})
    out["queue_bindings"] = bindings(call("GET", "/queues/%2F/probe.q/bindings"))
    code, b = call("GET", "/bindings/%2F/e/amq.direct/q/probe.q/k1")
    out["binding_by_key"] = [code, {k: (b or {}).get(k) for k in BINDING_FIELDS}]
    out["unbind_queue"] = status("DELETE", "/bindings/%2F/e/amq.direct/q/probe.q/k1")
    out["unbind_queue_again"] = status("DELETE", "/bindings/%2F/e/amq.direct/q/probe.q/k1")
    out["queue_bindings_after"] = bindings(call("GET", "/queues/%2F/probe.q/bindings"))
    out["queue_bindings_missing"] = status("GET", "/queues/%2F/probe.none/bindings")
    out["bind_exchange"] = status("POST", "/bindings/%2F/e/amq.match/e/amq.direct", {"routing_key": "probe-x", "arguments": {}})
    out["exchange_bindings"] = bindings(call("GET", "/exchanges/%2F/amq.match/bindings/source"))
    out["unbind_exchange"] = status("DELETE", "/bindings/%2F/e/amq.match/e/amq.direct/probe-x")
    out["exchange_bindings_after"] = bindings(call("GET", "/exchanges/%2F/amq.match/bindings/source"))

    for u in ("probe-u1", "probe-u2", "probe-u3", "probe-u4"):
        status("PUT", "/users/" + u, {"password": "p", "tags": ""})
    out["bulk_delete"] = status("POST", "/users/bulk-delete", {"users": ["probe-u1", "probe-u2"]})
    out["bulk_delete_deleted"] = [status("GET", "/users/probe-u1"), status("GET", "/users/probe-u2")]
    out["bulk_delete_missing"] = call("POST", "/users/bulk-delete", {"users": ["probe-u3", "probe-never", "probe-u4"]})
    out["bulk_delete_missing_left"] = [status("GET", "/users/probe-u3"), status("GET", "/users/probe-u4")]
    status("DELETE", "/users/probe-u4")
    out["user_permissions"] = permissions(call("GET", "/users/guest/permissions"))
    out["vhost_permissions"] = permissions(call("GET", "/vhosts/%2F/permissions"))
    out["user_permissions_missing"] = status("GET", "/users/probe-nobody/permissions")
    out["vhost_permissions_missing"] = status("GET", "/vhosts/probe-none/permissions")

    out["parameters"] = call("GET", "/parameters")
    out["vhost_limits"] = call("GET", "/vhost-limits")
    node = call("GET", "/nodes")[1][0]["name"]
    out["healthcheck"] = call("GET", "/healthchecks/node")
    out["healthcheck_slash"] = call("GET", "/healthchecks/node/")
    out["healthcheck_named"] = call("GET", "/healthchecks/node/" + node)

    props = {"platform": "Atari", "product": "probe", "information": "see the test"}
    params = pika.ConnectionParameters("127.0.0.1", amqp_port, client_properties=props)
    conn = pika.BlockingConnection(params)
    found = None
    for _ in range(100):
        conns = call("GET", "/connections")[1] or []
        found = next((c for c in conns if c.get("client_properties", {}).get("platform") == "Atari"), None)
        if found:
            break
        time.sleep(0.2)
    cp = (found or {}).get("client_properties", {})
    out["connection_client_properties"] = {k: cp.get(k) for k in props} | {
        "capabilities": sorted((cp.get("capabilities") or {}).keys()),
        "auth_mechanism": (found or {}).get("auth_mechanism"),
    }
    conn.close()
    status("DELETE", "/queues/%2F/probe.q")
    status("DELETE", "/queues/%2F/aliveness-test")
    print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
