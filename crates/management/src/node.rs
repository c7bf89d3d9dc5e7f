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

/// Reads a body holding exactly one of `relative` (read by [`fraction`])
/// and `absolute` (read by [`size`]).
fn one_of<T>(
    body: &serde_json::Value,
    (relative, absolute): (&str, &str),
    make_relative: fn(f64) -> T,
    make_absolute: fn(u64) -> T,
    usage: &str,
) -> Result<T, ApiError> {
    match (body.get(relative), body.get(absolute)) {
        (Some(r), None) => Ok(make_relative(fraction(r)?)),
        (None, Some(a)) => Ok(make_absolute(size(a)?)),
        _ => Err(ApiError::bad_request(usage)),
    }
}

/// `PUT /api/nodes/{name}/memory_high_watermark` with `{"relative": 0.4}`
/// or `{"absolute": "2GB"}` (`warrenctl set_vm_memory_high_watermark`).
pub(crate) async fn set_memory_limit(
    State(s): State<Management>,
    Path(name): Path<String>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> Result<Response, ApiError> {
    if name != s.node {
        return Err(ApiError::not_found());
    }
    use warren_broker::MemoryLimit;
    let limit = one_of(
        &body,
        ("relative", "absolute"),
        MemoryLimit::Relative,
        MemoryLimit::Absolute,
        "give exactly one of \"relative\" (a fraction of the machine's memory) or \"absolute\" (a size)",
    )?;
    s.broker().set_memory_limit(limit);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `PUT /api/nodes/{name}/disk_free_limit` with `{"absolute": "50MB"}` or
/// `{"mem_relative": 1.5}` (`warrenctl set_disk_free_limit`).
pub(crate) async fn set_disk_limit(
    State(s): State<Management>,
    Path(name): Path<String>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> Result<Response, ApiError> {
    if name != s.node {
        return Err(ApiError::not_found());
    }
    use warren_broker::DiskLimit;
    let limit = one_of(
        &body,
        ("mem_relative", "absolute"),
        DiskLimit::Relative,
        DiskLimit::Absolute,
        "give exactly one of \"absolute\" (a size) or \"mem_relative\" (a multiple of the machine's memory)",
    )?;
    s.broker().set_disk_limit(limit);
    Ok(StatusCode::NO_CONTENT.into_response())
}
