//! The `/api` handlers.

use std::collections::{BTreeSet, HashMap};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde_json::{Map, Value, json};
use warren_broker::auth::{PermissionDef, UserDef, hash_password};
use warren_broker::meta::PolicyDef;
use warren_broker::{ConnectionInfo, QueueInfo, json_to_table};
use warren_policy::{Policy, PolicyKind, PolicySet, PolicySpec};

use crate::access::{self, AuthUser};
use crate::clients::consumer_json;
use crate::rates::{self, Ranges, Rates};
use crate::{Management, QueueMirrors, clients, defs, process};

/// An API error: status plus RabbitMQ's `{"error":…,"reason":…}` body.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    error: &'static str,
    reason: String,
}

impl ApiError {
    pub(crate) fn bad_request(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            error: "bad_request",
            reason: reason.into(),
        }
    }

    pub(crate) fn reason(&self) -> &str {
        &self.reason
    }

    pub(crate) fn not_found() -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            error: "Object Not Found",
            reason: "Not Found".into(),
        }
    }

    pub(crate) fn unauthorized(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            error: "not_authorized",
            reason: reason.into(),
        }
    }

    pub(crate) fn internal(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            error: "internal_error",
            reason: reason.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": self.error, "reason": self.reason}).to_string();
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
            );
        }
        r
    }
}

