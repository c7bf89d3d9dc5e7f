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
