//! The clients: `/api/connections`, `/api/channels` and
//! `/api/consumers`, with RabbitMQ's names (`PEER -> NODE` for a
//! connection, `PEER -> NODE (N)` for its channel `N`) and rates: a
//! connection's octets (`recv_oct`, `send_oct`), a channel's
//! `message_stats`. Monitors see every client, other users their own.
//! Lists hold every running node's clients; a request about one client
//! goes to its node (`fanout`).

use std::collections::HashMap;

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse as _, Response};
use serde_json::{Value, json};
use warren_broker::{ChannelInfo, ConnectionInfo, ConsumerInfo};

use crate::access::AuthUser;
use crate::api::{ApiError, ApiResult, ok, paged};
use crate::rates::{self, Ranges, Rates};
use crate::{Management, fanout};

fn connection_name(c: &ConnectionInfo, node: &str) -> String {
    format!("{} -> {node}", c.peer)
}

fn channel_name(conn_name: &str, number: u16) -> String {
    format!("{conn_name} ({number})")
}

fn connection_json(node: &str, c: &ConnectionInfo, (r, ranges): (&Rates, &Ranges)) -> Value {
    let mut v = json!({
        "name": connection_name(c, node),
        "node": node,
        "user": c.user,
        "vhost": c.vhost,
        "peer_host": c.peer.ip().to_string(),
        "peer_port": c.peer.port(),
        "state": "running",
        "channels": c.channels,
        "protocol": "AMQP 0-9-1",
        "ssl": c.tls.is_some(),
        "ssl_protocol": c.tls,
        "auth_mechanism": c.auth_mechanism,
        "client_properties": c.client_properties,
        "type": "network",
    });
    if let Value::Object(o) = &mut v {
        let values = rates::connection_values(c);
        o.extend(r.counters(r.connection(c.id), rates::CONNECTION, &values, ranges));
    }
    v
}

/// A channel of connection `conn`, as `/api/channels` shows it.
fn channel_json(
    node: &str,
    ch: &ChannelInfo,
    conn: &ConnectionInfo,
    (r, ranges): (&Rates, &Ranges),
) -> Value {
    let conn_name = connection_name(conn, node);
    let values = rates::message_values(&ch.counters);
    let stats = r.counters(
        r.channel(ch.conn, ch.number),
        rates::CHANNEL,
        &values,
        ranges,
    );
    json!({
        "name": channel_name(&conn_name, ch.number),
        "number": ch.number,
        "node": node,
        "user": conn.user,
        "vhost": conn.vhost,
        "connection_details": {
            "name": conn_name,
            "peer_host": conn.peer.ip().to_string(),
            "peer_port": conn.peer.port(),
        },
        "state": "running",
        "prefetch_count": ch.prefetch,
        "global_prefetch_count": ch.global_prefetch,
        "confirm": ch.confirm,
        "transactional": ch.transactional,
        "consumer_count": ch.consumers,
        "messages_unacknowledged": ch.unacked,
        "messages_unconfirmed": ch.unconfirmed,
        "message_stats": stats,
    })
}

/// `GET /api/connections`: every running node's.
pub(crate) async fn connections(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let mut list: Vec<Value> = {
        let cs = s.connections();
        let (r, ranges) = (s.rates(), Ranges::from_query(&q));
        cs.iter()
            .filter(|c| u.sees_owner(&c.user))
            .map(|c| connection_json(&s.node, c, (&r, &ranges)))
            .collect()
    };
    list.extend(fanout::gather(&s, &headers, uri.path(), &q).await);
    ok(paged(list, &q))
}

/// The connection of this node named `name`, if the user may see it.
fn find_connection(s: &Management, u: &AuthUser, name: &str) -> ApiResult<ConnectionInfo> {
    let c = s
        .connections()
        .into_iter()
        .find(|c| connection_name(c, &s.node) == name)
        .ok_or_else(ApiError::not_found)?;
    if !u.sees_owner(&c.user) {
        return Err(ApiError::unauthorized(
            "User not authorised to access object",
        ));
    }
    Ok(c)
}

