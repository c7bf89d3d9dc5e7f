//! Mirrored queues on a clustered node: the mirror driver
//! ([`warren_mirror_driver::MirrorDriver`]: the GM node, the reconciler and
//! one task per replica) over this node's Raft metadata store.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use anyhow::Context as _;
use warren_cluster::Cluster;
use warren_gm::NodeConfig;
use warren_mirror_driver::{DriverConfig, MirrorDriver};
use warren_transport::{PeerAddr, Transport};

use crate::Shared;

/// The mirroring side of a clustered node.
pub(crate) type Mirroring = MirrorDriver<Cluster>;

/// Starts the GM node on `bind_ip` (any port), records its address and
/// `link_addr` in the cluster and starts the reconciler (on the caller's
/// runtime).
pub(crate) async fn start(
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
    bind_ip: IpAddr,
    link_addr: String,
) -> anyhow::Result<Arc<Mirroring>> {
    let listen = PeerAddr::new(SocketAddr::new(bind_ip, 0).to_string());
    let gm = NodeConfig::new(cluster.node().clone(), listen);
    MirrorDriver::start(cluster, transport, broker, DriverConfig::new(gm, link_addr))
        .await
        .context("starting the queue rings' GM node")
}
