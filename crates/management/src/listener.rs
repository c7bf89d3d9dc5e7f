//! The HTTP listeners' connections (the management API and `/metrics`):
//! hyper's HTTP/1 with a header timeout, which `axum::serve` does not set,
//! and a cap on connections at once.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How long a client has to send a request's headers, and how long a
/// kept-alive connection may wait for its next request, before it is
/// closed (hyper's header timeout counts both): RabbitMQ 3.10 closes an
/// idle kept-alive connection after 60 s, and a client that pools its
/// connections (Python's requests) and calls every few seconds would
/// otherwise meet a connection closed under its request. A client that
/// sends its headers a byte at a time, or nothing at all, holds its
/// connection no longer than that.
pub const HTTP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections served at once per listener; more wait in the listen
/// backlog until one ends (as ranch's `max_connections` for RabbitMQ's
/// listeners), so HTTP clients cannot take every descriptor of the node.
pub(crate) const MAX_CONNECTIONS: usize = 1024;

/// Serves `router` on `listener` until the task is dropped, closing a
/// connection that sends no whole request's headers within `idle`.
/// Handlers see the client's address as `ConnectInfo<SocketAddr>`.
pub(crate) async fn serve_router(
    listener: TcpListener,
    router: Router,
    idle: Duration,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return Ok(());
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, most likely: let some go first.
                tracing::debug!(error = %e, "HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone().layer(Extension(ConnectInfo(peer))));
        tokio::spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(idle);
            if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended");
            }
            drop(slot);
        });
    }
}