/// `GET /api/connections/{name}` (asked of its node).
pub(crate) async fn connection_get(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    if let Some(r) = elsewhere(&s, &headers, "GET", &name, &uri).await {
        return Ok(r);
    }
    let c = find_connection(&s, &u, &name)?;
    let ranges = Ranges::from_query(&q);
    Ok(ok(connection_json(&s.node, &c, (&s.rates(), &ranges))))
}

/// `DELETE /api/connections/{name}`: the client gets connection.close 320
/// CONNECTION_FORCED with the `X-Reason` header's text (RabbitMQ's default
/// when there is none).
pub(crate) async fn connection_close(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(name): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    if let Some(r) = elsewhere(&s, &headers, "DELETE", &name, &uri).await {
        return Ok(r);
    }
    let c = find_connection(&s, &u, &name)?;
    if !u.may_close(&c.user) {
        return Err(ApiError::unauthorized(
            "User not authorised to access object",
        ));
    }
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin");
    if !s.close_connection(c.id, reason) {
        return Err(ApiError::not_found());
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The channels (of connection `only`, or of all), each with its
/// connection.
fn channels_with_conns(s: &Management, only: Option<u64>) -> Vec<(ChannelInfo, ConnectionInfo)> {
    let (conns, channels) = s.conns_and_channels();
    channels
        .into_iter()
        .filter(|ch| only.is_none_or(|id| ch.conn == id))
        .filter_map(|ch| {
            let conn = conns.iter().find(|c| c.id == ch.conn)?.clone();
            Some((ch, conn))
        })
        .collect()
}

/// The channels (of connection `only`, or of all) that `u` sees.
fn visible_channels(
    s: &Management,
    u: &AuthUser,
    only: Option<u64>,
) -> Vec<(ChannelInfo, ConnectionInfo)> {
    let mut chs = channels_with_conns(s, only);
    chs.retain(|(_, conn)| u.sees_owner(&conn.user));
    chs
}

/// `channels` as JSON.
fn channels_json(
    s: &Management,
    channels: &[(ChannelInfo, ConnectionInfo)],
    ranges: &Ranges,
) -> Vec<Value> {
    let r = s.rates();
    channels
        .iter()
        .map(|(ch, conn)| channel_json(&s.node, ch, conn, (&r, ranges)))
        .collect()
}

/// `GET /api/channels`: every running node's.
pub(crate) async fn channels(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let chs = visible_channels(&s, &u, None);
    let mut list = channels_json(&s, &chs, &Ranges::from_query(&q));
    list.extend(fanout::gather(&s, &headers, uri.path(), &q).await);
    ok(paged(list, &q))
}

/// `GET /api/connections/{name}/channels` (asked of its node).
pub(crate) async fn connection_channels(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    if let Some(r) = elsewhere(&s, &headers, "GET", &name, &uri).await {
        return Ok(r);
    }
    let c = find_connection(&s, &u, &name)?;
    let chs = visible_channels(&s, &u, Some(c.id));
    Ok(ok(paged(
        channels_json(&s, &chs, &Ranges::from_query(&q)),
        &q,
    )))
}

/// `GET /api/channels/{name}`, with the channel's `consumer_details`
/// (asked of its node).
pub(crate) async fn channel_get(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    if let Some(r) = elsewhere(&s, &headers, "GET", &name, &uri).await {
        return Ok(r);
    }
    let found = channels_with_conns(&s, None)
        .into_iter()
        .find(|(ch, conn)| channel_name(&connection_name(conn, &s.node), ch.number) == name)
        .ok_or_else(ApiError::not_found)?;
    if !u.sees_owner(&found.1.user) {
        return Err(ApiError::unauthorized(
            "User not authorised to access object",
        ));
    }
    let (conns, consumers) = s.conns_and_consumers(None);
    let details: Vec<Value> = consumers
        .iter()
        .filter(|c| c.conn == found.0.conn && c.channel == found.0.number)
        .map(|c| consumer_json(&s.node, c, &conns))
        .collect();
    let mut v = channels_json(&s, &[found], &Ranges::from_query(&q)).remove(0);
    if let Value::Object(o) = &mut v {
        o.insert("consumer_details".into(), Value::Array(details));
    }
    Ok(ok(v))
}

/// A consumer as `/api/consumers` and a queue's or channel's
/// `consumer_details` show it.
pub(crate) fn consumer_json(node: &str, c: &ConsumerInfo, conns: &[ConnectionInfo]) -> Value {
    let conn = conns.iter().find(|x| x.id == c.conn);
    let conn_name = conn.map_or_else(String::new, |x| connection_name(x, node));
    json!({
        "queue": {"name": c.queue, "vhost": c.vhost},
        "consumer_tag": c.tag,
        "channel_details": {
            "name": channel_name(&conn_name, c.channel),
            "number": c.channel,
            "connection_name": conn_name,
            "node": node,
            "peer_host": conn.map(|x| x.peer.ip().to_string()),
            "peer_port": conn.map(|x| x.peer.port()),
            "user": conn.map(|x| x.user.clone()),
        },
        "ack_required": c.ack_required,
        "exclusive": c.exclusive,
        "prefetch_count": c.prefetch,
        "active": c.active,
        // RabbitMQ's names; unknown where the queue's master decides.
        "activity_status": match (c.single_active, c.active) {
            (false, _) => "up",
            (true, Some(true)) => "single_active",
            (true, Some(false)) => "waiting",
            (true, None) => "unknown",
        },
        "arguments": if c.priority == 0 { json!({}) } else { json!({"x-priority": c.priority}) },
    })
}

/// The consumers (of `vhost`, or of all) that `u` sees: monitors every
/// one, other users those on their own connections; every running node's.
async fn consumers_of(
    s: &Management,
    u: &AuthUser,
    vhost: Option<&str>,
    headers: &HeaderMap,
    uri: &Uri,
) -> ApiResult<Response> {
    let mut list = local_consumers(s, u, vhost)?;
    list.extend(fanout::gather(s, headers, uri.path(), &HashMap::new()).await);
    Ok(ok(Value::Array(list)))
}

/// This node's consumers (of `vhost`, or of all) that `u` sees.
fn local_consumers(s: &Management, u: &AuthUser, vhost: Option<&str>) -> ApiResult<Vec<Value>> {
    if let Some(v) = vhost
        && !s.broker().has_vhost(v)
    {
        return Err(ApiError::not_found());
    }
    let (conns, consumers) = s.conns_and_consumers(vhost);
    let owner = |c: &ConsumerInfo| {
        conns
            .iter()
            .find(|x| x.id == c.conn)
            .map_or("", |x| x.user.as_str())
    };
    Ok(consumers
        .iter()
        .filter(|c| u.sees_owner(owner(c)))
        .map(|c| consumer_json(&s.node, c, &conns))
        .collect())
}

/// `GET /api/consumers`.
pub(crate) async fn consumers_all(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    consumers_of(&s, &u, None, &headers, &uri).await
}

/// `GET /api/consumers/{vhost}`.
pub(crate) async fn consumers_vhost(
    State(s): State<Management>,
    Extension(u): Extension<AuthUser>,
    Path(vhost): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    consumers_of(&s, &u, Some(&vhost), &headers, &uri).await
}

/// The answer of the node whose client `name` names, if another one.
async fn elsewhere(
    s: &Management,
    headers: &HeaderMap,
    method: &'static str,
    name: &str,
    uri: &Uri,
) -> Option<Response> {
    let node = fanout::node_of(name)?;
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    fanout::forward(s, headers, method, node, path).await
}
