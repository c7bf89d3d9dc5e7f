//! The OpenAPI 3 description of what the router serves.

use serde_json::{Map, Value, json};

/// Every served path, its methods and a summary.
pub(crate) const ENDPOINTS: &[(&str, &[&str], &str)] = &[
    (
        "/api/overview",
        &["get"],
        "Node overview: versions, every node's listeners, object and message totals with their rates (rates_mode basic; samples with msg_rates_age/msg_rates_incr and lengths_age/lengths_incr, in seconds)",
    ),
    ("/api/whoami", &["get"], "The authenticated user and tags"),
    ("/api/cluster-name", &["get"], "The cluster's name"),
    ("/api/nodes", &["get"], "Cluster nodes"),
    (
        "/api/nodes/{name}",
        &["get"],
        "One node (app_running: whether it accepts AMQP clients)",
    ),
    (
        "/api/nodes/{name}/stop",
        &["post"],
        "Warren's own, administrator only: stop this node as SIGTERM does (warrenctl stop)",
    ),
    (
        "/api/nodes/{name}/stop_app",
        &["post"],
        "Warren's own, administrator only: close every AMQP connection (320 CONNECTION_FORCED) and stop accepting new ones; the node and this API keep running (warrenctl stop_app)",
    ),
    (
        "/api/nodes/{name}/start_app",
        &["post"],
        "Warren's own, administrator only: accept AMQP connections again (warrenctl start_app)",
    ),
    (
        "/api/nodes/{name}/memory_high_watermark",
        &["put"],
        "Warren's own, administrator only: set the memory high watermark, {\"relative\": 0.4} or {\"absolute\": \"2GB\"} (warrenctl set_vm_memory_high_watermark)",
    ),
    (
        "/api/nodes/{name}/disk_free_limit",
        &["put"],
        "Warren's own, administrator only: set the disk free limit, {\"absolute\": \"50MB\"} or {\"mem_relative\": 1.5} (warrenctl set_disk_free_limit)",
    ),
    ("/api/vhosts", &["get"], "Virtual hosts"),
    (
        "/api/vhosts/{vhost}/permissions",
        &["get"],
        "Every user's permissions in a vhost",
    ),
    (
        "/api/vhosts/{vhost}",
        &["get", "put", "delete"],
        "One virtual host",
    ),
    ("/api/users", &["get"], "Users"),
    (
        "/api/users/bulk-delete",
        &["post"],
        "Delete users {\"users\": [names]} in order; 400 at the first missing one",
    ),
    (
        "/api/users/{name}/permissions",
        &["get"],
        "A user's permissions in every vhost",
    ),
    (
        "/api/users/{name}",
        &["get", "put", "delete"],
        "One user (PUT: password or password_hash, tags)",
    ),
    ("/api/permissions", &["get"], "All permissions"),
    (
        "/api/permissions/{vhost}/{user}",
        &["get", "put", "delete"],
        "A user's permissions in a vhost (PUT: configure, write, read)",
    ),
    ("/api/policies", &["get"], "All policies"),
    ("/api/policies/{vhost}", &["get"], "Policies of a vhost"),
    (
        "/api/policies/{vhost}/{name}",
        &["get", "put", "delete"],
        "One policy (PUT: pattern, definition, priority, apply-to); 400 with the validator's reason",
    ),
    ("/api/operator-policies", &["get"], "All operator policies"),
    (
        "/api/operator-policies/{vhost}",
        &["get"],
        "Operator policies of a vhost",
    ),
    (
        "/api/operator-policies/{vhost}/{name}",
        &["get", "put", "delete"],
        "One operator policy",
    ),
    (
        "/api/queues",
        &["get"],
        "Queues with node, slave_nodes, synchronised_slave_nodes, state, policy, effective_policy_definition, message counts (page, page_size, name, use_regex)",
    ),
    ("/api/queues/{vhost}", &["get"], "Queues of a vhost"),
    (
        "/api/queues/{vhost}/{name}",
        &["get", "put", "delete"],
        "One queue (DELETE: if-empty, if-unused)",
    ),
    (
        "/api/queues/{vhost}/{name}/contents",
        &["delete"],
        "Purge a queue",
    ),
    (
        "/api/queues/{vhost}/{name}/actions",
        &["post"],
        "{\"action\":\"sync\"} or {\"action\":\"cancel_sync\"}",
    ),
    (
        "/api/queues/{vhost}/{name}/bindings",
        &["get"],
        "Bindings to a queue, the default exchange's first",
    ),
    (
        "/api/queues/{vhost}/{name}/get",
        &["post"],
        "Get messages: count, ackmode (ack_requeue_true|false, reject_requeue_true|false), encoding (auto|base64), truncate",
    ),
    ("/api/exchanges", &["get"], "Exchanges"),
    ("/api/exchanges/{vhost}", &["get"], "Exchanges of a vhost"),
    (
        "/api/exchanges/{vhost}/{name}",
        &["get"],
        "One exchange (amq.default is the default exchange)",
    ),
    (
        "/api/exchanges/{vhost}/{name}/bindings/source",
        &["get"],
        "Bindings from an exchange",
    ),
    (
        "/api/exchanges/{vhost}/{name}/bindings/destination",
        &["get"],
        "Bindings to an exchange",
    ),
    (
        "/api/exchanges/{vhost}/{name}/publish",
        &["post"],
        "Publish: routing_key, payload, payload_encoding (string|base64), properties; answers {\"routed\": bool}",
    ),
    ("/api/bindings", &["get"], "Bindings"),
    ("/api/bindings/{vhost}", &["get"], "Bindings of a vhost"),
    (
        "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
        &["get", "post"],
        "Bindings from an exchange to a queue (kind q) or exchange (kind e); POST: routing_key, arguments (201, Location: props)",
    ),
    (
        "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
        &["get", "delete"],
        "One binding by its properties key (the routing key, ~ for an empty one)",
    ),
    (
        "/api/connections",
        &["get"],
        "This node's client connections, with recv_oct/send_oct and their rates",
    ),
    (
        "/api/connections/{name}",
        &["get", "delete"],
        "One connection; DELETE closes it (X-Reason header: the text the client gets)",
    ),
    (
        "/api/connections/{name}/channels",
        &["get"],
        "A connection's channels",
    ),
    (
        "/api/channels",
        &["get"],
        "This node's client channels, with message_stats and their rates",
    ),
    (
        "/api/channels/{name}",
        &["get"],
        "One channel, with its consumer_details",
    ),
    ("/api/consumers", &["get"], "Consumers"),
    ("/api/consumers/{vhost}", &["get"], "Consumers of a vhost"),
    (
        "/api/definitions",
        &["get", "post"],
        "Export or import definitions (RabbitMQ's JSON format)",
    ),
    (
        "/api/definitions/{vhost}",
        &["get", "post"],
        "Export or import one vhost's definitions",
    ),
    (
        "/api/health/checks/alarms",
        &["get"],
        "200 without resource alarms anywhere in the cluster, 503 (with the alarms) otherwise",
    ),
    (
        "/api/health/checks/local-alarms",
        &["get"],
        "200 without resource alarms on this node, 503 (with the alarms) otherwise",
    ),
    (
        "/api/health/checks/virtual-hosts",
        &["get"],
        "200 when every vhost runs",
    ),
    (
        "/api/health/checks/node-is-mirror-sync-critical",
        &["get"],
        "503 when a mirrored queue on this node has no synchronised mirror",
    ),
    (
        "/api/health/checks/node-is-quorum-critical",
        &["get"],
        "Always 200: Warren has no quorum queues",
    ),
    (
        "/api/healthchecks/node",
        &["get"],
        "RabbitMQ 3.10's older node check: {\"status\":\"ok\"}, or failed with a reason under a resource alarm",
    ),
    (
        "/api/healthchecks/node/{node}",
        &["get"],
        "The same for this node by name",
    ),
    (
        "/api/aliveness-test/{vhost}",
        &["get"],
        "Declares the queue aliveness-test, publishes test_message to it and gets it back",
    ),
    (
        "/api/parameters",
        &["get"],
        "Runtime parameters: none (Warren has no federation or shovel); also per component and vhost",
    ),
    (
        "/api/vhost-limits",
        &["get"],
        "Vhost limits: none yet; also per vhost",
    ),
    ("/api/openapi.json", &["get"], "This document"),
];

