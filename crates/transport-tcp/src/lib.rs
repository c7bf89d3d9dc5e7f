//! Warren's TCP transport.
//!
//! - `TCP_NODELAY` on every connection;
//!   [`FrameSender::flush`](warren_transport::FrameSender::flush) writes all
//!   frames fed since the last flush in one `write` where the kernel allows,
//!   so many small frames share one syscall.
//! - Outgoing connections first bind the node's own address
//!   ([`TransportConfig::bind_ip`]), so firewall rules between nodes on
//!   127.0.0.2, .3, … match them.
//! - Mutual TLS ([`TcpTransport::with_tls`], what the node runs unless told
//!   otherwise): both ends present a certificate from the cluster CA, and
//!   everything after is encrypted and integrity-protected. [`TcpTransport::new`]
//!   is plain TCP, for a trusted network only: anyone on the path can read
//!   and inject frames once the handshake is done.
//! - Every connection then runs the cluster-secret handshake. Until it has,
//!   the peer gets frames of at most
//!   [`HANDSHAKE_MAX_FRAME_LEN`](warren_transport::HANDSHAKE_MAX_FRAME_LEN)
//!   bytes, one handshake timeout for TLS and the handshake together, and one
//!   of [`TransportConfig::max_pending_handshakes`] slots; a connection over
//!   the limit is closed at once.

mod movable;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use async_trait::async_trait;
use movable::Movable;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};
use warren_tls::NodeIdentity;
use warren_transport::stream::establish;
use warren_transport::{
    ChannelListener, Connection, HandshakeSlots, Listener, PeerAddr, Role, Transport,
    TransportConfig, TransportError,
};

/// ALPN protocol id for Warren's peer links.
const ALPN: &[u8] = b"warren-peer/1";

/// TCP between nodes, optionally with TLS.
#[derive(Clone)]
pub struct TcpTransport {
    config: TransportConfig,
    tls: Option<Tls>,
}

#[derive(Clone)]
struct Tls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("node", &self.config.node)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl TcpTransport {
    /// Plain TCP: frames travel in the clear after the handshake.
    pub fn new(config: TransportConfig) -> Self {
        Self { config, tls: None }
    }

    /// TCP with mutual TLS: only nodes with a certificate from the cluster CA connect.
    pub fn with_tls(
        config: TransportConfig,
        identity: &NodeIdentity,
    ) -> Result<Self, TransportError> {
        let tls_err = |e: warren_tls::TlsError| TransportError::Tls(e.to_string());
        let server = identity.server_config(&[ALPN]).map_err(tls_err)?;
        let client = identity.client_config(&[ALPN]).map_err(tls_err)?;
        Ok(Self {
            config,
            tls: Some(Tls {
                acceptor: TlsAcceptor::from(Arc::new(server)),
                connector: TlsConnector::from(Arc::new(client)),
            }),
        })
    }

    async fn dial(&self, addr: &PeerAddr) -> Result<TcpStream, TransportError> {
        let connect_err = |e: std::io::Error| TransportError::Connect {
            addr: addr.clone(),
            source: Arc::new(e),
        };
        let target: SocketAddr = tokio::net::lookup_host(addr.as_str())
            .await
            .map_err(connect_err)?
            .next()
            .ok_or_else(|| connect_err(std::io::Error::other("the address resolves to nothing")))?;
        let socket = if target.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
        .map_err(connect_err)?;
        if let Some(ip) = self.config.bind_ip {
            socket.bind(SocketAddr::new(ip, 0)).map_err(connect_err)?;
        }
        let stream =
            match tokio::time::timeout(self.config.connect_timeout, socket.connect(target)).await {
                Ok(stream) => stream.map_err(connect_err)?,
                Err(_) => {
                    return Err(TransportError::ConnectTimeout {
                        addr: addr.clone(),
                        after: self.config.connect_timeout,
                    });
                }
            };
        stream.set_nodelay(true).map_err(connect_err)?;
        self.set_unacked_timeout(&stream);
        Ok(stream)
    }

    /// Gives the connection up when its data goes unacknowledged for
    /// [`TransportConfig::unacked_timeout`] (`TCP_USER_TIMEOUT`).
    fn set_unacked_timeout(&self, stream: &TcpStream) {
        if let Some(t) = self.config.unacked_timeout
            && let Err(e) = socket2::SockRef::from(stream).set_tcp_user_timeout(Some(t))
        {
            tracing::debug!(error = %e, "setting TCP_USER_TIMEOUT failed");
        }
    }

