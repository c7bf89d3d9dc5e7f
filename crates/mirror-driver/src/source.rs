//! Where the driver reads and writes the cluster metadata: the
//! [`MetadataSource`] trait, its Raft-backed implementation on
//! [`Cluster`], and [`MemMetadata`], one in-memory store applying the same
//! commands for in-process tests.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use warren_cluster::{Cluster, ClusterError, Command, Metadata, Outcome};
use warren_transport::NodeName;

/// The cluster metadata as this node sees it, and the way to change it.
///
/// Everything the driver knows about the cluster comes from here: queue
/// records and policies (what to place where), nodes and their ring
/// addresses, the nodes seen up (the rings' failure detector), and the
/// compare-and-sets of queue records and ring views.
#[async_trait]
pub trait MetadataSource: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// This node's name.
    fn node(&self) -> &NodeName;
    /// The metadata as this node applied it: possibly stale, never blocks.
    fn local(&self) -> Arc<Metadata>;
    /// The metadata as of now (everything committed before the call).
    async fn read_linearizable(&self) -> Result<Arc<Metadata>, ClusterError>;
    /// Commits a command and returns its outcome.
    async fn write(&self, cmd: Command) -> Result<Outcome, ClusterError>;
    /// A receiver that changes whenever the metadata may have changed.
    fn changes(&self) -> watch::Receiver<u64>;
    /// The nodes seen up, this one included once it is.
    fn up_nodes(&self) -> watch::Receiver<BTreeSet<NodeName>>;
    /// How many times each other node was seen going down (a node that
    /// flapped between two looks at `up_nodes` has a higher count).
    fn downs(&self) -> watch::Receiver<BTreeMap<NodeName, u64>>;
    /// Whether this node sees a majority of the cluster (false: it is cut
    /// off in a minority, and its masters fail their publishes fast).
    fn majority(&self) -> watch::Receiver<bool>;
    /// [`local`](Self::local) with a number that grows with every change
    /// it reflects (the Raft log index), for [`replayed`](Self::replayed).
    fn local_at(&self) -> (Arc<Metadata>, u64) {
        let version = *self.changes().borrow();
        (self.local(), version)
    }
    /// Tells the metadata that this node's broker has taken in everything
    /// up to `index` (from [`local_at`](Self::local_at)), which
    /// [`write_everywhere`](Self::write_everywhere) waits for.
    fn replayed(&self, _index: u64) {}
    /// [`write`](Self::write), answered once every member up has taken
    /// the change in (or a bounded wait for one has passed).
    async fn write_everywhere(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        self.write(cmd).await
    }
}

#[async_trait]
impl MetadataSource for Cluster {
    fn node(&self) -> &NodeName {
        Cluster::node(self)
    }

    fn local(&self) -> Arc<Metadata> {
        Cluster::local(self)
    }

    async fn read_linearizable(&self) -> Result<Arc<Metadata>, ClusterError> {
        Cluster::read_linearizable(self).await
    }

    async fn write(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        Cluster::write(self, cmd).await
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.metadata_changes()
    }

    fn up_nodes(&self) -> watch::Receiver<BTreeSet<NodeName>> {
        Cluster::up_nodes(self)
    }

    fn downs(&self) -> watch::Receiver<BTreeMap<NodeName, u64>> {
        Cluster::downs(self)
    }

    fn majority(&self) -> watch::Receiver<bool> {
        Cluster::majority(self)
    }

    fn local_at(&self) -> (Arc<Metadata>, u64) {
        Cluster::local_at(self)
    }

    fn replayed(&self, index: u64) {
        Cluster::replayed(self, index);
    }

    async fn write_everywhere(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        Cluster::write_everywhere(self, cmd).await
    }
}

/// What the nodes of one [`MemMetadata`] share.
#[derive(Debug)]
struct Shared {
    metadata: Mutex<Arc<Metadata>>,
    changes: watch::Sender<u64>,
    up: watch::Sender<BTreeSet<NodeName>>,
    /// How many times each node left `up`.
    downs: watch::Sender<BTreeMap<NodeName, u64>>,
    /// How long a write or a linearizable read takes
    /// ([`MemMetadata::set_latency`]).
    latency: Mutex<Duration>,
}

/// Cluster metadata in memory, shared by the nodes of one process: commands
/// are applied at once with the Raft state machine's own
/// [`Metadata::apply`] (the same compare-and-sets and rejections), and the
/// set of nodes up is whatever the test says ([`MemMetadata::set_up`]).
/// Each node holds its own handle ([`MemMetadata::for_node`]).
#[derive(Debug, Clone)]
pub struct MemMetadata {
    node: NodeName,
    shared: Arc<Shared>,
    /// This node's view of the majority ([`MemMetadata::set_majority`]).
    majority: Arc<watch::Sender<bool>>,
    /// While this node is cut off from the majority ([`MemMetadata::cut_off`]):
    /// the metadata as it had applied it then.
    stale: Arc<Mutex<Option<Arc<Metadata>>>>,
    /// How long this node's writes take to commit
    /// ([`MemMetadata::set_write_latency`]).
    write_latency: Arc<Mutex<Duration>>,
}

/// How long a write or linearizable read of a node cut off from the
/// majority waits before it fails (a Raft node's waits 10 s).
const CUT_OFF_WAIT: Duration = Duration::from_secs(1);