impl From<warren_broker::BrokerError> for ApiError {
    fn from(e: warren_broker::BrokerError) -> Self {
        match e {
            warren_broker::BrokerError::Invalid(m) => ApiError::bad_request(m),
            other => ApiError::internal(other.to_string()),
        }
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

pub(crate) fn ok(v: Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

fn created_or_updated(created: bool) -> Response {
    if created {
        StatusCode::CREATED.into_response()
    } else {
        StatusCode::NO_CONTENT.into_response()
    }
}

pub(crate) fn parse_body(body: &Bytes) -> ApiResult<Value> {
    if body.is_empty() {
        return Ok(Value::Object(Map::new()));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    // Arguments become AMQP field tables; they nest no deeper than an AMQP
    // client may send (`{"queues": [{"arguments": …}]}` puts a definition
    // file's arguments three levels down).
    let limit = warren_amqp::MAX_FIELD_DEPTH + 3;
    if json_depth(&v, limit + 1) > limit {
        return Err(ApiError::bad_request(format!(
            "JSON nested deeper than {limit} levels"
        )));
    }
    Ok(v)
}

/// How deeply `v` nests (a scalar is 0), counting no further than `cap`.
fn json_depth(v: &Value, cap: usize) -> usize {
    if cap == 0 {
        return 0;
    }
    let children: Box<dyn Iterator<Item = &Value>> = match v {
        Value::Array(a) => Box::new(a.iter()),
        Value::Object(m) => Box::new(m.values()),
        _ => return 0,
    };
    1 + children.map(|c| json_depth(c, cap - 1)).max().unwrap_or(0)
}

/// The `/api` routes with auth.
pub(crate) fn routes(state: Management) -> Router {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/whoami", get(whoami))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{name}", get(node_one))
        .route("/api/nodes/{name}/stop", post(crate::node::stop))
        .route("/api/nodes/{name}/stop_app", post(crate::node::stop_app))
        .route("/api/nodes/{name}/start_app", post(crate::node::start_app))
        .route(
            "/api/nodes/{name}/memory_high_watermark",
            axum::routing::put(crate::node::set_memory_limit),
        )
        .route(
            "/api/nodes/{name}/disk_free_limit",
            axum::routing::put(crate::node::set_disk_limit),
        )
        .route("/api/vhosts", get(vhosts))
        .route(
            "/api/vhosts/{vhost}",
            get(vhost_get).put(vhost_put).delete(vhost_delete),
        )
        .route("/api/users", get(users))
        .route("/api/users/bulk-delete", post(users_bulk_delete))
        .route("/api/users/{name}/permissions", get(user_permissions))
        .route("/api/vhosts/{vhost}/permissions", get(vhost_permissions))
        .route(
            "/api/users/{name}",
            get(user_get).put(user_put).delete(user_delete),
        )
        .route("/api/permissions", get(permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(permission_get)
                .put(permission_put)
                .delete(permission_delete),
        )
        .route("/api/policies", get(policies_all))
        .route("/api/policies/{vhost}", get(policies_vhost))
        .route(
            "/api/policies/{vhost}/{name}",
            get(policy_get).put(policy_put).delete(policy_delete),
        )
        .route("/api/operator-policies", get(op_policies_all))
        .route("/api/operator-policies/{vhost}", get(op_policies_vhost))
        .route(
            "/api/operator-policies/{vhost}/{name}",
            get(op_policy_get)
                .put(op_policy_put)
                .delete(op_policy_delete),
        )
        .route("/api/queues", get(queues_all))
        .route("/api/queues/{vhost}", get(queues_vhost))
        .route(
            "/api/queues/{vhost}/{name}",
            get(queue_get).put(queue_put).delete(queue_delete),
        )
        .route(
            "/api/queues/{vhost}/{name}/contents",
            axum::routing::delete(queue_purge),
        )
        .route("/api/queues/{vhost}/{name}/actions", post(queue_action))
        .route("/api/queues/{vhost}/{name}/bindings", get(queue_bindings))
        .route("/api/queues/{vhost}/{name}/get", post(crate::messages::get))
        .route("/api/exchanges", get(exchanges_all))
        .route("/api/exchanges/{vhost}", get(exchanges_vhost))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(exchange_get).put(exchange_put).delete(exchange_delete),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/{side}",
            get(exchange_bindings),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/publish",
            post(crate::messages::publish),
        )
        .route("/api/bindings", get(bindings_all))
        .route("/api/bindings/{vhost}", get(bindings_vhost))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(bindings_between).post(binding_post),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(binding_get).delete(binding_delete),
        )
        .route("/api/connections", get(clients::connections))
        .route(
            "/api/connections/{name}",
            get(clients::connection_get).delete(clients::connection_close),
        )
        .route(
            "/api/connections/{name}/channels",
            get(clients::connection_channels),
        )
        .route("/api/channels", get(clients::channels))
        .route("/api/channels/{name}", get(clients::channel_get))
        .route("/api/consumers", get(clients::consumers_all))
        .route("/api/consumers/{vhost}", get(clients::consumers_vhost))
        .route(
            "/api/definitions",
            get(defs::export_all).post(defs::import_all),
        )
        .route(
            "/api/definitions/{vhost}",
            get(defs::export_vhost).post(defs::import_vhost),
        )
        .route("/api/health/checks/alarms", get(alarms_cluster))
        .route("/api/health/checks/local-alarms", get(alarms_local))
        .route("/api/health/checks/virtual-hosts", get(health_ok))
        .route(
            "/api/health/checks/node-is-mirror-sync-critical",
            get(mirror_sync_critical),
        )
        .route("/api/health/checks/node-is-quorum-critical", get(health_ok))
        .route("/api/healthchecks/node", get(healthcheck_node))
        .route("/api/healthchecks/node/", get(healthcheck_node))
        .route("/api/healthchecks/node/{node}", get(healthcheck_named))
        .route(
            "/api/aliveness-test/{vhost}",
            get(crate::messages::aliveness),
        )
        .route("/api/cluster-name", get(cluster_name))
        .route("/api/cluster", get(crate::cluster::status))
        .route("/api/cluster/join", post(crate::cluster::join))
        .route(
            "/api/cluster/nodes/{name}",
            axum::routing::delete(crate::cluster::forget),
        )
        .route("/api/parameters", get(none_yet))
        .route("/api/parameters/{component}", get(none_yet))
        .route("/api/parameters/{component}/{vhost}", get(none_yet))
        .route("/api/vhost-limits", get(none_yet))
        .route("/api/vhost-limits/{vhost}", get(none_yet))
        .route("/api/openapi.json", get(openapi))
        .route("/api/{*rest}", get(api_not_found).put(api_not_found))
        .route_layer(middleware::from_fn_with_state(state.clone(), access::auth))
        .with_state(state)
}

async fn api_not_found() -> ApiError {
    ApiError::not_found()
}

async fn openapi() -> Response {
    ok(crate::openapi::openapi_document())
}

// ---------------------------------------------------------------- overview

async fn overview(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let ranges = Ranges::from_query(&q);
    let mut v = json!({
        "management_version": env!("CARGO_PKG_VERSION"),
        "rates_mode": "basic",
        "rabbitmq_version": "3.13.7",
        "product_name": s.product.0,
        "product_version": s.product.1,
        "cluster_name": s.node,
        "erlang_version": "none (Rust)",
    });
    let mut totals = if u.is_monitor() {
        node_totals(&s, &ranges)
    } else {
        user_totals(&s, &u)
    };
    // Clients are counted cluster-wide, as RabbitMQ's object totals are:
    // each other running node's own.
    for other in crate::fanout::answers(&s, &headers, uri.path(), &HashMap::new()).await {
        for key in ["connections", "channels", "consumers"] {
            let theirs = other["object_totals"][key].as_u64();
            if let (Some(n), Some(mine)) = (theirs, totals["object_totals"].get_mut(key)) {
                *mine = json!(mine.as_u64().unwrap_or(0) + n);
            }
        }
    }
    if let (Value::Object(o), Value::Object(t)) = (&mut v, totals) {
        o.extend(t);
    }
    ok(v)
}

fn queue_totals(ready: u64, unacked: u64) -> Value {
    json!({
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
    })
}

/// The overview's node-wide part, for monitors: this node, its listeners,
/// and the totals of every vhost and connection, with their rates.
fn node_totals(s: &Management, ranges: &Ranges) -> Value {
    let (o, n) = (s.overview(), s.message_stats().0);
    let listener = |node: &str, protocol: &str, addr: &str| {
        let (host, port) = host_and_port(addr);
        json!({"node": node, "protocol": protocol, "ip_address": host, "port": port})
    };
    let mut listeners: Vec<Value> = s
        .listeners
        .iter()
        .map(|(p, a)| listener(&s.node, p, &a.to_string()))
        .collect();
    // Every member's peer listener, as the cluster's membership records
    // it, and the other members' listeners, as each recorded them.
    if let Some(c) = &s.cluster {
        for m in c.status().members {
            listeners.push(listener(&m.name, "clustering", &m.addr));
            if m.name != s.node {
                listeners.extend(m.listeners.iter().map(|(p, a)| listener(&m.name, p, a)));
            }
        }
    }
    let contexts: Vec<Value> = s
        .http_addr
        .map(|a| json!({"node": s.node, "description": "Warren Management", "path": "/", "port": a.port().to_string()}))
        .into_iter()
        .collect();
    let r = s.rates();
    let series = Some(r.node());
    let message_stats = r.counters(series, rates::NODE, &rates::message_values(&n), ranges);
    let mut totals = queue_totals(o.messages_ready, o.messages_unacknowledged);
    if let Value::Object(t) = &mut totals {
        r.gauges(t, series, rates::NODE, ranges);
    }
    json!({
        "node": s.node,
        "listeners": listeners,
        "contexts": contexts,
        "object_totals": {
            "connections": o.connections,
            "channels": o.channels,
            "exchanges": o.exchanges,
            "queues": o.queues,
            "consumers": o.consumers,
        },
        "queue_totals": totals,
        "message_stats": message_stats,
    })
}

/// The overview's part for a user who is not a monitor, as RabbitMQ
/// scopes it: queues, exchanges and message counts of the vhosts the user
/// has permissions in (message stats and their rates summed over the
/// queues this node serves), the user's own connections and channels, and
/// no consumer count.
fn user_totals(s: &Management, u: &AuthUser) -> Value {
    let (vhosts, exchanges) = {
        let b = s.broker();
        let vhosts: Vec<String> = b
            .vhost_names()
            .into_iter()
            .filter(|v| u.lists_vhost(v))
            .collect();
        let exchanges: usize = vhosts.iter().map(|v| b.exchanges(Some(v)).len()).sum();
        (vhosts, exchanges)
    };
    let queues: Vec<QueueInfo> = vhosts.iter().flat_map(|v| s.queues(Some(v))).collect();
    let conns: Vec<ConnectionInfo> = s
        .connections()
        .into_iter()
        .filter(|c| u.sees_owner(&c.user))
        .collect();
    let sum = |f: fn(&QueueInfo) -> u64| queues.iter().map(f).sum::<u64>();
    let served: Vec<&QueueInfo> = queues.iter().filter(|q| q.served_here).collect();
    let mut message_stats = Map::new();
    let r = s.rates();
    for (i, field) in rates::QUEUE.counters.iter().enumerate() {
        let total: u64 = served
            .iter()
            .map(|q| rates::queue_values(&q.counters, 0, 0)[i])
            .sum();
        let rate: f64 = served
            .iter()
            .map(|q| r.rate(r.queue(&q.vhost, &q.name), i))
            .sum();
        message_stats.insert((*field).to_owned(), json!(total));
        message_stats.insert(format!("{field}_details"), json!({"rate": rate}));
    }
    json!({
        "object_totals": {
            "connections": conns.len(),
            "channels": conns.iter().map(|c| c.channels).sum::<u64>(),
            "exchanges": exchanges,
            "queues": queues.len(),
        },
        "queue_totals": queue_totals(sum(|q| q.messages_ready), sum(|q| q.messages_unacknowledged)),
        "message_stats": message_stats,
    })
}

async fn whoami(Extension(u): Extension<AuthUser>) -> Response {
    ok(json!({"name": u.name, "tags": u.tags}))
}

async fn cluster_name(State(s): State<Management>) -> Response {
    ok(json!({"name": s.node}))
}

fn node_json(s: &Management) -> Value {
    let io = s.io_stats();
    let b = s.broker();
    let r = b.resources();
    let mut node = json!({
        "name": s.node,
        "type": "disc",
        "running": true,
        "app_running": s.node_control.as_ref().is_none_or(|c| c.app_running()),
        "os_pid": std::process::id().to_string(),
        "mem_used": r.sample.memory_used,
        "mem_limit": r.memory_limit,
        "mem_alarm": r.memory_alarm,
        "disk_free": r.sample.disk_free,
        "disk_free_limit": r.disk_free_limit,
        "disk_free_alarm": r.disk_alarm,
        "processors": std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        "uptime": u64::try_from(s.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "partitions": [],
        "cluster_links": cluster_links(s),
        "rates_mode": "basic",
        "being_drained": false,
        "io_sync_count": io.syncs,
    });
    // What cannot be read is left out, not shown as 0.
    if let Value::Object(n) = &mut node {
        if let Some(fds) = process::fds() {
            n.insert("fd_used".into(), fds.into());
        }
        if let Some((used, total)) = s.node_control.as_ref().and_then(|c| c.client_sockets()) {
            n.insert("sockets_used".into(), used.into());
            if let Some(total) = total {
                n.insert("sockets_total".into(), total.into());
            }
        }
        if let Some(limit) = process::fd_limit() {
            n.insert("fd_total".into(), limit.into());
        }
        if let Some(tasks) = process::tasks_alive() {
            n.insert("proc_used".into(), tasks.into());
        }
    }
    node
}

/// A peer address `host:port` as its two parts (the port `null` if there
/// is none).
fn host_and_port(addr: &str) -> (&str, Option<u16>) {
    match addr.rsplit_once(':') {
        Some((host, port)) => match port.parse() {
            Ok(port) => (
                host.trim_start_matches('[').trim_end_matches(']'),
                Some(port),
            ),
            Err(_) => (addr, None),
        },
        None => (addr, None),
    }
}

/// RabbitMQ's `cluster_links`: the other members this node hears from (the
/// failure detector's running members), each with its peer address. Byte
/// counts are not kept, so they are not shown.
fn cluster_links(s: &Management) -> Vec<Value> {
    s.running_others()
        .iter()
        .map(|m| {
            let (host, port) = host_and_port(&m.addr);
            json!({"name": m.name, "peer_addr": host, "peer_port": port})
        })
        .collect()
}

/// This node in full, then the other cluster members as the cluster sees
/// them (what only a node knows of itself — its links, partitions, process
/// — is not shown for the others).
fn all_nodes(s: &Management) -> Vec<Value> {
    let mut out = vec![node_json(s)];
    if let Some(c) = &s.cluster {
        let alarms = s.broker().alarms_in_force();
        for m in c.status().members.iter().filter(|m| m.name != s.node) {
            let a = alarms
                .iter()
                .find(|(n, _)| *n == m.name)
                .map(|(_, a)| *a)
                .unwrap_or_default();
            out.push(json!({
                "name": m.name,
                "type": "disc",
                "running": m.running,
                "mem_alarm": a.memory,
                "disk_free_alarm": a.disk,
                "peer_addr": m.addr,
                "voter": m.voter,
            }));
        }
    }
    out
}

/// Every node, each running one described by itself (memory, descriptors,
/// sockets, uptime, … as its own API shows them), with what the cluster
/// records of it (`peer_addr`, `voter`).
async fn described_nodes(s: &Management, headers: &HeaderMap, only: Option<&str>) -> Vec<Value> {
    let mut nodes: Vec<Value> = all_nodes(s)
        .into_iter()
        .filter(|n| only.is_none_or(|o| n["name"] == o))
        .collect();
    let running: Vec<String> = nodes
        .iter()
        .filter(|n| n["running"] == true)
        .filter_map(|n| n["name"].as_str().map(str::to_owned))
        .collect();
    let own = crate::fanout::ask_each(s, headers, Some(&running), |n| {
        format!("/api/nodes/{}", crate::fanout::segment(n))
    })
    .await;
    for n in &mut nodes {
        let Some(Value::Object(theirs)) = n["name"].as_str().and_then(|name| own.get(name)) else {
            continue;
        };
        if let Value::Object(o) = n {
            for (k, v) in theirs {
                o.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
    }
    nodes
}

async fn nodes(State(s): State<Management>, headers: HeaderMap) -> Response {
    ok(Value::Array(described_nodes(&s, &headers, None).await))
}

async fn node_one(
    State(s): State<Management>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    described_nodes(&s, &headers, Some(&name))
        .await
        .into_iter()
        .next()
        .map(ok)
        .ok_or_else(ApiError::not_found)
}

// ------------------------------------------------------------------ vhosts

fn vhost_json(s: &Management, name: &str) -> Value {
    let qs = s.queues(Some(name));
    let ready: u64 = qs.iter().map(|q| q.messages_ready).sum();
    let unacked: u64 = qs.iter().map(|q| q.messages_unacknowledged).sum();
    json!({
        "name": name,
        "description": "",
        "tags": [],
        "default_queue_type": "classic",
        "tracing": false,
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "cluster_state": {s.node.clone(): "running"},
    })
}

async fn vhosts(State(s): State<Management>, Extension(u): Extension<AuthUser>) -> Response {
    let names = s.broker().vhost_names();
    ok(Value::Array(
        names
            .iter()
            .filter(|n| u.lists_vhost(n))
            .map(|n| vhost_json(&s, n))
            .collect(),
    ))
}

async fn vhost_get(State(s): State<Management>, Path(vhost): Path<String>) -> ApiResult<Response> {
    if !s.broker().has_vhost(&vhost) {
        return Err(ApiError::not_found());
    }
    Ok(ok(vhost_json(&s, &vhost)))
}

async fn vhost_put(
    State(s): State<Management>,
    Path(vhost): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    parse_body(&body)?;
    if vhost.is_empty() {
        return Err(ApiError::bad_request("vhost name must not be empty"));
    }
    let created = s.changing(|b| Ok(b.ensure_vhost(&vhost)?)).await?;
    Ok(created_or_updated(created))
}

async fn vhost_delete(
    State(s): State<Management>,
    Path(vhost): Path<String>,
) -> ApiResult<Response> {
    if s.changing(|b| Ok(b.delete_vhost(&vhost)?)).await? {
        Ok(no_content())
    } else {
        Err(ApiError::not_found())
    }
}

// ------------------------------------------------------------------- users

fn user_json(u: &UserDef) -> Value {
    json!({
        "name": u.name,
        "password_hash": u.password_hash,
        "hashing_algorithm": "rabbit_password_hashing_sha256",
        "tags": u.tags,
        "limits": {},
    })
}

async fn users(State(s): State<Management>) -> Response {
    let us = s.broker().users();
    ok(Value::Array(us.iter().map(user_json).collect()))
}

async fn user_get(State(s): State<Management>, Path(name): Path<String>) -> ApiResult<Response> {
    let b = s.broker();
    let u = b.user(&name).ok_or_else(ApiError::not_found)?;
    Ok(ok(user_json(u)))
}

/// Tags as a JSON string (`"a,b"`) or array.
pub(crate) fn parse_tags(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::String(t)) => t
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|t| t.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

async fn user_put(
    State(s): State<Management>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    if name.is_empty() {
        return Err(ApiError::bad_request("user name must not be empty"));
    }
    s.changing(|b| {
        let existing = b.user(&name).cloned();
        let password_hash = match (
            v.get("password_hash").and_then(Value::as_str),
            v.get("password").and_then(Value::as_str),
        ) {
            (Some(h), _) => h.to_owned(),
            (None, Some(p)) => hash_password(p),
            (None, None) => existing
                .as_ref()
                .map(|u| u.password_hash.clone())
                .unwrap_or_default(),
        };
        let tags = if v.get("tags").is_some() {
            parse_tags(v.get("tags"))
        } else {
            existing
                .as_ref()
                .map(|u| u.tags.clone())
                .unwrap_or_default()
        };
        b.put_user(UserDef {
            loopback_only: existing.as_ref().is_some_and(|u| u.loopback_only),
            name,
            password_hash,
            tags,
        })?;
        Ok(created_or_updated(existing.is_none()))
    })
    .await
}

async fn user_delete(State(s): State<Management>, Path(name): Path<String>) -> ApiResult<Response> {
    if s.changing(|b| Ok(b.delete_user(&name)?)).await? {
        Ok(no_content())
    } else {
        Err(ApiError::not_found())
    }
}

/// `POST /api/users/bulk-delete` with `{"users": [names]}`: deletes them in
/// order; at the first that does not exist it stops with 400 (those before
/// it stay deleted), as RabbitMQ 3.10 does.
async fn users_bulk_delete(State(s): State<Management>, body: Bytes) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    let names: Vec<String> = v
        .get("users")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("[{key_missing,users}]"))?
        .iter()
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect();
    let missing = s
        .changing(|b| {
            for name in &names {
                if !b.delete_user(name)? {
                    return Ok(Some(name.clone()));
                }
            }
            Ok(None)
        })
        .await?;
    match missing {
        None => Ok(no_content()),
        Some(name) => Ok((
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "application/json")],
            json!({"error": "bad_request", "reason": ["no_such_user", name]}).to_string(),
        )
            .into_response()),
    }
}

// ------------------------------------------------------------- permissions

fn permission_json(p: &PermissionDef) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

async fn permissions(State(s): State<Management>) -> Response {
    let ps = s.broker().permissions();
    ok(Value::Array(ps.iter().map(permission_json).collect()))
}

/// `GET /api/users/{name}/permissions`: the user's permissions in every vhost.
async fn user_permissions(
    State(s): State<Management>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let b = s.broker();
    let exists = b.user(&name).is_some();
    permissions_where(&b, exists, |p| p.user == name)
}

/// `GET /api/vhosts/{vhost}/permissions`: every user's permissions in it.
async fn vhost_permissions(
    State(s): State<Management>,
    Path(vhost): Path<String>,
) -> ApiResult<Response> {
    let b = s.broker();
    let exists = b.has_vhost(&vhost);
    permissions_where(&b, exists, |p| p.vhost == vhost)
}

/// The permissions `keep` selects; 404 unless the user or vhost `exists`.
fn permissions_where(
    b: &warren_broker::Broker,
    exists: bool,
    keep: impl Fn(&PermissionDef) -> bool,
) -> ApiResult<Response> {
    if !exists {
        return Err(ApiError::not_found());
    }
    let ps = b.permissions();
    Ok(ok(Value::Array(
        ps.iter().filter(|p| keep(p)).map(permission_json).collect(),
    )))
}

async fn permission_get(
    State(s): State<Management>,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult<Response> {
    let ps = s.broker().permissions();
    let p = ps
        .iter()
        .find(|p| p.vhost == vhost && p.user == user)
        .ok_or_else(ApiError::not_found)?;
    Ok(ok(permission_json(p)))
}

async fn permission_put(
    State(s): State<Management>,
    Path((vhost, user)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    let field = |k: &str| -> ApiResult<String> {
        v.get(k)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| ApiError::bad_request(format!("[{{key_missing,{k}}}]")))
    };
    let p = PermissionDef {
        configure: field("configure")?,
        write: field("write")?,
        read: field("read")?,
        user,
        vhost,
    };
    s.changing(|b| {
        if b.user(&p.user).is_none() {
            return Err(ApiError::bad_request(format!("no user '{}'", p.user)));
        }
        if !b.has_vhost(&p.vhost) {
            return Err(ApiError::bad_request(format!("no vhost '{}'", p.vhost)));
        }
        let created = !b
            .permissions()
            .iter()
            .any(|x| x.vhost == p.vhost && x.user == p.user);
        b.set_permissions(p)?;
        Ok(created_or_updated(created))
    })
    .await
}

async fn permission_delete(
    State(s): State<Management>,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult<Response> {
    if s.changing(|b| Ok(b.clear_permissions(&user, &vhost)?))
        .await?
    {
        Ok(no_content())
    } else {
        Err(ApiError::not_found())
    }
}

// ---------------------------------------------------------------- policies

pub(crate) fn policy_json(p: &PolicyDef) -> Value {
    json!({
        "vhost": p.vhost,
        "name": p.name,
        "pattern": p.pattern,
        "apply-to": p.apply_to,
        "definition": p.definition,
        "priority": p.priority,
    })
}

fn list_policies(
    s: &Management,
    u: &AuthUser,
    vhost: Option<&str>,
    operator: bool,
) -> ApiResult<Response> {
    let b = s.broker();
    if let Some(v) = vhost
        && !b.has_vhost(v)
    {
        return Err(ApiError::not_found());
    }
    let mut ps: Vec<PolicyDef> = b
        .policies()
        .into_iter()
        .filter(|p| p.operator == operator && vhost.is_none_or(|v| v == p.vhost))
        .collect();
    ps.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
    Ok(ok(Value::Array(
        u.only_visible(ps.iter().map(policy_json).collect()),
    )))
}

fn get_policy(s: &Management, vhost: &str, name: &str, operator: bool) -> ApiResult<Response> {
    let ps = s.broker().policies();
    let p = ps
        .iter()
        .find(|p| p.vhost == vhost && p.name == name && p.operator == operator)
        .ok_or_else(ApiError::not_found)?;
    Ok(ok(policy_json(p)))
}

/// Validates a policy body (as PUT or a definitions file gives it) with
/// warren-policy; the error is the validator's message.
pub(crate) fn validate_policy(
    vhost: &str,
    name: &str,
    v: &Value,
    operator: bool,
) -> ApiResult<PolicyDef> {
    let pattern = v
        .get("pattern")
        .ok_or_else(|| ApiError::bad_request("[{key_missing,pattern}]"))?;
    let definition = v
        .get("definition")
        .ok_or_else(|| ApiError::bad_request("[{key_missing,definition}]"))?;
    let Some(pattern) = pattern.as_str() else {
        return Err(ApiError::bad_request("pattern must be a string"));
    };
    let priority = match v.get("priority") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) => n
            .as_i64()
            .ok_or_else(|| ApiError::bad_request(format!("invalid priority {n}")))?,
        Some(Value::String(t)) => {
            warren_policy::parse_priority(t).map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!("invalid priority {other}")));
        }
    };
    let apply_to_raw = match v.get("apply-to") {
        None | Some(Value::Null) => "all".to_owned(),
        Some(Value::String(t)) => t.clone(),
        Some(other) => return Err(ApiError::bad_request(format!("invalid apply-to {other}"))),
    };
    let apply_to: warren_policy::ApplyTo =
        serde_json::from_value(Value::String(apply_to_raw.clone()))
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let spec = PolicySpec::new(vhost, name, pattern, definition.clone())
        .apply_to(apply_to)
        .priority(priority);
    let kind = if operator {
        PolicyKind::Operator
    } else {
        PolicyKind::Regular
    };
    Policy::new(kind, &spec).map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(PolicyDef {
        vhost: vhost.to_owned(),
        name: name.to_owned(),
        pattern: pattern.to_owned(),
        apply_to: apply_to.as_str().to_owned(),
        priority,
        definition: definition.clone(),
        operator,
    })
}

