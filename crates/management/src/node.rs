//! The node's application through the API: `POST /api/nodes/{name}/stop`
//! (`warrenctl stop`), `/stop_app` and `/start_app`, served by whatever
//! implements [`NodeControl`]. RabbitMQ has no HTTP endpoints for these;
//! they are Warren's.

use std::fmt;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};

use crate::Management;
use crate::api::ApiError;
use crate::cluster::ClusterFuture;

/// The node's lifecycle, as `warrenctl stop`, `stop_app` and `start_app`
/// drive it.
pub trait NodeControl: Send + Sync + fmt::Debug {
    /// Stops the node as SIGTERM does; resolves once the shutdown has begun.
    fn stop(&self) -> ClusterFuture;
    /// Closes every client connection (320 CONNECTION_FORCED) and stops
    /// accepting new ones; the node and this API keep running.
    fn stop_app(&self) -> ClusterFuture;
    /// Accepts client connections again.
    fn start_app(&self) -> ClusterFuture;
    /// Whether client connections are accepted.
    fn app_running(&self) -> bool;
    /// Client sockets held, and how many the node may hold (`None`:
    /// unlimited): RabbitMQ's `sockets_used` and `sockets_total`. `None`
    /// where the node keeps no such count.
    fn client_sockets(&self) -> Option<(u64, Option<u64>)> {
        None
    }
}

async fn act(
    s: &Management,
    name: &str,
    verb: fn(&dyn NodeControl) -> ClusterFuture,
) -> Result<Response, ApiError> {
    if name != s.node {
        return Err(ApiError::not_found());
    }
    let Some(c) = s.node_control.clone() else {
        return Err(ApiError::bad_request(
            "this node does not take stop, stop_app or start_app over the API",
        ));
    };
    verb(c.as_ref()).await.map_err(ApiError::bad_request)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /api/nodes/{name}/stop`.
pub(crate) async fn stop(
    State(s): State<Management>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    act(&s, &name, |c| c.stop()).await
}

/// `POST /api/nodes/{name}/stop_app`.
pub(crate) async fn stop_app(
    State(s): State<Management>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    act(&s, &name, |c| c.stop_app()).await
}

/// `POST /api/nodes/{name}/start_app`.
pub(crate) async fn start_app(
    State(s): State<Management>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    act(&s, &name, |c| c.start_app()).await
}

/// Reads a size given as a JSON number of bytes or a string such as "2GB".
fn size(v: &serde_json::Value) -> Result<u64, ApiError> {
    match v {
        serde_json::Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| ApiError::bad_request(format!("{n} is not a size in bytes"))),
        serde_json::Value::String(t) => warren_broker::parse_size(t).map_err(ApiError::bad_request),
        other => Err(ApiError::bad_request(format!("{other} is not a size"))),
    }
}

/// Reads a non-negative fraction.
fn fraction(v: &serde_json::Value) -> Result<f64, ApiError> {
    v.as_f64()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| ApiError::bad_request(format!("{v} is not a non-negative number")))
}

/// How one resource limit is read from a request body and set.
struct LimitForm<T> {
    /// The key of the relative form (read by [`fraction`]).
    relative: &'static str,
    /// Makes the limit from a fraction.
    from_fraction: fn(f64) -> T,
    /// Makes the limit from a size (key `absolute`, read by [`size`]).
    from_size: fn(u64) -> T,
    /// Hands it to the broker.
    set: fn(&mut warren_broker::Broker, T),
    /// The error for a body with neither or both keys.
    usage: &'static str,
}

/// Sets one resource limit on this node from `body` (exactly one of the
/// relative key and `absolute`).
fn set_limit<T>(
    s: &Management,
    name: &str,
    body: &serde_json::Value,
    form: &LimitForm<T>,
) -> Result<Response, ApiError> {
    if name != s.node {
        return Err(ApiError::not_found());
    }
    let limit = match (body.get(form.relative), body.get("absolute")) {
        (Some(r), None) => (form.from_fraction)(fraction(r)?),
        (None, Some(a)) => (form.from_size)(size(a)?),
        _ => return Err(ApiError::bad_request(form.usage)),
    };
    (form.set)(&mut s.broker(), limit);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `PUT /api/nodes/{name}/memory_high_watermark` with `{"relative": 0.4}`
/// or `{"absolute": "2GB"}` (`warrenctl set_vm_memory_high_watermark`).
pub(crate) async fn set_memory_limit(
    State(s): State<Management>,
    Path(name): Path<String>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> Result<Response, ApiError> {
    use warren_broker::{Broker, MemoryLimit};
    let form = LimitForm {
        relative: "relative",
        from_fraction: MemoryLimit::Relative,
        from_size: MemoryLimit::Absolute,
        set: Broker::set_memory_limit,
        usage: "give exactly one of \"relative\" (a fraction of the machine's memory) or \"absolute\" (a size)",
    };
    set_limit(&s, &name, &body, &form)
}

/// `PUT /api/nodes/{name}/disk_free_limit` with `{"absolute": "50MB"}` or
/// `{"mem_relative": 1.5}` (`warrenctl set_disk_free_limit`).
pub(crate) async fn set_disk_limit(
    State(s): State<Management>,
    Path(name): Path<String>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> Result<Response, ApiError> {
    use warren_broker::{Broker, DiskLimit};
    let form = LimitForm {
        relative: "mem_relative",
        from_fraction: DiskLimit::Relative,
        from_size: DiskLimit::Absolute,
        set: Broker::set_disk_limit,
        usage: "give exactly one of \"absolute\" (a size) or \"mem_relative\" (a multiple of the machine's memory)",
    };
    set_limit(&s, &name, &body, &form)
}