impl MemMetadata {
    /// Empty metadata, seen from `node`.
    pub fn new(node: NodeName) -> Self {
        Self {
            node,
            shared: Arc::new(Shared {
                metadata: Mutex::new(Arc::new(Metadata::default())),
                changes: watch::Sender::new(0),
                up: watch::Sender::new(BTreeSet::new()),
                downs: watch::Sender::new(BTreeMap::new()),
                latency: Mutex::new(Duration::ZERO),
            }),
            majority: Arc::new(watch::Sender::new(true)),
            stale: Arc::default(),
            write_latency: Arc::default(),
        }
    }

    /// The same metadata, seen from `node`.
    #[must_use]
    pub fn for_node(&self, node: NodeName) -> Self {
        Self {
            node,
            shared: self.shared.clone(),
            majority: Arc::new(watch::Sender::new(true)),
            stale: Arc::default(),
            write_latency: Arc::default(),
        }
    }

    /// Applies `cmd` as a committed log entry would be.
    pub fn apply(&self, cmd: &Command) -> Result<Outcome, ClusterError> {
        let mut result = Ok(Outcome::Done);
        self.change(|m| {
            result = m.apply(cmd).result;
            result.is_ok()
        });
        result.map_err(ClusterError::Rejected)
    }

    /// Changes the metadata directly (cluster membership, which Raft keeps
    /// outside the command log).
    pub fn modify(&self, f: impl FnOnce(&mut Metadata)) {
        self.change(|m| {
            f(m);
            true
        });
    }

    /// Runs `f` on a copy of the metadata and keeps the copy (telling every
    /// node) if `f` says it changed.
    fn change(&self, f: impl FnOnce(&mut Metadata) -> bool) {
        let mut m = self
            .shared
            .metadata
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut next = Metadata::clone(&m);
        if f(&mut next) {
            *m = Arc::new(next);
            drop(m);
            self.shared.changes.send_modify(|v| *v += 1);
        }
    }

    /// Makes every write and linearizable read take `latency` (on the
    /// caller's clock), as Raft's round trips do. A write is applied
    /// halfway: a commit reaches the state machines some time after it was
    /// asked, and its answer the writer some time after that. A read sees
    /// the metadata as it is at its end. Zero (the default): at once.
    pub fn set_latency(&self, latency: Duration) {
        *self
            .shared
            .latency
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = latency;
    }

    fn latency(&self) -> Duration {
        *self
            .shared
            .latency
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets the nodes seen up.
    pub fn set_up(&self, up: BTreeSet<NodeName>) {
        let before = self.shared.up.borrow().clone();
        self.shared.downs.send_modify(|downs| {
            for n in before.difference(&up) {
                *downs.entry(n.clone()).or_default() += 1;
            }
        });
        self.shared.up.send_replace(up);
    }

    /// Says whether this node sees a majority (true from the start).
    pub fn set_majority(&self, majority: bool) {
        self.majority.send_replace(majority);
    }

    /// Makes this node's writes take `latency` to commit (a Raft leader's
    /// round trips under load, or a follower's forwarding), others' not.
    pub fn set_write_latency(&self, latency: Duration) {
        *self
            .write_latency
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = latency;
    }

    /// Cuts this node off from the majority (`true`), as a partition cuts
    /// a Raft node off, or joins it again: meanwhile it sees no majority,
    /// its view of the metadata stays as it was, and its writes and
    /// linearizable reads fail after a while. Joining again, it catches up
    /// at once.
    pub fn cut_off(&self, cut: bool) {
        let mut stale = self
            .stale
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *stale = cut.then(|| self.shared_now());
        drop(stale);
        self.majority.send_replace(!cut);
        if !cut {
            self.shared.changes.send_modify(|v| *v += 1);
        }
    }

    fn shared_now(&self) -> Arc<Metadata> {
        self.shared
            .metadata
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn is_cut_off(&self) -> bool {
        self.stale
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// Waits as a node cut off from the majority does, then fails `op` if
    /// it still is.
    async fn reach_majority(&self, op: &'static str) -> Result<(), ClusterError> {
        if !self.is_cut_off() {
            return Ok(());
        }
        tokio::time::sleep(CUT_OFF_WAIT).await;
        if self.is_cut_off() {
            return Err(ClusterError::NoMajority {
                op,
                waited: CUT_OFF_WAIT,
                voters: Vec::new(),
                unreachable: Vec::new(),
                maybe_applied: false,
            });
        }
        Ok(())
    }

    /// The nodes seen up.
    pub fn up_now(&self) -> BTreeSet<NodeName> {
        self.shared.up.borrow().clone()
    }
}

#[async_trait]
impl MetadataSource for MemMetadata {
    fn node(&self) -> &NodeName {
        &self.node
    }

    fn local(&self) -> Arc<Metadata> {
        if let Some(stale) = self
            .stale
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            return stale.clone();
        }
        self.shared_now()
    }

    async fn read_linearizable(&self) -> Result<Arc<Metadata>, ClusterError> {
        self.reach_majority("read").await?;
        let latency = self.latency();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        Ok(self.local())
    }

    async fn write(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        self.reach_majority("write").await?;
        let latency = *self
            .write_latency
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        self.apply(&cmd)
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    fn up_nodes(&self) -> watch::Receiver<BTreeSet<NodeName>> {
        self.shared.up.subscribe()
    }

    fn downs(&self) -> watch::Receiver<BTreeMap<NodeName, u64>> {
        self.shared.downs.subscribe()
    }

    fn majority(&self) -> watch::Receiver<bool> {
        self.majority.subscribe()
    }
}
