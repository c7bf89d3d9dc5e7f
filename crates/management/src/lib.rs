//! Warren's management HTTP API: RabbitMQ's `/api` as an axum router.
//!
//! [`router`] serves the endpoints RabbitMQ's tools and dashboards use most
//! (`/api/overview`, `/api/nodes`, `/api/vhosts`, `/api/users`,
//! `/api/permissions`, `/api/policies`, `/api/operator-policies`,
//! `/api/queues` with the mirror fields, `/api/exchanges`, `/api/bindings`,
//! `/api/connections`, `/api/channels`, `/api/consumers`,
//! `/api/definitions`, `/api/health/checks/…`, `/api/healthchecks/node`),
//! the message operations (`POST …/publish`, `POST …/get`,
//! `/api/aliveness-test/{vhost}`, through an AMQP client inside the node
//! that logs in as the request's user: the `direct` module), Warren's
//! `POST /api/nodes/{name}/stop`, `/stop_app` and `/start_app` (through a
//! [`NodeControl`]), plus `/api/openapi.json` describing them, and a web
//! page at `/` (overview with rates and charts, connections, channels,
//! exchanges, queues, a queue's page with its ring, Admin → Policies).
//! [`serve`] also samples the broker's counters for the message rates
//! (RabbitMQ's `rates_mode: basic`, the `rates` module).
//! [`metrics_router`] serves Prometheus metrics at `/metrics`: this node's
//! own queues and clients, as rabbitmq_prometheus does.
//!
//! Conventions are RabbitMQ's: HTTP basic auth against the broker's users,
//! who need the `management`, `policymaker`, `monitoring` or
//! `administrator` tag, each seeing and changing what RabbitMQ's
//! management plugin lets it (the `access` module); the default vhost
//! written `%2F`; `201`/`204` on PUT and `204` on DELETE; errors as
//! `{"error":…,"reason":…}` with 400, 401 or 404.
//!
//! Mirror columns (`node`, `slave_nodes`, `synchronised_slave_nodes`,
//! `state`) come from a [`MirrorSource`]; until mirroring is wired,
//! [`SingleNode`] reports every queue on this node without mirrors.

mod access;
mod api;
mod clients;
mod cluster;
mod defs;
mod direct;
mod fanout;
mod listener;
mod messages;
mod metrics;
mod node;
mod openapi;
mod process;
mod rates;
mod shards;
mod web;

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use warren_broker::Broker;
use warren_lock::{MeasuredGuard, MeasuredMutex};

pub use cluster::{
    ClusterControl, ClusterFuture, ClusterInfo, ClusterMember, JoinFuture, JoinOutcome,
};
pub use defs::{ImportError, import_definitions};
pub use listener::HTTP_IDLE_TIMEOUT;
pub use metrics::{metrics_router, render as render_metrics, serve_metrics};
pub use node::NodeControl;
pub use openapi::openapi_document;

/// The broker as the node shell shares it.
pub type SharedBroker = Arc<MeasuredMutex<Broker>>;

/// Where a queue's master and mirrors are, as the management API shows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueMirrors {
    /// The node of the queue's master.
    pub node: String,
    /// Mirror nodes, oldest first.
    pub slave_nodes: Vec<String>,
    /// The synchronised ones among them.
    pub synchronised_slave_nodes: Vec<String>,
    /// Messages left to synchronise while a sync runs.
    pub syncing: Option<u64>,
}

/// Where the API gets mirror data and sends `sync` / `cancel_sync`.
///
/// The mirroring layer implements it; [`SingleNode`] is the stand-in while
/// it is not wired.
pub trait MirrorSource: Send + Sync + fmt::Debug {
    /// The master and mirrors of a queue; `None` means "on this node, no mirrors".
    fn mirrors(&self, vhost: &str, queue: &str) -> Option<QueueMirrors>;
    /// Starts synchronising a queue's mirrors.
    fn sync(&self, vhost: &str, queue: &str) -> Result<(), String>;
    /// Cancels a queue's synchronisation.
    fn cancel_sync(&self, vhost: &str, queue: &str) -> Result<(), String>;
    /// What the node's replica hub has done, where mirroring runs.
    fn hub(&self) -> Option<HubCounts> {
        None
    }
}

/// The counters of a node's replica hub, the one task that moves every
/// replica's ring traffic (`/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubCounts {
    /// Turns the hub has taken.
    pub turns: u64,
    /// Replicas it served, summed over its turns.
    pub replicas_served: u64,
}

/// A node without mirroring: queues have no mirrors; sync requests are
/// accepted and do nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleNode;

impl MirrorSource for SingleNode {
    fn mirrors(&self, _vhost: &str, _queue: &str) -> Option<QueueMirrors> {
        None
    }

    fn sync(&self, _vhost: &str, _queue: &str) -> Result<(), String> {
        Ok(())
    }

    fn cancel_sync(&self, _vhost: &str, _queue: &str) -> Result<(), String> {
        Ok(())
    }
}

/// Everything the API handlers share.
#[derive(Clone)]
pub struct Management {
    broker: SharedBroker,
    /// A sharded node's other shards (`shards.rs`): listed and counted with
    /// `broker`, which serves the metadata.
    shards: Vec<SharedBroker>,
    node: String,
    /// Product name and version, as the broker gives them to clients.
    product: (String, String),
    listeners: Vec<(String, SocketAddr)>,
    http_addr: Option<SocketAddr>,
    mirrors: Arc<dyn MirrorSource>,
    cluster: Option<Arc<dyn ClusterControl>>,
    node_control: Option<Arc<dyn NodeControl>>,
    started: Instant,
    stats_interval: Duration,
    rates: Arc<Mutex<rates::Rates>>,
    http_idle: Duration,
}