/// The OpenAPI document served at `/api/openapi.json`.
pub fn openapi_document() -> Value {
    let mut paths = Map::new();
    for (path, methods, summary) in ENDPOINTS {
        let mut item = Map::new();
        let params: Vec<Value> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|p| json!({"name": p, "in": "path", "required": true, "schema": {"type": "string"},
                            "description": if p == "vhost" { "the vhost, `/` written %2F" } else { "" }}))
            .collect();
        for m in *methods {
            let responses = match *m {
                "get" => {
                    json!({"200": {"description": "OK"}, "401": {"description": "not authorised"}, "404": {"description": "not found"}})
                }
                "put" => {
                    json!({"201": {"description": "created"}, "204": {"description": "updated"}, "400": {"description": "bad request: {\"error\":\"bad_request\",\"reason\":…}"}, "401": {"description": "not authorised"}})
                }
                _ => {
                    json!({"204": {"description": "done"}, "400": {"description": "bad request"}, "401": {"description": "not authorised"}, "404": {"description": "not found"}})
                }
            };
            item.insert(
                (*m).to_owned(),
                json!({"summary": summary, "parameters": params, "responses": responses}),
            );
        }
        paths.insert((*path).to_owned(), Value::Object(item));
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Warren management HTTP API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "RabbitMQ-compatible management API (3.13 conventions): HTTP basic auth, %2F for the default vhost, 201/204 on PUT, 204 on DELETE, errors as {\"error\":…,\"reason\":…}."
        },
        "components": {"securitySchemes": {"basic": {"type": "http", "scheme": "basic"}}},
        "security": [{"basic": []}],
        "paths": paths,
    })
}
