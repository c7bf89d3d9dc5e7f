//! Every node's clients through any node, as RabbitMQ's management API
//! shows them: the lists (`/api/connections`, `/api/channels`,
//! `/api/consumers`) add what the other running members list of their own
//! clients, and a request about one client (its name ends with its node)
//! is sent on to that client's node. The other nodes are asked over their
//! management listeners with the caller's credentials, so each applies its
//! own access rules.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use serde_json::Value;

use crate::Management;

/// Marks a request from another node: answer with this node's clients only.
const LOCAL_ONLY: &str = "x-warren-local-only";
/// How long another node may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// Query keys of the merged list (applied once, after merging).
const LIST_KEYS: [&str; 4] = ["page", "page_size", "name", "use_regex"];

/// The node in a connection's or channel's name (`PEER -> NODE`,
/// `PEER -> NODE (N)`).
pub(crate) fn node_of(name: &str) -> Option<&str> {
    let (_, rest) = name.split_once(" -> ")?;
    rest.split(" (").next()
}

/// What the other running nodes list at `path` with the query `q` (but the
/// list keys: paging and filtering apply to the merged list), concatenated;
/// nothing when the request itself came from another node. A node that
/// does not answer in time is left out (logged at debug level).
pub(crate) async fn gather(
    s: &Management,
    headers: &HeaderMap,
    path: &str,
    q: &HashMap<String, String>,
) -> Vec<Value> {
    answers(s, headers, path, q)
        .await
        .into_iter()
        .flat_map(|v| match v {
            Value::Array(items) => items,
            _ => Vec::new(),
        })
        .collect()
}

/// Each other running node's answer to `GET path` with the query `q` (but
/// the list keys), in node order (see [`gather`]).
pub(crate) async fn answers(
    s: &Management,
    headers: &HeaderMap,
    path: &str,
    q: &HashMap<String, String>,
) -> Vec<Value> {
    let query: Vec<String> = q
        .iter()
        .filter(|(k, _)| !LIST_KEYS.contains(&k.as_str()))
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect();
    let path = if query.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", query.join("&"))
    };
    ask_each(s, headers, None, |_| path.clone())
        .await
        .into_values()
        .collect()
}

/// Sends this request (`method` on `path`, about a client of `node`) on to
/// `node` and returns its answer; `None` when `node` is this one, or not a
/// running member (the caller answers then, with 404 if it has no such
/// client).
pub(crate) async fn forward(
    s: &Management,
    headers: &HeaderMap,
    method: &'static str,
    node: &str,
    path: &str,
) -> Option<Response> {
    if node == s.node || headers.contains_key(LOCAL_ONLY) {
        return None;
    }
    let (_, addr) = others(s).into_iter().find(|(n, _)| n == node)?;
    let auth = authorization(headers);
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let path = path.to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        ask(method, &addr, &path, auth.as_deref(), reason.as_deref())
    })
    .await
    .ok()?;
    let (status, body) = match answer {
        Ok(a) => a,
        Err(e) => (
            502,
            serde_json::json!({"error": "bad_gateway", "reason": format!("{node} did not answer: {e}")})
                .to_string(),
        ),
    };
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .ok()
}

/// Each other running member (of `nodes`, or all) asked for its own answer
/// to `GET path_of(node)`, with the caller's credentials: by node, what it
/// said; nothing when the request itself came from another node. A member
/// that does not answer in time is left out (logged at debug level).
pub(crate) async fn ask_each(
    s: &Management,
    headers: &HeaderMap,
    nodes: Option<&[String]>,
    path_of: impl Fn(&str) -> String,
) -> BTreeMap<String, Value> {
    if headers.contains_key(LOCAL_ONLY) {
        return BTreeMap::new();
    }
    let targets: Vec<(String, String, String)> = others(s)
        .into_iter()
        .filter(|(n, _)| nodes.is_none_or(|nodes| nodes.contains(n)))
        .map(|(n, addr)| {
            let path = path_of(&n);
            (n, addr, path)
        })
        .collect();
    if targets.is_empty() {
        return BTreeMap::new();
    }
    let auth = authorization(headers);
    tokio::task::spawn_blocking(move || {
        targets
            .into_iter()
            .filter_map(|(node, addr, path)| {
                match ask("GET", &addr, &path, auth.as_deref(), None) {
                    Ok((200, body)) => Some((node, serde_json::from_str(&body).ok()?)),
                    Ok((status, _)) => {
                        tracing::debug!(%node, status, %path, "another node refused a request");
                        None
                    }
                    Err(e) => {
                        tracing::debug!(%node, error = %e, %path, "could not ask another node");
                        None
                    }
                }
            })
            .collect()
    })
    .await
    .unwrap_or_default()
}

/// Percent-encodes a path segment (a node name: `@` stays readable).
pub(crate) fn segment(s: &str) -> String {
    encode(s).replace("%40", "@")
}

/// The other running members and the address of their management
/// listener, as they recorded it (an unspecified IP replaced with the host
/// of their peer address).
fn others(s: &Management) -> Vec<(String, String)> {
    s.running_others()
        .into_iter()
        .filter_map(|m| {
            let (_, http) = m.listeners.iter().find(|(p, _)| p == "http")?;
            let a: SocketAddr = http.parse().ok()?;
            let addr = if a.ip().is_unspecified() {
                let (host, _) = m.addr.rsplit_once(':')?;
                format!("{host}:{}", a.port())
            } else {
                a.to_string()
            };
            Some((m.name, addr))
        })
        .collect()
}

fn authorization(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// One blocking request to the management listener at `addr`: its status
/// and body.
fn ask(
    method: &str,
    addr: &str,
    path: &str,
    auth: Option<&str>,
    reason: Option<&str>,
) -> Result<(u16, String), String> {
    let agent = ureq::AgentBuilder::new().timeout(ASK_TIMEOUT).build();
    let mut req = agent
        .request(method, &format!("http://{addr}{path}"))
        .set(LOCAL_ONLY, "1");
    if let Some(a) = auth {
        req = req.set("authorization", a);
    }
    if let Some(r) = reason {
        req = req.set("x-reason", r);
    }
    let resp = match req.call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Err(e.to_string()),
    };
    let status = resp.status();
    let body = resp.into_string().map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// Percent-encodes a query key or value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_their_node() {
        assert_eq!(node_of("127.0.0.1:5000 -> warren@b"), Some("warren@b"));
        assert_eq!(node_of("127.0.0.1:5000 -> warren@b (3)"), Some("warren@b"));
        assert_eq!(node_of("no arrow"), None);
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }
}
