//! Warren's QUIC transport.
//!
//! One bidirectional QUIC stream per [`Connection`]; frames use the same
//! length-prefixed framing as TCP on that stream. TLS 1.3 with mutual
//! authentication is part of QUIC: both ends present a certificate from the
//! cluster CA ([`warren_tls`]), and a node without one is refused during the
//! QUIC handshake. The cluster-secret handshake then runs on the stream, as on
//! every transport.
//!
//! Before a connection is authenticated a listener holds little for it: it
//! takes one of [`TransportConfig::max_pending_handshakes`] slots (an
//! incoming connection beyond is refused before quinn keeps any state for
//! it), twice the handshake timeout bounds the QUIC handshake, the stream and
//! the cluster handshake together, and handshake frames are small
//! ([`stream::establish`]).
//!
//! Loopback and LAN tuning lives in [`QuicOptions`]: quinn's default maximum
//! UDP payload (1452 bytes) and initial congestion window are sized for the
//! Internet; between nodes of one cluster larger packets and windows are what
//! let QUIC keep up with TCP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, MtuDiscoveryConfig, VarInt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OnceCell, mpsc};
use warren_tls::{CLUSTER_SERVER_NAME, NodeIdentity};
use warren_transport::{
    ChannelListener, Connection, HandshakeSlots, Listener, PeerAddr, Role, Transport,
    TransportConfig, TransportError, stream,
};

/// ALPN protocol id for Warren's peer links.
const ALPN: &[u8] = b"warren-peer/1";

/// How long [`QuicTransport::refuses`] waits for the peer's host to answer
/// its probe with ICMP port unreachable (a loopback or LAN round trip).
const PROBE_WAIT: Duration = Duration::from_millis(200);

/// QUIC tuning knobs.
#[derive(Debug, Clone)]
pub struct QuicOptions {
    /// The UDP payload size the connection starts with (quinn's default is 1200).
    /// Raise it only where the path's MTU allows (loopback: up to 65 KB).
    pub initial_mtu: u16,
    /// The largest UDP payload MTU discovery may probe for.
    pub max_mtu: u16,
    /// The congestion controller's initial window in bytes.
    pub initial_window: u64,
    /// Flow-control window per stream, in bytes.
    pub stream_window: u32,
    /// Silence after which a connection is declared dead.
    pub idle_timeout: Duration,
    /// Keep-alive interval (well under the idle timeout).
    pub keep_alive: Duration,
    /// UDP socket send and receive buffer sizes, in bytes (capped by the
    /// kernel's `net.core.{r,w}mem_max`). Large packets need deep buffers,
    /// or bursts overflow the socket and look like congestion.
    pub socket_buffer: usize,
    /// Let the kernel split one large send into MTU-sized datagrams (GSO).
    /// Keep the MTU at or under the interface's segment size when this is on:
    /// larger GSO segments are silently dropped.
    pub gso: bool,
    /// How many ack-eliciting packets the peer may receive before it must
    /// acknowledge them (QUIC's ACK frequency extension; 1 is RFC 9000's
    /// "every second packet"). Between nodes whose links carry data mostly
    /// one way round a ring, most acknowledgements are packets of their own:
    /// fewer of them save a UDP send and a decryption each.
    pub ack_eliciting_threshold: u32,
    /// The longest the peer may hold back an acknowledgement.
    pub max_ack_delay: Duration,
}

impl Default for QuicOptions {
    fn default() -> Self {
        Self {
            initial_mtu: 1452,
            max_mtu: 1452,
            initial_window: 1 << 20,
            stream_window: 16 << 20,
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            socket_buffer: 4 << 20,
            gso: true,
            ack_eliciting_threshold: 1,
            max_ack_delay: Duration::from_millis(25),
        }
    }
}

impl QuicOptions {
    /// Tuning for nodes on one host (loopback): a large initial congestion
    /// window, GSO batches of standard-size packets and an acknowledgement
    /// per 64 packets, at most 5 ms late. (Measured here: with GSO, 1452-byte
    /// packets beat 8–60 KB packets without it; an acknowledgement per 16
    /// packets instead of every second one gave 6 % more confirmed mirrored
    /// publishes, per 64 another 10 %, per 256 nothing more.)
    pub fn loopback() -> Self {
        Self {
            initial_window: 8 << 20,
            ack_eliciting_threshold: 64,
            max_ack_delay: Duration::from_millis(5),
            ..Self::default()
        }
    }