async fn put_policy(
    s: &Management,
    vhost: &str,
    name: &str,
    body: &Bytes,
    operator: bool,
) -> ApiResult<Response> {
    let v = parse_body(body)?;
    let def = validate_policy(vhost, name, &v, operator)?;
    s.changing(|b| {
        if !b.has_vhost(vhost) {
            return Err(ApiError::not_found());
        }
        let created = !b
            .policies()
            .iter()
            .any(|p| p.vhost == vhost && p.name == name && p.operator == operator);
        b.put_policy(def)?;
        tracing::info!(vhost, policy = name, operator, "policy set");
        Ok(created_or_updated(created))
    })
    .await
}

async fn delete_policy(
    s: &Management,
    vhost: &str,
    name: &str,
    operator: bool,
) -> ApiResult<Response> {
    if s.changing(|b| Ok(b.delete_policy(vhost, name, operator)?))
        .await?
    {
        tracing::info!(vhost, policy = name, operator, "policy cleared");
        Ok(no_content())
    } else {
        Err(ApiError::not_found())
    }
}

async fn policies_all(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
) -> ApiResult<Response> {
    list_policies(&s, &u, None, false)
}
async fn policies_vhost(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(vhost): Path<String>,
) -> ApiResult<Response> {
    list_policies(&s, &u, Some(&vhost), false)
}
async fn policy_get(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    get_policy(&s, &vhost, &name, false)
}
async fn policy_put(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    put_policy(&s, &vhost, &name, &body, false).await
}
async fn policy_delete(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    delete_policy(&s, &vhost, &name, false).await
}
async fn op_policies_all(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
) -> ApiResult<Response> {
    list_policies(&s, &u, None, true)
}
async fn op_policies_vhost(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(vhost): Path<String>,
) -> ApiResult<Response> {
    list_policies(&s, &u, Some(&vhost), true)
}
async fn op_policy_get(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    get_policy(&s, &vhost, &name, true)
}
async fn op_policy_put(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    put_policy(&s, &vhost, &name, &body, true).await
}
async fn op_policy_delete(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    delete_policy(&s, &vhost, &name, true).await
}

