//! Mirrored queues on a clustered node: the mirror driver
//! ([`warren_mirror_driver::MirrorDriver`]: the GM node, the reconciler and
//! one task per replica) over this node's Raft metadata store.

use std::sync::Arc;

use anyhow::Context as _;
use warren_cluster::Cluster;
use warren_gm::NodeConfig;
use warren_mirror_driver::{DriverConfig, MirrorDriver};
use warren_transport::Transport;

use crate::Shared;

/// The mirroring side of a clustered node.
pub(crate) type Mirroring = MirrorDriver<Cluster>;

/// Starts the GM node on the node's peer port (the rings' view of it,
/// `transport`), records the port as its ring and link address in the
/// cluster and starts the reconciler (on the caller's runtime).
pub(crate) async fn start(
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
) -> anyhow::Result<Arc<Mirroring>> {
    let port = cluster.peer_addr().clone();
    let gm = NodeConfig::new(cluster.node().clone(), port.clone());
    MirrorDriver::start(
        cluster,
        transport,
        broker,
        DriverConfig::new(gm, port.to_string()),
    )
    .await
    .context("starting the queue rings' GM node")
}
