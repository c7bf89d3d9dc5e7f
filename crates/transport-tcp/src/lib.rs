//! Warren's TCP transport.
//!
//! - `TCP_NODELAY` on every connection; [`FrameSender::flush`] writes all
//!   frames fed since the last flush in one `write` where the kernel allows,
//!   so many small frames share one syscall.
//! - Outgoing connections first bind the node's own address
//!   ([`TransportConfig::bind_ip`]), so firewall rules between nodes on
//!   127.0.0.2, .3, … match them.
//! - Optional mutual TLS ([`TcpTransport::with_tls`]): both ends present a
//!   certificate from the cluster CA, for clusters whose network is not trusted.
//! - Every connection then runs the cluster-secret handshake.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use warren_tls::NodeIdentity;
use warren_transport::stream::{StreamReceiver, StreamSender};
use warren_transport::{
    ChannelListener, Connection, Listener, PeerAddr, Role, Transport, TransportConfig,
    TransportError, run_handshake,
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
    /// Plain TCP.
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
        Ok(stream)
    }
}

/// Runs the handshake over a byte stream and wraps it as a [`Connection`].
async fn establish<S>(
    stream: S,
    config: &TransportConfig,
    role: Role,
    addr: &PeerAddr,
) -> Result<Connection, TransportError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (read, write) = tokio::io::split(stream);
    let mut sender = StreamSender::new(write, config.max_frame_len, addr.to_string());
    let mut receiver = StreamReceiver::new(read, config.max_frame_len, addr.to_string());
    let peer = run_handshake(&mut sender, &mut receiver, config, role, addr).await?;
    sender.set_peer(peer.to_string());
    receiver.set_peer(peer.to_string());
    Ok(Connection::new(peer, Box::new(sender), Box::new(receiver)))
}

/// Runs the handshake over a plain TCP stream (split without a lock).
async fn establish_plain(
    stream: TcpStream,
    config: &TransportConfig,
    role: Role,
    addr: &PeerAddr,
) -> Result<Connection, TransportError> {
    let (read, write) = stream.into_split();
    let mut sender = StreamSender::new(write, config.max_frame_len, addr.to_string());
    let mut receiver = StreamReceiver::new(read, config.max_frame_len, addr.to_string());
    let peer = run_handshake(&mut sender, &mut receiver, config, role, addr).await?;
    sender.set_peer(peer.to_string());
    receiver.set_peer(peer.to_string());
    Ok(Connection::new(peer, Box::new(sender), Box::new(receiver)))
}

fn tls_failed(addr: &PeerAddr, e: &std::io::Error) -> TransportError {
    tracing::warn!(peer_addr = %addr, error = %e, "TLS handshake with peer failed; connection refused");
    TransportError::Tls(format!("TLS handshake with {addr} failed: {e}"))
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
        let task = tokio::spawn(async move {
            loop {
                let (stream, remote) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a peer connection failed");
                        continue;
                    }
                };
                let transport = transport.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let addr = PeerAddr::from(remote);
                    let _ = stream.set_nodelay(true);
                    let conn = match &transport.tls {
                        None => {
                            establish_plain(stream, &transport.config, Role::Acceptor, &addr).await
                        }
                        Some(tls) => {
                            let accept = tls.acceptor.accept(stream);
                            match tokio::time::timeout(transport.config.handshake_timeout, accept)
                                .await
                            {
                                Ok(Ok(tls_stream)) => {
                                    establish(tls_stream, &transport.config, Role::Acceptor, &addr)
                                        .await
                                }
                                Ok(Err(e)) => Err(tls_failed(&addr, &e)),
                                Err(_) => Err(TransportError::HandshakeTimeout {
                                    addr: addr.clone(),
                                    after: transport.config.handshake_timeout,
                                }),
                            }
                        }
                    };
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
        match &self.tls {
            None => establish_plain(stream, &self.config, Role::Dialer, addr).await,
            Some(tls) => {
                let connect = tls.connector.connect(NodeIdentity::server_name(), stream);
                let tls_stream =
                    match tokio::time::timeout(self.config.handshake_timeout, connect).await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => return Err(tls_failed(addr, &e)),
                        Err(_) => {
                            return Err(TransportError::HandshakeTimeout {
                                addr: addr.clone(),
                                after: self.config.handshake_timeout,
                            });
                        }
                    };
                establish(tls_stream, &self.config, Role::Dialer, addr).await
            }
        }
    }
}