/// The cluster members that are not running (none on a node alone).
fn down_nodes(s: &Management) -> BTreeSet<String> {
    s.cluster.as_ref().map_or_else(BTreeSet::new, |c| {
        c.status()
            .members
            .into_iter()
            .filter(|m| !m.running)
            .map(|m| m.name)
            .collect()
    })
}

/// A queue as `/api/queues` shows it. Its message stats and rates are
/// shown by the node that serves it (elsewhere they are not known). A
/// queue whose node is down (in `down`) is `"state": "down"` with no
/// message counts, as RabbitMQ shows it: what it holds is not known; one
/// whose log failed is `"stopped"` (RabbitMQ's state for a queue its vhost
/// stopped when the message store failed), likewise without counts.
pub(crate) fn queue_json(
    node: &str,
    q: &QueueInfo,
    set: &PolicySet,
    (m, down): (Option<QueueMirrors>, &BTreeSet<String>),
    (r, ranges): (&Rates, &Ranges),
) -> Value {
    let eff = set.effective_for_queue(&q.vhost, &q.name, q.exclusive);
    let m = m.unwrap_or_else(|| QueueMirrors {
        node: node.to_owned(),
        ..QueueMirrors::default()
    });
    let down = down.contains(&m.node);
    let state = if down {
        "down"
    } else if q.log_failed {
        "stopped"
    } else if m.syncing.is_some() {
        "syncing"
    } else {
        "running"
    };
    let mut v = json!({
        "name": q.name,
        "vhost": q.vhost,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive,
        "arguments": q.arguments,
        "type": "classic",
        "node": m.node,
        "pid": format!("<{}.{}>", m.node, q.uid),
        "owner_pid": q.owner.map(|o| format!("<{node}.conn.{o}>")),
        "slave_nodes": m.slave_nodes,
        "synchronised_slave_nodes": m.synchronised_slave_nodes,
        "recoverable_slaves": Value::Null,
        "state": state,
        "policy": eff.policy,
        "operator_policy": eff.operator_policy,
        "effective_policy_definition": Value::Object(eff.definition.to_json()),
        "consumers": q.consumers,
        "consumer_capacity": if q.consumers > 0 { 1.0 } else { 0.0 },
        "consumer_utilisation": if q.consumers > 0 { 1.0 } else { 0.0 },
        "messages": q.messages_ready + q.messages_unacknowledged,
        "messages_ready": q.messages_ready,
        "messages_unacknowledged": q.messages_unacknowledged,
        "message_bytes": q.message_bytes_ready + q.message_bytes_unacknowledged,
        "message_bytes_ready": q.message_bytes_ready,
        "message_bytes_unacknowledged": q.message_bytes_unacknowledged,
    });
    if down || q.log_failed {
        if let Value::Object(o) = &mut v {
            o.retain(|k, _| !k.starts_with("message") && !k.starts_with("consumer_"));
        }
        return v;
    }
    if let Value::Object(o) = &mut v {
        if let Some(n) = m.syncing {
            o.insert("sync_messages".into(), json!(n));
        }
        if q.served_here {
            let series = r.queue(&q.vhost, &q.name);
            let values = rates::queue_values(&q.counters, 0, 0);
            let stats = r.counters(series, rates::QUEUE, &values, ranges);
            o.insert("message_stats".into(), Value::Object(stats));
            r.gauges(o, series, rates::QUEUE, ranges);
        }
    }
    v
}