    fn transport_config(&self) -> Result<quinn::TransportConfig, TransportError> {
        let mut tc = quinn::TransportConfig::default();
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout)
            .map_err(|e| TransportError::Tls(format!("bad QUIC idle timeout: {e}")))?;
        tc.max_idle_timeout(Some(idle));
        tc.keep_alive_interval(Some(self.keep_alive));
        tc.initial_mtu(self.initial_mtu);
        tc.min_mtu(1200);
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_mtu.max(self.initial_mtu));
        tc.mtu_discovery_config(Some(mtu));
        tc.stream_receive_window(VarInt::from_u32(self.stream_window));
        tc.receive_window(VarInt::from_u32(self.stream_window.saturating_mul(2)));
        tc.send_window(u64::from(self.stream_window) * 2);
        tc.max_concurrent_uni_streams(VarInt::from_u32(0));
        tc.max_concurrent_bidi_streams(VarInt::from_u32(4));
        tc.enable_segmentation_offload(self.gso);
        let mut acks = quinn::AckFrequencyConfig::default();
        acks.ack_eliciting_threshold(VarInt::from_u32(self.ack_eliciting_threshold))
            .max_ack_delay(Some(self.max_ack_delay));
        tc.ack_frequency_config(Some(acks));
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window(self.initial_window);
        tc.congestion_controller_factory(Arc::new(cubic));
        Ok(tc)
    }
}

/// QUIC between nodes of one cluster.
#[derive(Clone)]
pub struct QuicTransport {
    config: TransportConfig,
    server: quinn::ServerConfig,
    client: quinn::ClientConfig,
    client_endpoint: Arc<OnceCell<Endpoint>>,
    socket_buffer: usize,
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("node", &self.config.node)
            .finish_non_exhaustive()
    }
}

impl QuicTransport {
    /// A QUIC transport for this node, presenting `identity` and trusting its CA.
    pub fn new(
        config: TransportConfig,
        identity: &NodeIdentity,
        options: &QuicOptions,
    ) -> Result<Self, TransportError> {
        let tls = |e: &dyn std::fmt::Display| TransportError::Tls(e.to_string());
        let transport = Arc::new(options.transport_config()?);
        let server_tls = identity.server_config(&[ALPN]).map_err(|e| tls(&e))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(server_tls).map_err(|e| tls(&e))?,
        ));
        server.transport_config(transport.clone());
        let client_tls = identity.client_config(&[ALPN]).map_err(|e| tls(&e))?;
        let mut client = quinn::ClientConfig::new(Arc::new(
            QuicClientConfig::try_from(client_tls).map_err(|e| tls(&e))?,
        ));
        client.transport_config(transport);
        Ok(Self {
            config,
            server,
            client,
            client_endpoint: Arc::new(OnceCell::new()),
            socket_buffer: options.socket_buffer,
        })
    }

    async fn client_endpoint(&self) -> Result<&Endpoint, TransportError> {
        self.client_endpoint
            .get_or_try_init(|| async {
                let ip = self
                    .config
                    .bind_ip
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
                Endpoint::client(SocketAddr::new(ip, 0)).map_err(|e| TransportError::Listen {
                    addr: PeerAddr::new(format!("{ip}:0")),
                    source: Arc::new(e),
                })
            })
            .await
    }

    async fn dial(
        &self,
        addr: &PeerAddr,
    ) -> Result<(quinn::Connection, quinn::SendStream, quinn::RecvStream), TransportError> {
        let connect_err = |e: std::io::Error| TransportError::Connect {
            addr: addr.clone(),
            source: Arc::new(e),
        };
        let target: SocketAddr = tokio::net::lookup_host(addr.as_str())
            .await
            .map_err(connect_err)?
            .next()
            .ok_or_else(|| connect_err(std::io::Error::other("the address resolves to nothing")))?;
        let endpoint = self.client_endpoint().await?;
        let connecting = endpoint
            .connect_with(self.client.clone(), target, CLUSTER_SERVER_NAME)
            .map_err(|e| connect_err(std::io::Error::other(e)))?;
        let opened = async {
            let conn = connecting.await.map_err(|e| quic_failed(addr, &e))?;
            let (send, recv) = conn.open_bi().await.map_err(|e| quic_failed(addr, &e))?;
            Ok::<_, TransportError>((conn, send, recv))
        };
        // A dead peer answers nothing: its refusing port ends the dial early.
        let refused = async {
            if self.refuses(addr).await {
                connect_err(std::io::ErrorKind::ConnectionRefused.into())
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            opened = tokio::time::timeout(self.config.connect_timeout, opened) => match opened {
                Ok(result) => result,
                Err(_) => Err(TransportError::ConnectTimeout {
                    addr: addr.clone(),
                    after: self.config.connect_timeout,
                }),
            },
            e = refused => Err(e),
        }
    }
}

/// A quinn endpoint on a UDP socket with deep buffers.
fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
    buffer: usize,
) -> std::io::Result<Endpoint> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    // Best effort: the kernel caps these at net.core.{r,w}mem_max.
    let _ = socket.set_recv_buffer_size(buffer);
    let _ = socket.set_send_buffer_size(buffer);
    socket.bind(&addr.into())?;
    Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        socket.into(),
        Arc::new(quinn::TokioRuntime),
    )
}

