//! The same cluster over real sockets on 127.0.0.1: TCP and QUIC.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use warren_cluster::{Cluster, ClusterConfig, ClusterError};
use warren_tls::ClusterCa;
use warren_transport::conformance::config;
use warren_transport::{PeerAddr, Transport};
use warren_transport_quic::{QuicOptions, QuicTransport};
use warren_transport_tcp::TcpTransport;

use crate::harness::*;

#[derive(Clone, Copy)]
enum Kind {
    Tcp,
    Quic,
}

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("cluster-test").unwrap());

impl Kind {
    fn transport(self, name: &str) -> Arc<dyn Transport> {
        let cfg = config(name, "socket-secret", 1 << 20);
        match self {
            Kind::Tcp => Arc::new(TcpTransport::new(cfg)),
            Kind::Quic => {
                let id = CA.issue(name).unwrap();
                Arc::new(QuicTransport::new(cfg, &id, &QuicOptions::loopback()).unwrap())
            }
        }
    }

    /// A free port (bound, then released) for this transport.
    fn free_addr(self) -> PeerAddr {
        match self {
            Kind::Tcp => {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                PeerAddr::from(l.local_addr().unwrap())
            }
            Kind::Quic => {
                let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                PeerAddr::from(s.local_addr().unwrap())
            }
        }
    }

    fn config(
        self,
        name: &str,
        addr: &PeerAddr,
        dir: &std::path::Path,
        join: Option<&PeerAddr>,
    ) -> ClusterConfig {
        let mut c = ClusterConfig::new(n(name), addr.clone(), dir, self.transport(name));
        c.join = join.cloned();
        short_timeouts(&mut c);
        // Generous: TLS/QUIC on a loaded 2-core machine is slow; the bound
        // only matters for the final no-majority check.
        c.command_timeout = Duration::from_secs(8);
        c
    }
}

async fn start(cfg: ClusterConfig) -> Cluster {
    tokio::time::timeout(LIMIT, Cluster::start(cfg))
        .await
        .expect("start hung")
        .expect("start")
}

/// Three nodes; one crashes, the others carry on; it restarts at a new
/// address (as on a new host) and catches up; with two down, no majority.
async fn crash_and_restart_at_a_new_address(kind: Kind) {
    init_tracing();
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let addrs: Vec<PeerAddr> = (0..3).map(|_| kind.free_addr()).collect();
    let a = start(kind.config("a", &addrs[0], dirs[0].path(), None)).await;
    let b = start(kind.config("b", &addrs[1], dirs[1].path(), Some(&addrs[0]))).await;
    let c = start(kind.config("c", &addrs[2], dirs[2].path(), Some(&addrs[0]))).await;
    c.write(vhost("/")).await.unwrap();
    assert!(b.read_linearizable().await.unwrap().vhosts.contains("/"));

    c.shutdown().await;
    write_eventually(&b, vhost("while-c-down")).await;

    let new_addr = kind.free_addr();
    let c = start(kind.config("c", &new_addr, dirs[2].path(), None)).await;
    eventually(&c, "the write made while it was down", |m| {
        m.vhosts.contains("while-c-down")
    })
    .await;
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let status = a.cluster_status();
        let rec = status.members.iter().find(|m| m.name == "c").unwrap();
        if rec.addr == new_addr.as_str() && rec.voter {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    write_eventually(&c, vhost("from-c")).await;
    assert!(
        a.read_linearizable()
            .await
            .unwrap()
            .vhosts
            .contains("from-c")
    );

    b.shutdown().await;
    c.shutdown().await;
    let err = a.write(vhost("lost")).await.unwrap_err();
    assert!(matches!(err, ClusterError::NoMajority { .. }), "{err}");
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t40_three_nodes_over_tcp_crash_and_restart_at_a_new_address() {
    crash_and_restart_at_a_new_address(Kind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t41_three_nodes_over_quic_crash_and_restart_at_a_new_address() {
    crash_and_restart_at_a_new_address(Kind::Quic).await;
}