fn all_queues_json(s: &Management, vhost: Option<&str>, ranges: &Ranges) -> ApiResult<Vec<Value>> {
    let defs = {
        let b = s.broker();
        if let Some(v) = vhost
            && !b.has_vhost(v)
        {
            return Err(ApiError::not_found());
        }
        b.policies()
    };
    let qs = s.queues(vhost);
    let set = warren_broker::policy_set(&defs);
    let r = s.rates();
    let down = down_nodes(s);
    Ok(qs
        .iter()
        .map(|q| {
            let m = s.mirrors.mirrors(&q.vhost, &q.name);
            queue_json(&s.node, q, &set, (m, &down), (&r, ranges))
        })
        .collect())
}

/// RabbitMQ's pagination (`page`, `page_size`) and `name` filter for list endpoints.
pub(crate) fn paged(items: Vec<Value>, q: &HashMap<String, String>) -> Value {
    let total = items.len();
    let filtered: Vec<Value> = match q.get("name").filter(|n| !n.is_empty()) {
        Some(n) => {
            let re = q
                .get("use_regex")
                .is_some_and(|x| x == "true")
                .then(|| regex_lite(n));
            items
                .into_iter()
                .filter(|it| {
                    let name = it.get("name").and_then(Value::as_str).unwrap_or("");
                    match &re {
                        Some(Some(r)) => r.is_match(name),
                        _ => name.contains(n.as_str()),
                    }
                })
                .collect()
        }
        None => items,
    };
    let Some(page) = q.get("page").and_then(|p| p.parse::<usize>().ok()) else {
        return Value::Array(filtered);
    };
    let page = page.max(1);
    let size = q
        .get("page_size")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(100)
        .clamp(1, 500);
    let filtered_count = filtered.len();
    let page_count = filtered_count.div_ceil(size).max(1);
    let items: Vec<Value> = filtered
        .into_iter()
        .skip((page - 1) * size)
        .take(size)
        .collect();
    json!({
        "items": items,
        "page": page,
        "page_size": size,
        "page_count": page_count,
        "filtered_count": filtered_count,
        "item_count": items.len(),
        "total_count": total,
    })
}

