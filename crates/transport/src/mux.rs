//! One peer port for every service of a node.
//!
//! A node listens for peers on one address only. [`Mux::listen`] opens the
//! one real listener there; each of the node's services (the Raft metadata
//! store, the GM queue rings, the forwarding links) reaches it through a
//! view ([`Mux::service`]): an [`Arc<dyn Transport>`] whose `listen` returns
//! that service's share of the accepted connections and whose `connect`
//! dials a peer's port and names the service.
//!
//! # The selection exchange
//!
//! After the transport's authenticated handshake, the dialer sends one
//! frame: the service's one-byte tag. The acceptor reads it (within the
//! selection timeout: a peer that never sends it holds nothing longer) and,
//! if that service listens, answers with the same byte and hands the
//! connection to the service's listener; otherwise (an unknown tag, a
//! service not listening yet) it logs and drops the connection. The dialer's
//! `connect` returns only once the answer came, so a dial succeeds exactly
//! when the peer's service is there to read what follows (a forwarding link
//! never sends into a connection nobody reads).
//!
//! The pre-authentication limits stay the real transport's (4 KiB frames
//! and [`crate::HandshakeSlots`]): the selection comes only from peers that
//! proved the cluster secret.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::{ChannelListener, Connection, Listener, PeerAddr, Transport, TransportError};

/// Connections a service's listener holds before it accepts them.
const BACKLOG: usize = 64;

/// The services that share a node's peer port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    /// The Raft metadata store.
    Metadata,
    /// The GM queue rings.
    Rings,
    /// The forwarding links between brokers.
    Links,
}

impl Service {
    /// The one-byte tag naming the service on the wire.
    fn tag(self) -> u8 {
        match self {
            Self::Metadata => 1,
            Self::Rings => 2,
            Self::Links => 3,
        }
    }

    /// The service a selection frame names, if any.
    fn from_frame(frame: &[u8]) -> Option<Self> {
        match frame {
            [1] => Some(Self::Metadata),
            [2] => Some(Self::Rings),
            [3] => Some(Self::Links),
            _ => None,
        }
    }

    /// The selection frame (and its answer).
    fn frame(self) -> Bytes {
        Bytes::copy_from_slice(&[self.tag()])
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Metadata => "metadata store",
            Self::Rings => "queue rings",
            Self::Links => "forwarding links",
        })
    }
}

/// Where accepted connections go: each listening service's channel.
type Routes = Mutex<HashMap<Service, mpsc::Sender<Connection>>>;

/// A node's peer port, shared by its services. Cloning shares it; the real
/// listener closes when the last clone, view and service listener is gone.
#[derive(Clone, Debug)]
pub struct Mux {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// The address asked for.
    requested: PeerAddr,
    /// The address peers dial (the real listener's).
    local: PeerAddr,
    routes: Arc<Routes>,
    select_timeout: Duration,
    accept_task: AbortHandle,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl Mux {
    /// Opens the real listener at `addr` on `transport` and starts sorting
    /// its connections by service (on the caller's runtime: the listener's
    /// sockets are driven there). `select_timeout` bounds both ends'
    /// selection exchange.
    pub async fn listen(
        transport: &dyn Transport,
        addr: &PeerAddr,
        select_timeout: Duration,
    ) -> Result<Self, TransportError> {
        let listener = transport.listen(addr).await?;
        let local = listener.local_addr();
        let routes = Arc::new(Routes::default());
        let accept_task = tokio::spawn(sort(
            listener,
            routes.clone(),
            select_timeout,
            local.clone(),
        ))
        .abort_handle();
        Ok(Self {
            shared: Arc::new(Shared {
                requested: addr.clone(),
                local,
                routes,
                select_timeout,
                accept_task,
            }),
        })
    }

    /// The address peers dial.
    pub fn local_addr(&self) -> PeerAddr {
        self.shared.local.clone()
    }

    /// `service`'s view of the port: its `listen` (at this port's address)
    /// yields the connections that name `service`; its `connect` dials with
    /// `dialer` and names `service`.
    pub fn service(&self, service: Service, dialer: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Arc::new(ServiceTransport {
            shared: self.shared.clone(),
            service,
            dialer,
        })
    }
}

/// Accepts every connection and hands each to a task that routes it.
async fn sort(
    mut listener: Box<dyn Listener>,
    routes: Arc<Routes>,
    select_timeout: Duration,
    local: PeerAddr,
) {
    while let Ok(conn) = listener.accept().await {
        tokio::spawn(route(conn, routes.clone(), select_timeout, local.clone()));
    }
}

/// Reads `conn`'s selection and hands it to that service, or drops it.
async fn route(
    mut conn: Connection,
    routes: Arc<Routes>,
    select_timeout: Duration,
    local: PeerAddr,
) {
    let peer = conn.peer_node().clone();
    let service = match tokio::time::timeout(select_timeout, conn.recv()).await {
        Ok(Ok(Some(frame))) => match Service::from_frame(&frame) {
            Some(service) => service,
            None => {
                tracing::warn!(%peer, %local, frame_len = frame.len(), "a peer named an unknown service; connection dropped");
                return;
            }
        },
        Ok(Ok(None) | Err(_)) => {
            tracing::debug!(%peer, %local, "a peer left before naming a service");
            return;
        }
        Err(_) => {
            tracing::warn!(%peer, %local, timeout = ?select_timeout, "a peer named no service in time; connection dropped");
            return;
        }
    };
    let route = routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&service)
        .filter(|tx| !tx.is_closed())
        .cloned();
    let Some(tx) = route else {
        tracing::debug!(%peer, %local, %service, "a peer dialed a service that is not listening; connection dropped");
        return;
    };
    let handed = async {
        conn.send(service.frame()).await.ok()?;
        // The service may run on another runtime than this port's: its
        // reads should wake its own threads.
        conn.follow_next_poller();
        tx.send(conn).await.ok()
    };
    if tokio::time::timeout(select_timeout, handed).await.is_err() {
        tracing::warn!(%peer, %local, %service, "a connection could not be handed to its service in time; dropped");
    }
}