impl fmt::Debug for Management {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Management")
            .field("node", &self.node)
            .field("listeners", &self.listeners)
            .field("http_addr", &self.http_addr)
            .finish_non_exhaustive()
    }
}

impl Management {
    /// The API over `broker`, for the node named as the broker's config says.
    pub fn new(broker: SharedBroker) -> Self {
        let (node, product) = {
            let b = broker.lock();
            let (name, version) = b.product();
            (
                b.node_name().to_owned(),
                (name.to_owned(), version.to_owned()),
            )
        };
        Self {
            broker,
            shards: Vec::new(),
            node,
            product,
            listeners: Vec::new(),
            http_addr: None,
            mirrors: Arc::new(SingleNode),
            cluster: None,
            node_control: None,
            started: Instant::now(),
            stats_interval: rates::DEFAULT_INTERVAL,
            rates: Arc::new(Mutex::new(rates::Rates::new(rates::DEFAULT_INTERVAL))),
            http_idle: HTTP_IDLE_TIMEOUT,
        }
    }

    /// Sets how often [`serve`] samples the counters for the message rates
    /// (RabbitMQ's `collect_statistics_interval`; 5 s by default).
    #[must_use]
    pub fn statistics_interval(mut self, every: Duration) -> Self {
        self.stats_interval = every;
        self.rates = Arc::new(Mutex::new(rates::Rates::new(every)));
        self
    }

    /// Sets how long an HTTP connection may wait for its next request's
    /// headers ([`HTTP_IDLE_TIMEOUT`] by default, as RabbitMQ's).
    #[must_use]
    pub fn http_idle_timeout(mut self, idle: Duration) -> Self {
        self.http_idle = idle;
        self
    }

    /// Adds one of this node's listeners, shown in the overview's
    /// `listeners` with RabbitMQ's protocol name (`amqp`, `amqp/ssl`,
    /// `http`, `http/prometheus`). The other members' come from the
    /// cluster ([`ClusterMember::listeners`]).
    #[must_use]
    pub fn listener(mut self, protocol: &str, addr: SocketAddr) -> Self {
        self.listeners.push((protocol.to_owned(), addr));
        self
    }

    /// Sets the management HTTP listener's address (shown in `contexts`;
    /// add it with [`listener`](Self::listener) as `http` to list it).
    #[must_use]
    pub fn http_addr(mut self, addr: SocketAddr) -> Self {
        self.http_addr = Some(addr);
        self
    }

    /// Sets where mirror data comes from.
    #[must_use]
    pub fn mirrors(mut self, mirrors: Arc<dyn MirrorSource>) -> Self {
        self.mirrors = mirrors;
        self
    }

    /// Sets the cluster membership the `/api/cluster` routes drive.
    #[must_use]
    pub fn cluster(mut self, cluster: Arc<dyn ClusterControl>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// Sets what `POST /api/nodes/{name}/stop`, `/stop_app` and
    /// `/start_app` drive.
    #[must_use]
    pub fn node_control(mut self, control: Arc<dyn NodeControl>) -> Self {
        self.node_control = Some(control);
        self
    }

    fn broker(&self) -> MeasuredGuard<'_, Broker> {
        self.broker.lock()
    }

    /// The other cluster members this node sees running.
    fn running_others(&self) -> Vec<ClusterMember> {
        let Some(c) = &self.cluster else {
            return Vec::new();
        };
        c.status()
            .members
            .into_iter()
            .filter(|m| m.running && m.name != self.node)
            .collect()
    }

    /// Runs `f` on the broker, then answers once the metadata changes it
    /// made are committed: in a cluster, by a majority, waited for without
    /// the broker's lock (`Broker::recorded`), so no client of the node
    /// waits with the operator.
    async fn changing<R>(
        &self,
        f: impl FnOnce(&mut Broker) -> api::ApiResult<R>,
    ) -> api::ApiResult<R> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let r = self.broker().recorded(
            f,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        );
        match rx.await {
            Ok(Err(e)) => Err(warren_broker::BrokerError::Meta(e).into()),
            _ => r,
        }
    }

    /// The rate samples. Never held while taking the broker's lock.
    fn rates(&self) -> MutexGuard<'_, rates::Rates> {
        lock(&self.rates)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The router: `/api/…`, `/api/openapi.json` and the web page at `/`.
pub fn router(state: Management) -> Router {
    api::routes(state.clone())
        .merge(web::routes())
        .layer(axum::middleware::from_fn(read_whole_body))
}

/// The most a request's body may carry (axum's own limit for the handlers
/// that read one).
const BODY_LIMIT: usize = 2 << 20;

/// Reads a request's whole body before its handler runs, so a handler that
/// has no use for it (a `DELETE` sent with a JSON body, as AMQPStorm's does,
/// the body written after the headers) leaves the connection reusable:
/// hyper closes a kept-alive connection whose body was not read, and the
/// client's next request on it meets a closed socket. 413 past the limit.
async fn read_whole_body(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, BODY_LIMIT).await {
        Ok(bytes) => {
            let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
            next.run(req).await
        }
        Err(_) => axum::http::StatusCode::PAYLOAD_TOO_LARGE.into_response(),
    }
}

/// Serves [`router`] on `listener`, and samples the message rates, until
/// the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, state: Management) -> std::io::Result<()> {
    let _sampler = rates::AbortOnDrop(tokio::spawn(rates::sample_forever(state.clone())));
    let idle = state.http_idle;
    listener::serve_router(listener, router(state), idle).await
}