fn regex_lite(pattern: &str) -> Option<regex::Regex> {
    regex::Regex::new(pattern).ok()
}

async fn queues_all(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let ranges = Ranges::from_query(&q);
    Ok(ok(paged(
        u.only_visible(all_queues_json(&s, None, &ranges)?),
        &q,
    )))
}

async fn queues_vhost(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let ranges = Ranges::from_query(&q);
    Ok(ok(paged(
        u.only_visible(all_queues_json(&s, Some(&vhost), &ranges)?),
        &q,
    )))
}

fn one_queue(s: &Management, vhost: &str, name: &str, ranges: &Ranges) -> ApiResult<Value> {
    let q = s
        .queues(Some(vhost))
        .into_iter()
        .find(|q| q.name == name)
        .ok_or_else(ApiError::not_found)?;
    let defs = s.broker().policies();
    let set = warren_broker::policy_set(&defs);
    let m = s.mirrors.mirrors(vhost, name);
    let mut v = queue_json(&s.node, &q, &set, (m, &down_nodes(s)), (&s.rates(), ranges));
    let consumers: Vec<Value> = {
        let (conns, consumers) = s.conns_and_consumers(Some(vhost));
        consumers
            .iter()
            .filter(|c| c.queue == name)
            .map(|c| consumer_json(&s.node, c, &conns))
            .collect()
    };
    if let Value::Object(o) = &mut v {
        o.insert("consumer_details".into(), Value::Array(consumers));
    }
    Ok(v)
}

async fn queue_get(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let mut v = one_queue(&s, &vhost, &name, &Ranges::from_query(&q))?;
    // Its consumers on every node, as RabbitMQ lists them from any node
    // (each node knows its own clients' consumers).
    let path = format!("/api/consumers/{}", crate::fanout::segment(&vhost));
    let elsewhere = crate::fanout::gather(&s, &headers, &path, &HashMap::new()).await;
    if let Some(Value::Array(list)) = v.get_mut("consumer_details") {
        list.extend(
            elsewhere
                .into_iter()
                .filter(|c| c["queue"]["name"] == name.as_str()),
        );
    }
    // `?digest=true`: this node's copy's digest, to compare replicas, and
    // who holds its deliveries unacknowledged here (a Warren extension).
    // Asked for only: it reads every message held, under the broker's lock.
    if q.get("digest").is_some_and(|d| d == "true")
        && let Value::Object(o) = &mut v
    {
        let (digest, holders) = {
            let b = s.broker();
            (
                b.queue_digest(&vhost, &name),
                b.unacked_holders(&vhost, &name),
            )
        };
        o.insert(
            "local_digest".into(),
            digest.map_or(Value::Null, |d| json!(format!("{d:016x}"))),
        );
        // Who holds its deliveries unacknowledged on this node (clients'
        // channels, other nodes' consumers through their links).
        let holders: Map<String, Value> = holders.into_iter().map(|(k, n)| (k, json!(n))).collect();
        o.insert("local_unacked_holders".into(), Value::Object(holders));
    }
    Ok(ok(v))
}

async fn queue_put(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    let durable = v.get("durable").and_then(Value::as_bool).unwrap_or(true);
    let auto_delete = v
        .get("auto_delete")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let args = json_to_table(v.get("arguments").unwrap_or(&Value::Null));
    // As a client's declare: `amq.` names are the server's.
    if name.is_empty() || name.starts_with("amq.") {
        return Err(warren_broker::BrokerError::Invalid(format!(
            "queue name '{name}' is reserved or empty"
        ))
        .into());
    }
    s.changing(|b| {
        if !b.has_vhost(&vhost) {
            return Err(ApiError::not_found());
        }
        let existed = b.has_queue(&vhost, &name);
        b.admin_declare_queue(&vhost, &name, durable, auto_delete, args)?;
        Ok(created_or_updated(!existed))
    })
    .await
}

async fn queue_delete(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    s.changing(|b| {
        let info = b
            .queues(Some(&vhost))
            .into_iter()
            .find(|x| x.name == name)
            .ok_or_else(ApiError::not_found)?;
        if q.get("if-empty").is_some_and(|x| x == "true") && info.messages_ready > 0 {
            return Err(ApiError::bad_request(format!(
                "queue '{name}' in vhost '{vhost}' is not empty"
            )));
        }
        if q.get("if-unused").is_some_and(|x| x == "true") && info.consumers > 0 {
            return Err(ApiError::bad_request(format!(
                "queue '{name}' in vhost '{vhost}' in use"
            )));
        }
        b.admin_delete_queue(&vhost, &name);
        Ok(no_content())
    })
    .await
}