fn quic_failed(addr: &PeerAddr, e: &quinn::ConnectionError) -> TransportError {
    match e {
        quinn::ConnectionError::TransportError(_) | quinn::ConnectionError::ConnectionClosed(_) => {
            tracing::warn!(peer_addr = %addr, error = %e, "QUIC handshake with peer failed; connection refused");
            TransportError::Tls(format!("QUIC connection to {addr} refused: {e}"))
        }
        other => TransportError::ConnectionLost {
            peer: addr.to_string(),
            reason: other.to_string(),
        },
    }
}

/// A QUIC stream half that keeps its connection (and endpoint) alive.
struct Keep<S> {
    stream: S,
    _conn: quinn::Connection,
}

impl AsyncWrite for Keep<quinn::SendStream> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.stream), cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.stream), cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.stream), cx)
    }
}

impl AsyncRead for Keep<quinn::RecvStream> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        AsyncRead::poll_read(Pin::new(&mut self.stream), cx, buf)
    }
}

async fn establish(
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    config: &TransportConfig,
    role: Role,
    addr: &PeerAddr,
) -> Result<Connection, TransportError> {
    let write = Keep {
        stream: send,
        _conn: conn.clone(),
    };
    let read = Keep {
        stream: recv,
        _conn: conn,
    };
    stream::establish(read, write, config, role, addr).await
}

#[async_trait]
impl Transport for QuicTransport {
    fn kind(&self) -> &'static str {
        "quic"
    }

    /// Sends one byte from a connected UDP socket: a QUIC endpoint drops it
    /// (too short to be a packet), but a host with no socket on that port
    /// answers ICMP port unreachable, which the connected socket reports as
    /// a refused connection.
    async fn refuses(&self, addr: &PeerAddr) -> bool {
        let probe = async {
            let target = tokio::net::lookup_host(addr.as_str()).await?.next();
            let Some(target) = target else {
                return Ok(false);
            };
            let local = match target {
                SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
            };
            let socket = tokio::net::UdpSocket::bind(local).await?;
            socket.connect(target).await?;
            socket.send(&[0]).await?;
            let mut buf = [0u8; 1];
            socket.recv(&mut buf).await.map(|_| false)
        };
        match tokio::time::timeout(PROBE_WAIT, probe).await {
            Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
            Ok(Ok(_)) | Err(_) => false,
        }
    }

    async fn listen(&self, addr: &PeerAddr) -> Result<Box<dyn Listener>, TransportError> {
        let listen_err = |e: std::io::Error| TransportError::Listen {
            addr: addr.clone(),
            source: Arc::new(e),
        };
        let socket_addr: SocketAddr = tokio::net::lookup_host(addr.as_str())
            .await
            .map_err(listen_err)?
            .next()
            .ok_or_else(|| listen_err(std::io::Error::other("the address resolves to nothing")))?;
        let endpoint = endpoint(socket_addr, Some(self.server.clone()), self.socket_buffer)
            .map_err(listen_err)?;
        let local = PeerAddr::from(endpoint.local_addr().map_err(listen_err)?);
        let (tx, rx) = mpsc::channel(64);
        let config = self.config.clone();
        let accept_endpoint = endpoint.clone();
        let mut slots = HandshakeSlots::new(local.clone(), config.max_pending_handshakes);
        let task = tokio::spawn(async move {
            while let Some(incoming) = accept_endpoint.accept().await {
                let addr = PeerAddr::from(incoming.remote_address());
                let Some(slot) = slots.admit(&addr) else {
                    incoming.refuse();
                    continue;
                };
                let config = config.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let accepted = async {
                        let conn = incoming.await.map_err(|e| quic_failed(&addr, &e))?;
                        let (send, recv) =
                            conn.accept_bi().await.map_err(|e| quic_failed(&addr, &e))?;
                        establish(conn, send, recv, &config, Role::Acceptor, &addr).await
                    };
                    let accepted =
                        tokio::time::timeout(config.handshake_timeout * 2, accepted).await;
                    drop(slot);
                    match accepted {
                        Ok(Ok(conn)) => {
                            let _ = tx.send(conn).await;
                        }
                        Ok(Err(_)) => {}
                        Err(_) => {
                            tracing::warn!(peer_addr = %addr, "QUIC peer handshake timed out; connection refused");
                        }
                    }
                });
            }
        });
        Ok(Box::new(ChannelListener::new(local, rx, task).on_drop(
            move || {
                endpoint.set_server_config(None);
            },
        )))
    }

    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError> {
        let (conn, send, recv) = self.dial(addr).await?;
        establish(conn, send, recv, &self.config, Role::Dialer, addr).await
    }
}
