//! Shared set-up for Warren's criterion benches: connected pairs over every transport.

use std::sync::Arc;

use warren_tls::ClusterCa;
use warren_transport::mem::MemNetwork;
use warren_transport::{
    ClusterSecret, Connection, Listener, NodeName, PeerAddr, Transport, TransportConfig,
};
use warren_transport_quic::{QuicOptions, QuicTransport};
use warren_transport_tcp::TcpTransport;

/// The transports the benches compare, in table order.
pub const KINDS: [&str; 4] = ["mem", "tcp", "tcp+tls", "quic"];

/// Builds transports of one kind for bench nodes.
#[derive(Debug)]
pub struct Fabric {
    kind: &'static str,
    ca: ClusterCa,
    net: MemNetwork,
}

impl Fabric {
    /// A fabric for `kind` (one of [`KINDS`]).
    pub fn new(kind: &'static str) -> Self {
        Self {
            kind,
            ca: ClusterCa::generate("bench").expect("bench CA"),
            net: MemNetwork::new(0),
        }
    }

    /// A transport for node `name`.
    pub fn transport(&self, name: &str) -> Arc<dyn Transport> {
        let node = NodeName::new(name).expect("bench node name");
        let config = TransportConfig::new(node, ClusterSecret::new("bench-secret"));
        match self.kind {
            "mem" => Arc::new(self.net.transport(config)),
            "tcp" => Arc::new(TcpTransport::new(config)),
            "tcp+tls" => {
                let id = self.ca.issue(name).expect("bench certificate");
                Arc::new(TcpTransport::with_tls(config, &id).expect("TLS config"))
            }
            "quic" => {
                let id = self.ca.issue(name).expect("bench certificate");
                let options = QuicOptions::loopback();
                Arc::new(QuicTransport::new(config, &id, &options).expect("QUIC config"))
            }
            other => panic!("unknown transport kind {other}"),
        }
    }

    /// The address a listener of node `name` binds.
    pub fn listen_addr(&self, name: &str) -> PeerAddr {
        match self.kind {
            "mem" => PeerAddr::new(name),
            _ => PeerAddr::new("127.0.0.1:0"),
        }
    }

    /// A connected (client, server) pair, plus the listener that must outlive them.
    pub async fn pair(&self) -> (Connection, Connection, Box<dyn Listener>) {
        let server = self.transport("server@bench");
        let mut listener = server
            .listen(&self.listen_addr("server@bench"))
            .await
            .expect("listen");
        let client = self.transport("client@bench");
        let addr = listener.local_addr();
        let (c, s) = tokio::join!(client.connect(&addr), listener.accept());
        (c.expect("connect"), s.expect("accept"), listener)
    }
}