async fn queue_purge(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    let served_here = s
        .broker()
        .queues(Some(&vhost))
        .iter()
        .find(|x| x.name == name)
        .ok_or_else(ApiError::not_found)?
        .served_here;
    // Served by another node: its master purges (a mirror's copy cannot).
    if !served_here
        && let Some(master) = s.mirrors.mirrors(&vhost, &name).map(|m| m.node)
        && let Some(answer) =
            crate::fanout::forward(&s, &headers, "DELETE", &master, uri.path()).await
    {
        return Ok(answer);
    }
    s.broker().admin_purge_queue(&vhost, &name)?;
    Ok(no_content())
}

async fn queue_action(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    if !s.broker().has_queue(&vhost, &name) {
        return Err(ApiError::not_found());
    }
    let r = match v.get("action").and_then(Value::as_str) {
        Some("sync") => s.mirrors.sync(&vhost, &name),
        Some("cancel_sync") => s.mirrors.cancel_sync(&vhost, &name),
        Some(other) => return Err(ApiError::bad_request(format!("Unknown action '{other}'"))),
        None => return Err(ApiError::bad_request("[{key_missing,action}]")),
    };
    r.map_err(ApiError::bad_request)?;
    Ok(no_content())
}

// --------------------------------------------------- exchanges and bindings

fn exchange_json(x: &warren_broker::ExchangeInfo) -> Value {
    json!({
        "name": x.name,
        "vhost": x.vhost,
        "type": x.kind,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": x.arguments,
        "user_who_performed_action": "",
        "policy": Value::Null,
    })
}

/// An exchange's name as a path gives it (`amq.default` is the default
/// exchange, `""`).
pub(crate) fn exchange_name(name: String) -> String {
    if name == "amq.default" {
        String::new()
    } else {
        name
    }
}

fn exchanges_of(s: &Management, vhost: Option<&str>) -> ApiResult<Vec<Value>> {
    let b = s.broker();
    if let Some(v) = vhost
        && !b.has_vhost(v)
    {
        return Err(ApiError::not_found());
    }
    let defs = b.policies();
    let set = warren_broker::policy_set(&defs);
    Ok(b.exchanges(vhost)
        .iter()
        .map(|x| {
            let mut v = exchange_json(x);
            let eff = set.effective_for_exchange(&x.vhost, &x.name);
            if let Value::Object(o) = &mut v {
                o.insert("policy".into(), json!(eff.policy));
            }
            v
        })
        .collect())
}

async fn exchanges_all(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    Ok(ok(paged(u.only_visible(exchanges_of(&s, None)?), &q)))
}

async fn exchanges_vhost(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    Ok(ok(paged(
        u.only_visible(exchanges_of(&s, Some(&vhost))?),
        &q,
    )))
}

async fn exchange_get(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    let name = exchange_name(name);
    exchanges_of(&s, Some(&vhost))?
        .into_iter()
        .find(|x| x.get("name").and_then(Value::as_str) == Some(name.as_str()))
        .map(ok)
        .ok_or_else(ApiError::not_found)
}

async fn exchange_put(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    let kind = v
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("[{key_missing,type}]"))?
        .to_owned();
    let flag = |k: &str, d: bool| v.get(k).and_then(Value::as_bool).unwrap_or(d);
    s.changing(|b| {
        if !b.has_vhost(&vhost) {
            return Err(ApiError::not_found());
        }
        let existed = b.exchanges(Some(&vhost)).iter().any(|x| x.name == name);
        b.admin_declare_exchange(warren_broker::meta::ExchangeDef {
            vhost,
            name,
            kind,
            durable: flag("durable", true),
            auto_delete: flag("auto_delete", false),
            internal: flag("internal", false),
            arguments: json_to_table(v.get("arguments").unwrap_or(&Value::Null)),
        })?;
        Ok(created_or_updated(!existed))
    })
    .await
}

async fn exchange_delete(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    if s.changing(|b| Ok(b.admin_delete_exchange(&vhost, &name)?))
        .await?
    {
        Ok(no_content())
    } else {
        Err(ApiError::not_found())
    }
}

fn destination_type(kind: &str) -> ApiResult<&'static str> {
    match kind {
        "q" => Ok("queue"),
        "e" => Ok("exchange"),
        _ => Err(ApiError::not_found()),
    }
}

async fn bindings_between(
    State(s): State<Management>,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
) -> ApiResult<Response> {
    let dtype = destination_type(&kind)?;
    let b = s.broker();
    if !b.has_vhost(&vhost) {
        return Err(ApiError::not_found());
    }
    Ok(ok(Value::Array(
        b.bindings(Some(&vhost))
            .iter()
            .filter(|x| {
                x.source == source && x.destination == destination && x.destination_type == dtype
            })
            .map(binding_json)
            .collect(),
    )))
}

async fn binding_post(
    State(s): State<Management>,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let dtype = destination_type(&kind)?;
    let v = parse_body(&body)?;
    let routing_key = v
        .get("routing_key")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let def = warren_broker::meta::BindingDef {
        vhost: vhost.clone(),
        source: source.clone(),
        destination: destination.clone(),
        destination_is_exchange: dtype == "exchange",
        routing_key: routing_key.clone(),
        arguments: json_to_table(v.get("arguments").unwrap_or(&Value::Null)),
    };
    s.changing(|b| {
        if !b.has_vhost(&vhost) {
            return Err(ApiError::not_found());
        }
        Ok(b.admin_bind(def)?)
    })
    .await?;
    let props = if routing_key.is_empty() {
        "~".to_owned()
    } else {
        routing_key
    };
    let mut r = StatusCode::CREATED.into_response();
    if let Ok(loc) = HeaderValue::from_str(&props) {
        r.headers_mut().insert(header::LOCATION, loc);
    }
    Ok(r)
}

/// The binding between `source` and `destination` whose properties key
/// (its routing key, `~` for an empty one) is `props`.
fn find_binding(
    s: &Management,
    (vhost, source, kind, destination, props): (&str, &str, &str, &str, &str),
) -> ApiResult<warren_broker::BindingInfo> {
    let dtype = destination_type(kind)?;
    let b = s.broker();
    if !b.has_vhost(vhost) {
        return Err(ApiError::not_found());
    }
    b.bindings(Some(vhost))
        .into_iter()
        .find(|x| {
            x.source == source
                && x.destination == destination
                && x.destination_type == dtype
                && properties_key(x) == props
        })
        .ok_or_else(ApiError::not_found)
}