    /// Authenticates a fresh stream as `role`: TLS (when on), then the
    /// cluster handshake, both within one handshake timeout, however the peer
    /// spends it (silent, trickling bytes, stalling TLS).
    async fn authenticate(
        &self,
        stream: TcpStream,
        role: Role,
        addr: &PeerAddr,
    ) -> Result<Connection, TransportError> {
        let handshakes = async {
            match (&self.tls, role) {
                (None, Role::Dialer) => {
                    let (read, write) = stream.into_split();
                    establish(read, write, &self.config, role, addr).await
                }
                // An accepted connection may be handed to a service on
                // another runtime than the listener's: its socket can move.
                (None, Role::Acceptor) => {
                    let flag = Arc::new(AtomicBool::new(false));
                    let (read, write) = tokio::io::split(Movable::new(stream, flag.clone()));
                    let conn = establish(read, write, &self.config, role, addr).await?;
                    Ok(conn.with_move_flag(flag))
                }
                (Some(tls), Role::Dialer) => {
                    let name = NodeIdentity::server_name();
                    let stream: TlsStream<TcpStream> = tls
                        .connector
                        .connect(name, stream)
                        .await
                        .map_err(|e| tls_failed(addr, &e))?
                        .into();
                    let (read, write) = tokio::io::split(stream);
                    establish(read, write, &self.config, role, addr).await
                }
                (Some(tls), Role::Acceptor) => {
                    let flag = Arc::new(AtomicBool::new(false));
                    let stream = tls
                        .acceptor
                        .accept(Movable::new(stream, flag.clone()))
                        .await
                        .map_err(|e| tls_failed(addr, &e))?;
                    let (read, write) = tokio::io::split(stream);
                    let conn = establish(read, write, &self.config, role, addr).await?;
                    Ok(conn.with_move_flag(flag))
                }
            }
        };
        let after = self.config.handshake_timeout;
        tokio::time::timeout(after, handshakes)
            .await
            .unwrap_or_else(|_| {
                tracing::warn!(peer_addr = %addr, ?role, ?after, "peer handshake timed out; connection refused");
                Err(TransportError::HandshakeTimeout {
                    addr: addr.clone(),
                    after,
                })
            })
    }
}

/// A failed TLS handshake, logged and named with what it most likely means
/// between nodes.
fn tls_failed(addr: &PeerAddr, e: &std::io::Error) -> TransportError {
    use tokio_rustls::rustls::{AlertDescription as Alert, Error};
    const OTHER_CLUSTER: &str = "the two nodes have different cluster secrets or CAs";
    let meaning = match e.get_ref().and_then(|e| e.downcast_ref::<Error>()) {
        Some(Error::InvalidCertificate(_) | Error::NoCertificatesPresented) => {
            format!(" (its certificate is not from this node's cluster CA: {OTHER_CLUSTER})")
        }
        Some(Error::AlertReceived(
            Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateUnknown
            | Alert::CertificateRequired
            | Alert::DecryptError,
        )) => format!(" (it refused this node's certificate: {OTHER_CLUSTER})"),
        Some(Error::InvalidMessage(_) | Error::InappropriateMessage { .. }) => {
            " (it does not speak TLS: is TLS off there?)".to_owned()
        }
        _ => String::new(),
    };
    if e.get_ref().is_some_and(|e| e.is::<Error>()) {
        tracing::warn!(peer_addr = %addr, error = %e, "TLS handshake with peer failed{meaning}; connection refused");
    } else {
        // The connection broke (a peer stopping, a cut), no TLS error: the
        // failure detector reports what it means.
        tracing::debug!(peer_addr = %addr, error = %e, "connection lost during the TLS handshake");
    }
    TransportError::Tls(format!("TLS handshake with {addr} failed: {e}{meaning}"))
}

#[async_trait]
impl Transport for TcpTransport {
    fn kind(&self) -> &'static str {
        if self.tls.is_some() { "tcp+tls" } else { "tcp" }
    }

    async fn listen(&self, addr: &PeerAddr) -> Result<Box<dyn Listener>, TransportError> {
        let listener =
            TcpListener::bind(addr.as_str())
                .await
                .map_err(|e| TransportError::Listen {
                    addr: addr.clone(),
                    source: Arc::new(e),
                })?;
        let local = PeerAddr::from(listener.local_addr().map_err(|e| TransportError::Listen {
            addr: addr.clone(),
            source: Arc::new(e),
        })?);
        let (tx, rx) = mpsc::channel(64);
        let transport = self.clone();
        let mut slots = HandshakeSlots::new(local.clone(), self.config.max_pending_handshakes);
        let task = tokio::spawn(async move {
            loop {
                let (stream, remote) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a peer connection failed");
                        continue;
                    }
                };
                let addr = PeerAddr::from(remote);
                let Some(slot) = slots.admit(&addr) else {
                    continue;
                };
                let transport = transport.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    transport.set_unacked_timeout(&stream);
                    let conn = transport.authenticate(stream, Role::Acceptor, &addr).await;
                    drop(slot);
                    if let Ok(conn) = conn {
                        let _ = tx.send(conn).await;
                    }
                });
            }
        });
        Ok(Box::new(ChannelListener::new(local, rx, task)))
    }

    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError> {
        let stream = self.dial(addr).await?;
        self.authenticate(stream, Role::Dialer, addr).await
    }
}
