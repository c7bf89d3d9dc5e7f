//! The transport conformance suite over the in-memory transport.

use std::sync::Arc;

use warren_transport::conformance::Harness;
use warren_transport::mem::MemNetwork;
use warren_transport::{NodeName, PeerAddr, Transport, TransportConfig};

struct Mem(MemNetwork);

impl Harness for Mem {
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport> {
        Arc::new(self.0.transport(config))
    }
    fn listen_addr(&self, node: &NodeName) -> PeerAddr {
        PeerAddr::new(format!("mem://{node}"))
    }
    fn dead_addr(&self) -> PeerAddr {
        PeerAddr::new("mem://nobody-here")
    }
}

warren_transport::conformance_tests!(Mem(MemNetwork::new(7)));

/// The same suite over the forwarding links' view of a multiplexed port.
mod muxed {
    use warren_transport::conformance::Muxed;
    use warren_transport::mux::Service;

    use super::*;

    warren_transport::conformance_tests!(Muxed(Mem(MemNetwork::new(7)), Service::Links));
}

warren_transport::mux_tests!(Mem(MemNetwork::new(7)));