/// `GET /api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{props}`.
async fn binding_get(
    State(s): State<Management>,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult<Response> {
    let b = find_binding(&s, (&vhost, &source, &kind, &destination, &props))?;
    Ok(ok(binding_json(&b)))
}

/// `DELETE /api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{props}`:
/// unbinds, as `queue.unbind` or `exchange.unbind` would.
async fn binding_delete(
    State(s): State<Management>,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult<Response> {
    let found = find_binding(&s, (&vhost, &source, &kind, &destination, &props))?;
    let def = warren_broker::meta::BindingDef {
        vhost,
        source,
        destination,
        destination_is_exchange: found.destination_type == "exchange",
        routing_key: found.routing_key,
        arguments: json_to_table(&found.arguments),
    };
    if s.changing(|b| Ok(b.admin_unbind(&def)?)).await? {
        Ok(no_content())
    } else {
        Err(ApiError::not_found())
    }
}

/// A binding's properties key in the API's paths: its routing key, or `~`
/// for an empty one.
fn properties_key(b: &warren_broker::BindingInfo) -> String {
    if b.routing_key.is_empty() {
        "~".to_owned()
    } else {
        b.routing_key.clone()
    }
}

pub(crate) fn binding_json(b: &warren_broker::BindingInfo) -> Value {
    json!({
        "source": b.source,
        "vhost": b.vhost,
        "destination": b.destination,
        "destination_type": b.destination_type,
        "routing_key": b.routing_key,
        "arguments": b.arguments,
        "properties_key": properties_key(b),
    })
}

fn bindings_of(s: &Management, u: &AuthUser, vhost: Option<&str>) -> ApiResult<Response> {
    let b = s.broker();
    if let Some(v) = vhost
        && !b.has_vhost(v)
    {
        return Err(ApiError::not_found());
    }
    Ok(ok(Value::Array(u.only_visible(
        b.bindings(vhost).iter().map(binding_json).collect(),
    ))))
}

/// `GET /api/exchanges/{vhost}/{name}/bindings/source` (bindings from the
/// exchange) and `…/destination` (bindings to it).
async fn exchange_bindings(
    State(s): State<Management>,
    Path((vhost, name, side)): Path<(String, String, String)>,
) -> ApiResult<Response> {
    let name = exchange_name(name);
    let b = s.broker();
    if !b.exchanges(Some(&vhost)).iter().any(|x| x.name == name) {
        return Err(ApiError::not_found());
    }
    let to = match side.as_str() {
        "source" => false,
        "destination" => true,
        _ => return Err(ApiError::not_found()),
    };
    let keep = |x: &warren_broker::BindingInfo| {
        if to {
            x.destination_type == "exchange" && x.destination == name
        } else {
            x.source == name
        }
    };
    Ok(ok(Value::Array(
        b.bindings(Some(&vhost))
            .iter()
            .filter(|x| keep(x))
            .map(binding_json)
            .collect(),
    )))
}

/// `GET /api/queues/{vhost}/{name}/bindings`: the bindings to the queue,
/// the default exchange's first. For a queue that does not exist RabbitMQ
/// 3.10 lists the default exchange's binding all the same; so does this.
async fn queue_bindings(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    let b = s.broker();
    if !b.has_vhost(&vhost) {
        return Err(ApiError::not_found());
    }
    let mut list: Vec<Value> = b
        .bindings(Some(&vhost))
        .iter()
        .filter(|x| x.destination_type == "queue" && x.destination == name)
        .map(binding_json)
        .collect();
    if list.is_empty() {
        list.push(binding_json(&warren_broker::BindingInfo {
            vhost: vhost.clone(),
            source: String::new(),
            destination: name.clone(),
            destination_type: "queue",
            routing_key: name,
            arguments: Value::Object(Map::new()),
        }));
    }
    Ok(ok(Value::Array(list)))
}

async fn bindings_all(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
) -> ApiResult<Response> {
    bindings_of(&s, &u, None)
}

async fn bindings_vhost(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(vhost): Path<String>,
) -> ApiResult<Response> {
    bindings_of(&s, &u, Some(&vhost))
}

// ------------------------------------------------------------------ health

/// `/api/health/checks/alarms`: 503 while any node of the cluster has a
/// resource alarm, as RabbitMQ answers.
async fn alarms_cluster(State(s): State<Management>) -> Response {
    let alarms = s.broker().alarms_in_force();
    alarms_response(alarms, "There are alarms in effect in the cluster")
}

/// `/api/health/checks/local-alarms`: 503 while this node has one.
async fn alarms_local(State(s): State<Management>) -> Response {
    let local = s.broker().local_alarms();
    let alarms = vec![(s.node.clone(), local)];
    alarms_response(alarms, "There are alarms in effect on the node")
}

fn alarms_response(alarms: Vec<(String, warren_broker::AlarmSet)>, reason: &str) -> Response {
    let list: Vec<Value> = alarms
        .iter()
        .flat_map(|(node, a)| {
            let mem = a
                .memory
                .then(|| json!({"node": node, "resource": "memory"}));
            let disk = a.disk.then(|| json!({"node": node, "resource": "disk"}));
            mem.into_iter().chain(disk)
        })
        .collect();
    if list.is_empty() {
        return ok(json!({"status": "ok"}));
    }
    let body = json!({"status": "failed", "reason": reason, "alarms": list});
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// `GET /api/healthchecks/node` (RabbitMQ 3.10's older check, still
/// served): `{"status": "ok"}` while this node runs without a resource
/// alarm, else `{"status": "failed", "reason"}`, both with 200.
async fn healthcheck_node(State(s): State<Management>) -> Response {
    healthcheck(&s)
}

/// `GET /api/healthchecks/node/{node}`: the same for this node, by name.
async fn healthcheck_named(
    State(s): State<Management>,
    Path(node): Path<String>,
) -> ApiResult<Response> {
    if node != s.node {
        return Err(ApiError::not_found());
    }
    Ok(healthcheck(&s))
}

fn healthcheck(s: &Management) -> Response {
    let local = s.broker().local_alarms();
    if local.memory || local.disk {
        let which = if local.memory { "memory" } else { "disk" };
        return ok(
            json!({"status": "failed", "reason": format!("resource alarm in effect: {which}")}),
        );
    }
    ok(json!({"status": "ok"}))
}

/// Lists of what Warren does not have (runtime parameters such as
/// federation upstreams, vhost limits): empty, as on a RabbitMQ without
/// any, so tools that list them (rabbitmqadmin) work.
async fn none_yet() -> Response {
    ok(Value::Array(Vec::new()))
}

async fn health_ok() -> Response {
    ok(json!({"status": "ok"}))
}

async fn mirror_sync_critical(State(s): State<Management>) -> ApiResult<Response> {
    let queues = all_queues_json(&s, None, &Ranges::default())?;
    let critical: Vec<Value> = queues
        .into_iter()
        .filter(|q| {
            let mirrored = q
                .get("effective_policy_definition")
                .and_then(|d| d.get("ha-mode"))
                .is_some()
                && !q.get("exclusive").and_then(Value::as_bool).unwrap_or(false);
            let local = q.get("node").and_then(Value::as_str) == Some(s.node.as_str());
            let synced = q
                .get("synchronised_slave_nodes")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty());
            mirrored && local && !synced
        })
        .map(|q| json!({"name": q["name"], "vhost": q["vhost"]}))
        .collect();
    if critical.is_empty() {
        return Ok(ok(json!({"status": "ok"})));
    }
    let body = json!({
        "status": "failed",
        "reason": "There are classic mirrored queues without online synchronised mirrors present in the cluster: stopping this node may lose their messages",
        "queues": critical,
    });
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response())
}
