//! The API's message operations, as RabbitMQ's management plugin has them
//! (for testing and for operators, not for throughput): publish to an
//! exchange, get from a queue, and the aliveness test. Each runs a
//! [`Direct`] connection as the HTTP request's user.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};

use crate::Management;
use crate::access::basic_credentials;
use crate::api::{ApiError, ApiResult, exchange_name, ok, parse_body};
use crate::direct::{Direct, GetRequest, got_json, payload_from_json, properties_from_json};

/// The queue and message of the aliveness test, RabbitMQ's names.
const ALIVENESS_QUEUE: &str = "aliveness-test";
const ALIVENESS_MESSAGE: &[u8] = b"test_message";

/// A connection as the request's user (the auth layer checked the
/// credentials already).
async fn direct(s: &Management, headers: &HeaderMap, vhost: &str) -> ApiResult<Direct> {
    let (user, pass) =
        basic_credentials(headers).ok_or_else(|| ApiError::unauthorized("Not_Authorized"))?;
    Direct::open(s, &user, &pass, vhost).await
}

/// `POST /api/exchanges/{vhost}/{name}/publish`: `{"routing_key", "payload",
/// "payload_encoding", "properties"}`, answered `{"routed": bool}`; the
/// broker's refusal (a missing exchange, no write permission) is a 400
/// with its reply code and text, as RabbitMQ answers.
pub(crate) async fn publish(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    let exchange = exchange_name(name);
    if !s.broker().has_vhost(&vhost) {
        return Err(ApiError::not_found());
    }
    let routing_key = v
        .get("routing_key")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("[{key_missing,routing_key}]"))?;
    let payload = payload_from_json(&v)?;
    let props = properties_from_json(v.get("properties").unwrap_or(&Value::Null))?;
    let mut d = direct(&s, &headers, &vhost).await?;
    let routed = d.publish(&exchange, routing_key, props, &payload).await?;
    d.close().await;
    Ok(ok(json!({ "routed": routed })))
}

/// `POST /api/queues/{vhost}/{name}/get`: `{"count", "ackmode",
/// "encoding", "truncate"}`, answered with the messages got.
pub(crate) async fn get(
    State(s): State<Management>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let req = GetRequest::parse(&body)?;
    if !s.broker().has_queue(&vhost, &name) {
        return Err(ApiError::not_found());
    }
    let mut d = direct(&s, &headers, &vhost).await?;
    let mut got = Vec::new();
    while got.len() < req.count {
        match d.get(&name).await? {
            Some(g) => got.push(g),
            None => break,
        }
    }
    // All are held until the last is got, so a requeue does not give the
    // same message twice.
    d.settle(&got, req.ack, req.requeue);
    d.close().await;
    Ok(ok(Value::Array(
        got.iter()
            .map(|g| got_json(g, req.base64, req.truncate))
            .collect(),
    )))
}

/// `GET /api/aliveness-test/{vhost}`: declares the queue `aliveness-test`,
/// publishes `test_message` to it and gets it back, as RabbitMQ does.
pub(crate) async fn aliveness(
    State(s): State<Management>,
    Path(vhost): Path<String>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    if !s.broker().has_vhost(&vhost) {
        return Err(ApiError::not_found());
    }
    let mut d = direct(&s, &headers, &vhost).await?;
    d.declare(ALIVENESS_QUEUE).await?;
    let props = properties_from_json(&Value::Null)?;
    d.publish("", ALIVENESS_QUEUE, props, ALIVENESS_MESSAGE)
        .await?;
    let got = d.get(ALIVENESS_QUEUE).await?;
    let alive = got.as_ref().is_some_and(|g| g.body() == ALIVENESS_MESSAGE);
    if let Some(g) = got {
        d.settle(&[g], true, false);
    }
    d.close().await;
    if alive {
        Ok(ok(json!({"status": "ok"})))
    } else {
        Ok(ok(
            json!({"status": "failed", "reason": "the test message did not come back"}),
        ))
    }
}
