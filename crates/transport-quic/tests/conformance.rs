//! The transport conformance suite over QUIC, plus its certificate checks.

use std::sync::{Arc, LazyLock};

use warren_tls::ClusterCa;
use warren_transport::conformance::{Harness, SECRET, config, intruder_refused_by_tls};
use warren_transport::{NodeName, PeerAddr, Transport, TransportConfig};
use warren_transport_quic::{QuicOptions, QuicTransport};

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("conformance").expect("CA"));

struct Quic(QuicOptions);

impl Harness for Quic {
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport> {
        let id = CA.issue(config.node.as_str()).expect("node certificate");
        Arc::new(QuicTransport::new(config, &id, &self.0).expect("QUIC config"))
    }
    fn listen_addr(&self, _node: &NodeName) -> PeerAddr {
        PeerAddr::new("127.0.0.1:0")
    }
    fn dead_addr(&self) -> PeerAddr {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        PeerAddr::from(s.local_addr().expect("addr"))
    }
}

mod default_options {
    use super::*;
    warren_transport::conformance_tests!(Quic(QuicOptions::default()));
}

mod loopback_options {
    use super::*;
    warren_transport::conformance_tests!(Quic(QuicOptions::loopback()));
}

/// The suite and the multiplexer's tests over one service's view of a
/// multiplexed peer port.
mod muxed {
    use warren_transport::conformance::Muxed;
    use warren_transport::mux::Service;

    use super::*;

    warren_transport::conformance_tests!(Muxed(Quic(QuicOptions::loopback()), Service::Links));
    warren_transport::mux_tests!(Quic(QuicOptions::loopback()));
}

/// A node whose certificate comes from another CA is refused in the QUIC handshake.
#[tokio::test]
async fn certificate_from_another_ca_refused() {
    let id = ClusterCa::generate("other")
        .unwrap()
        .issue("intruder@suite")
        .unwrap();
    let intruder = QuicTransport::new(
        config("intruder@suite", SECRET, 1024),
        &id,
        &QuicOptions::default(),
    )
    .unwrap();
    intruder_refused_by_tls(&Quic(QuicOptions::default()), &intruder).await;
}

#[tokio::test]
async fn an_address_nobody_listens_on_refuses_and_a_live_endpoint_does_not() {
    let t = Quic(QuicOptions::default()).transport(config("prober@suite", "s", 1024));
    let live = Quic(QuicOptions::default()).transport(config("live@suite", "s", 1024));
    let l = live.listen(&PeerAddr::new("127.0.0.1:0")).await.unwrap();
    assert!(!t.refuses(&l.local_addr()).await, "a listening endpoint");
    // A UDP port that was bound and released: nothing listens there now.
    let gone = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = PeerAddr::from(gone.local_addr().unwrap());
    drop(gone);
    assert!(t.refuses(&addr).await, "a closed port");
    // The probe did not disturb the live endpoint: a connection still works.
    t.connect(&l.local_addr()).await.map(drop).unwrap();
}