/// Dials `addr` with `dialer` and selects `service` there: returns once the
/// peer's port has answered that the service takes the connection.
pub(crate) async fn dial(
    dialer: &dyn Transport,
    addr: &PeerAddr,
    service: Service,
    select_timeout: Duration,
) -> Result<Connection, TransportError> {
    let mut conn = dialer.connect(addr).await?;
    let lost = |reason: String| TransportError::ConnectionLost {
        peer: addr.to_string(),
        reason,
    };
    let answer = tokio::time::timeout(select_timeout, async {
        conn.send(service.frame()).await?;
        conn.recv().await
    })
    .await;
    match answer {
        Ok(Ok(Some(frame))) if frame == service.frame() => Ok(conn),
        Ok(Ok(Some(_))) => Err(lost(format!(
            "the peer answered the selection of the {service} wrongly"
        ))),
        Ok(Ok(None)) => Err(lost(format!(
            "the peer does not serve the {service} (not started yet, or stopping)"
        ))),
        Ok(Err(e)) => Err(lost(format!(
            "the peer does not serve the {service} (not started yet, or stopping): {e}"
        ))),
        Err(_) => Err(lost(format!(
            "the peer did not answer the selection of the {service} within {select_timeout:?}"
        ))),
    }
}

/// One service's view of a [`Mux`].
struct ServiceTransport {
    shared: Arc<Shared>,
    service: Service,
    dialer: Arc<dyn Transport>,
}

impl fmt::Debug for ServiceTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceTransport")
            .field("service", &self.service)
            .field("local", &self.shared.local)
            .field("dialer", &self.dialer)
            .finish()
    }
}

#[async_trait]
impl Transport for ServiceTransport {
    fn kind(&self) -> &'static str {
        self.dialer.kind()
    }

    async fn listen(&self, addr: &PeerAddr) -> Result<Box<dyn Listener>, TransportError> {
        let refuse = |kind: std::io::ErrorKind, why: String| TransportError::Listen {
            addr: addr.clone(),
            source: Arc::new(std::io::Error::new(kind, why)),
        };
        if *addr != self.shared.requested && *addr != self.shared.local {
            return Err(refuse(
                std::io::ErrorKind::AddrNotAvailable,
                format!(
                    "the {} listen on the node's peer address {} only",
                    self.service, self.shared.local
                ),
            ));
        }
        let (tx, rx) = mpsc::channel(BACKLOG);
        {
            let mut routes = self
                .shared
                .routes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if routes
                .get(&self.service)
                .is_some_and(|old| !old.is_closed())
            {
                return Err(refuse(
                    std::io::ErrorKind::AddrInUse,
                    format!("the {} already listen on this port", self.service),
                ));
            }
            routes.insert(self.service, tx);
        }
        // The listener keeps the port open.
        let shared = self.shared.clone();
        Ok(Box::new(
            ChannelListener::fed(self.shared.local.clone(), rx).on_drop(move || drop(shared)),
        ))
    }

    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError> {
        dial(
            self.dialer.as_ref(),
            addr,
            self.service,
            self.shared.select_timeout,
        )
        .await
    }

    async fn refuses(&self, addr: &PeerAddr) -> bool {
        self.dialer.refuses(addr).await
    }
}
