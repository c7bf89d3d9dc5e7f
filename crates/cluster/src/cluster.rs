//! The [`Cluster`] handle: start, join, leave, forget, status, reads and writes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use openraft::{ChangeMembers, ServerState, Snapshot, SnapshotPolicy};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use warren_transport::{PeerAddr, Transport};
use warren_wire::NodeName;

use crate::error::ClusterError;
use crate::peers::{CallError, Peers};
use crate::rpc::{AdminRequest, AdminResponse, Network, Request, Response};
use crate::state::{Command, Metadata, Outcome, QueueRecord, QueueView, RingRecord};
use crate::store::{LogStore, StateMachine, raft_dir};
use crate::types::{NodeId, PeerNode, Raft, node_id};

mod dead_leader;
use dead_leader::stand_against_a_dead_leader;

/// How a node runs its part of the cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's name (must match the transport's configured name).
    pub node: NodeName,
    /// The address to listen on for peers; what the listener reports is what
    /// peers are told to dial.
    pub peer_addr: PeerAddr,
    /// The node's data directory (the Raft log and snapshots go in `raft/`).
    pub data_dir: PathBuf,
    /// A running member to join on first start (ignored once the node has
    /// cluster state). `None` on first start bootstraps a new one-node cluster.
    pub join: Option<PeerAddr>,
    /// The transport to peers.
    pub transport: Arc<dyn Transport>,
    /// Raft leader heartbeat interval.
    pub raft_heartbeat_interval: Duration,
    /// Raft election timeout, lower bound (randomised up to the upper bound).
    pub election_timeout_min: Duration,
    /// Raft election timeout, upper bound.
    pub election_timeout_max: Duration,
    /// The longest any operation needing a majority waits before failing
    /// with [`ClusterError::NoMajority`].
    pub command_timeout: Duration,
    /// How often the failure detector sends heartbeats to each member.
    pub heartbeat_interval: Duration,
    /// A member not heard from for this long is reported down.
    pub failure_timeout: Duration,
    /// Boot wait per try (RabbitMQ's `mnesia_table_loading_retry_timeout`, 30 s).
    pub boot_wait_timeout: Duration,
    /// Boot wait tries (RabbitMQ's `mnesia_table_loading_retry_limit`, 10).
    pub boot_wait_retries: u32,
    /// How often a waiting boot logs which nodes it waits for.
    pub boot_log_interval: Duration,
    /// Take a snapshot (and compact the log) after this many entries.
    pub snapshot_every: u64,
}

impl ClusterConfig {
    /// Production defaults: 250 ms Raft heartbeats, 1–2 s elections, 10 s
    /// command timeout, 500 ms failure-detector heartbeats with a 3 s
    /// timeout (a refused connection is seen at once),
    /// a 10 × 30 s boot wait logged every 5 s, snapshots every 1000 entries.
    pub fn new(
        node: NodeName,
        peer_addr: PeerAddr,
        data_dir: impl Into<PathBuf>,
        transport: Arc<dyn Transport>,
    ) -> Self {
        Self {
            node,
            peer_addr,
            data_dir: data_dir.into(),
            join: None,
            transport,
            raft_heartbeat_interval: Duration::from_millis(250),
            election_timeout_min: Duration::from_millis(1000),
            election_timeout_max: Duration::from_millis(2000),
            command_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_millis(500),
            failure_timeout: Duration::from_secs(3),
            boot_wait_timeout: Duration::from_secs(30),
            boot_wait_retries: 10,
            boot_log_interval: Duration::from_secs(5),
            snapshot_every: 1000,
        }
    }

    /// The whole boot wait: tries × per-try timeout.
    pub fn boot_wait_limit(&self) -> Duration {
        self.boot_wait_timeout * self.boot_wait_retries
    }

    fn raft_config(&self) -> Result<openraft::Config, ClusterError> {
        let ms = |d: Duration| d.as_millis().max(1) as u64;
        openraft::Config {
            cluster_name: "warren".into(),
            heartbeat_interval: ms(self.raft_heartbeat_interval),
            election_timeout_min: ms(self.election_timeout_min),
            election_timeout_max: ms(self.election_timeout_max),
            install_snapshot_timeout: ms(self.command_timeout),
            snapshot_policy: SnapshotPolicy::LogsSinceLast(self.snapshot_every.max(1)),
            max_in_snapshot_log_to_keep: self.snapshot_every.max(1),
            ..Default::default()
        }
        .validate()
        .map_err(|e| ClusterError::Config(e.to_string()))
    }
}

/// A change in a member's liveness, as the failure detector sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEvent {
    /// The member answers again (or for the first time).
    Up(NodeName),
    /// The member was not heard from within the failure timeout.
    Down(NodeName),
}

/// One member in [`ClusterStatus`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// The node name.
    pub name: String,
    /// Its peer address.
    pub addr: String,
    /// Whether it votes (a member that left gracefully is a non-voting learner
    /// until it starts again).
    pub voter: bool,
    /// Whether it is running, as this node's failure detector sees it.
    pub running: bool,
}

/// What `cluster_status` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterStatus {
    /// The node that answered.
    pub node: String,
    /// The current Raft leader, if known.
    pub leader: Option<String>,
    /// Every member, voters and learners, by name.
    pub members: Vec<MemberStatus>,
    /// The running members (this node included).
    pub running: Vec<String>,
}

struct Inner {
    config: ClusterConfig,
    id: NodeId,
    addr: PeerAddr,
    raft: Raft,
    sm: StateMachine,
    peers: Peers,
    events: broadcast::Sender<NodeEvent>,
    up: watch::Sender<BTreeSet<NodeName>>,
    /// How many times the failure detector has seen each node go down
    /// ([`Cluster::downs`]).
    downs: watch::Sender<BTreeMap<NodeName, u64>>,
    /// Whether this node sees a majority of the voters up (itself included).
    majority: watch::Sender<bool>,
    /// When this process started the cluster side (see the majority check).
    started: Instant,
    /// The log index up to which this node's user of the metadata (the
    /// broker) has taken in the changes ([`Cluster::local_at`],
    /// [`Cluster::replayed`]); `None` until it says so the first time.
    replayed: watch::Sender<Option<u64>>,
    /// Linearizable reads share leader round trips ([`Cluster::read_index`]):
    /// the newest that finished, (its number, the read index it gave).
    read_rounds: tokio::sync::Mutex<Option<(u64, u64)>>,
    /// How many such round trips were started.
    read_rounds_started: std::sync::atomic::AtomicU64,
    /// Writes waiting to go to the leader together ([`Cluster::write`]).
    writes: Mutex<Writes>,
    stop: watch::Sender<bool>,
    stopped: Mutex<bool>,
}

/// A running node's handle on the cluster; cheap to clone.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("node", &self.inner.config.node)
            .field("addr", &self.inner.addr)
            .finish_non_exhaustive()
    }
}

/// A write's answer: its outcome and log index.
type Written = Result<(Outcome, u64), ClusterError>;

/// Writes waiting to go to the leader ([`Cluster::write`]).
#[derive(Default)]
struct Writes {
    /// Each with the sender its answer goes to.
    queued: Vec<(Command, tokio::sync::oneshot::Sender<Written>)>,
    /// Whether a task is sending them.
    sending: bool,
    /// How many went to the leader on their own or in a batch.
    round_trips: u64,
}

/// The most writes sent to the leader as one batch.
const WRITE_BATCH_MAX: usize = 256;

fn stopped<E: std::fmt::Display>(e: E) -> ClusterError {
    ClusterError::Stopped(e.to_string())
}

impl Cluster {
    /// Starts this node's part of the cluster.
    ///
    /// - First start without `join`: bootstraps a one-node cluster.
    /// - First start with `join`: joins through that member (as a learner that
    ///   catches up, then as a voter); retries until the boot wait runs out.
    /// - Restart (the data directory has state): waits until a leader is
    ///   known, i.e. a majority of the voters is up, logging every
    ///   `boot_log_interval` which members it waits for; after the boot wait
    ///   it fails with [`ClusterError::BootTimeout`] naming them. A member
    ///   that had left gracefully then asks to be a voter again.
    pub async fn start(config: ClusterConfig) -> Result<Cluster, ClusterError> {
        let dir = raft_dir(&config.data_dir);
        std::fs::create_dir_all(&dir).map_err(|e| ClusterError::io(&dir, e))?;
        let log = LogStore::open(&dir).map_err(|e| ClusterError::io(&dir, e))?;
        let sm = StateMachine::open(&dir).map_err(|e| ClusterError::io(&dir, e))?;
        let fresh = !log.has_state() && sm.read().last_applied.is_none();
        let raft_config = Arc::new(config.raft_config()?);
        let listener = config.transport.listen(&config.peer_addr).await?;
        let addr = listener.local_addr();
        let id = node_id(&config.node);
        let peers = Peers::new(
            config.node.clone(),
            config.transport.clone(),
            config.failure_timeout,
        );
        let network = Network {
            peers: peers.clone(),
            backoff: config
                .raft_heartbeat_interval
                .max(Duration::from_millis(20)),
        };
        let raft = Raft::new(id, raft_config, network, log, sm.clone())
            .await
            .map_err(stopped)?;
        let (events, _) = broadcast::channel(256);
        let (up, _) = watch::channel(BTreeSet::new());
        let (downs, _) = watch::channel(BTreeMap::new());
        let (majority, _) = watch::channel(true);
        let (replayed, _) = watch::channel(None);
        let (stop, _) = watch::channel(false);
        let cluster = Cluster {
            inner: Arc::new(Inner {
                config,
                id,
                addr,
                raft,
                sm,
                peers: peers.clone(),
                events,
                up,
                downs,
                majority,
                started: Instant::now(),
                replayed,
                read_rounds: tokio::sync::Mutex::new(None),
                read_rounds_started: std::sync::atomic::AtomicU64::new(0),
                writes: Mutex::new(Writes::default()),
                stop,
                stopped: Mutex::new(false),
            }),
        };
        let weak = Arc::downgrade(&cluster.inner);
        peers.set_handler(Arc::new(move |from, req| {
            let weak = weak.clone();
            Box::pin(async move { handle(weak, from, req).await })
        }));
        peers.serve(listener);
        tokio::spawn(detector(Arc::downgrade(&cluster.inner)));
        tracing::info!(node = %cluster.inner.config.node, addr = %cluster.inner.addr, fresh, "cluster node starting");

        let booted = if fresh {
            match cluster.inner.config.join.clone() {
                None => cluster.bootstrap().await,
                Some(seed) => cluster.join_via(&seed).await,
            }
        } else {
            cluster.boot_wait().await
        };
        if let Err(e) = booted {
            tracing::error!(node = %cluster.inner.config.node, error = %e, "cluster node failed to start");
            cluster.shutdown().await;
            return Err(e);
        }
        tracing::info!(node = %cluster.inner.config.node, "cluster node running");
        Ok(cluster)
    }

    /// This node's name.
    pub fn node(&self) -> &NodeName {
        &self.inner.config.node
    }

    /// The address peers dial to reach this node.
    pub fn peer_addr(&self) -> &PeerAddr {
        &self.inner.addr
    }

    /// The metadata as this node has applied it: possibly stale, never blocks.
    pub fn local(&self) -> Arc<Metadata> {
        self.inner.sm.read().metadata.clone()
    }

    /// [`Cluster::local`] with the log index it reflects.
    pub fn local_at(&self) -> (Arc<Metadata>, u64) {
        let st = self.inner.sm.read();
        (st.metadata.clone(), st.last_applied.map_or(0, |l| l.index))
    }

    /// Tells the cluster that this node's user of the metadata has taken in
    /// everything up to `index` (from [`Cluster::local_at`]). From the first
    /// call on, [`Cluster::write_everywhere`] waits on each member for this
    /// rather than for its Raft state machine alone.
    pub fn replayed(&self, index: u64) {
        self.inner.replayed.send_if_modified(|r| match r {
            Some(i) if *i >= index => false,
            _ => {
                *r = Some(index);
                true
            }
        });
    }

    /// The metadata as of now: confirms with a majority (through the leader)
    /// and waits until this node has applied everything committed before the
    /// call. Fails with [`ClusterError::NoMajority`] in a minority.
    pub async fn read_linearizable(&self) -> Result<Arc<Metadata>, ClusterError> {
        let deadline = Instant::now() + self.inner.config.command_timeout;
        let index = self.read_index(deadline).await?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        self.inner
            .raft
            .wait(Some(remaining.max(Duration::from_millis(1))))
            .applied_index_at_least(Some(index), "linearizable read")
            .await
            .map_err(|_| self.no_majority("linearizable read", false))?;
        Ok(self.local())
    }

    /// How many round trips to the leader this node's linearizable reads
    /// have started ([`Cluster::read_linearizable`]; reads at once share
    /// them).
    pub fn read_round_trips(&self) -> u64 {
        self.inner
            .read_rounds_started
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The leader's commit index as of a moment after this call (Raft's
    /// ReadIndex). Reads at once share round trips to the leader: one that
    /// comes while a round trip runs waits for it to end, and then takes
    /// the answer of the next, which one of the waiting reads makes for all
    /// of them (each round trip costs the leader a heartbeat to every
    /// follower: a failover of many queues reads once per ring).
    async fn read_index(&self, deadline: Instant) -> Result<u64, ClusterError> {
        use std::sync::atomic::Ordering;
        // A round trip numbered above this one started after this call.
        let after = self.inner.read_rounds_started.load(Ordering::SeqCst);
        let Ok(mut last) = tokio::time::timeout_at(deadline, self.inner.read_rounds.lock()).await
        else {
            return Err(self.no_majority("linearizable read", false));
        };
        if let Some((n, index)) = *last
            && n > after
        {
            return Ok(index);
        }
        let n = self
            .inner
            .read_rounds_started
            .fetch_add(1, Ordering::SeqCst)
            + 1;
        let index = match self
            .to_leader("linearizable read", AdminRequest::ReadIndex, deadline)
            .await?
        {
            AdminResponse::ReadIndex(i) => i,
            other => return Err(self.unexpected(other)),
        };
        *last = Some((n, index));
        Ok(index)
    }

    /// Commits a command through the leader and returns its outcome.
    ///
    /// When it returns, this node has normally applied the command too, so
    /// [`Cluster::local`] shows it (read your writes); only if this node lags
    /// the leader by more than what is left of `command_timeout` does it
    /// return first (the command is committed either way).
    ///
    /// A command is handed to a leader at most once (never retried after it
    /// may have reached one), so it never commits twice. In a minority this
    /// fails with [`ClusterError::NoMajority`] after `command_timeout`.
    ///
    /// Writes at once go to the leader together: one that comes while
    /// others are on their way waits for them and goes with the others that
    /// came meanwhile, as one [`Command::Batch`] (each applied as if on its
    /// own, in order; one log entry, one fsync). A failover of many queues
    /// changes each one's ring and record.
    pub async fn write(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start = {
            let mut w = self.writes();
            w.queued.push((cmd, tx));
            !std::mem::replace(&mut w.sending, true)
        };
        if start {
            // A task of its own: the batches go on if this caller stops
            // waiting.
            let me = self.clone();
            tokio::spawn(async move { me.send_writes().await });
        }
        match rx.await {
            Ok(r) => r.map(|(outcome, _)| outcome),
            Err(_) => Err(ClusterError::Stopped("the node is stopping".into())),
        }
    }

    /// The writes waiting to go to the leader.
    fn writes(&self) -> std::sync::MutexGuard<'_, Writes> {
        self.inner
            .writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends the queued writes to the leader, a batch at a time, until
    /// none is left.
    async fn send_writes(&self) {
        loop {
            let batch = {
                let mut w = self.writes();
                if w.queued.is_empty() {
                    w.sending = false;
                    return;
                }
                w.round_trips += 1;
                let n = w.queued.len().min(WRITE_BATCH_MAX);
                w.queued.drain(..n).collect::<Vec<_>>()
            };
            let (mut cmds, answers): (Vec<Command>, Vec<_>) = batch.into_iter().unzip();
            if cmds.len() == 1
                && let Some(cmd) = cmds.pop()
            {
                let r = self.write_at(cmd).await;
                for a in answers {
                    let _ = a.send(r.clone());
                }
                continue;
            }
            let n = cmds.len();
            match self.write_at(Command::Batch(cmds)).await {
                Ok((Outcome::Batch(results), index)) if results.len() == n => {
                    for (a, r) in answers.into_iter().zip(results) {
                        let _ = a.send(r.map(|o| (o, index)).map_err(ClusterError::Rejected));
                    }
                }
                Ok((other, _)) => {
                    let e =
                        ClusterError::Remote(format!("unexpected outcome of a batch: {other:?}"));
                    for a in answers {
                        let _ = a.send(Err(e.clone()));
                    }
                }
                Err(e) => {
                    for a in answers {
                        let _ = a.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// How many round trips to the leader this node's writes made
    /// ([`Cluster::write`]; writes at once share them).
    pub fn write_round_trips(&self) -> u64 {
        self.writes().round_trips
    }

    /// Commits a client's change (a declare, a bind, a policy) as
    /// [`Cluster::write`] does, then waits until every other running member
    /// has applied it too (each at most 500 ms), as RabbitMQ
    /// answers `declare-ok` once every node's schema has the queue: a client
    /// that uses it through another node right after finds it there.
    pub async fn write_everywhere(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        let (outcome, index) = self.write_at(cmd).await?;
        let members = other_members(&self.inner, &self.inner.raft.metrics().borrow());
        let up = self.inner.up.borrow().clone();
        let mut asks = tokio::task::JoinSet::new();
        for (_, name, addr) in members {
            if !up.contains(&name) {
                continue;
            }
            let peers = self.inner.peers.clone();
            asks.spawn(async move {
                let req = Request::Applied { index };
                let answered = peers
                    .call(Some(&name), &addr, req, APPLIED_WAIT + APPLIED_WAIT)
                    .await;
                if !matches!(answered, Ok(Response::Applied(true))) {
                    tracing::debug!(peer = %name, index, "a running member did not confirm it applied a change");
                }
            });
        }
        while asks.join_next().await.is_some() {}
        Ok(outcome)
    }

    async fn write_at(&self, cmd: Command) -> Result<(Outcome, u64), ClusterError> {
        let deadline = Instant::now() + self.inner.config.command_timeout;
        match self
            .to_leader("write", AdminRequest::Write(cmd), deadline)
            .await?
        {
            AdminResponse::Written(r, index) => {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                if self
                    .inner
                    .raft
                    .wait(Some(left))
                    .applied_index_at_least(Some(index), "write applied here")
                    .await
                    .is_err()
                {
                    tracing::warn!(node = %self.inner.config.node, index, "committed, but not yet applied on this node");
                }
                r.result.map(|o| (o, index)).map_err(ClusterError::Rejected)
            }
            other => Err(self.unexpected(other)),
        }
    }

    /// Compare-and-set on a queue's view: applies `view` if the queue is
    /// still the declaration `serial` and its view still at
    /// `expected_version` ([`Command::SetQueueView`]).
    pub async fn set_queue_view(
        &self,
        vhost: &str,
        name: &str,
        serial: u64,
        expected_version: u64,
        view: QueueView,
    ) -> Result<QueueRecord, ClusterError> {
        match self
            .write(Command::SetQueueView {
                vhost: vhost.into(),
                name: name.into(),
                serial,
                expected_version,
                view,
            })
            .await?
        {
            Outcome::Queue(q) => Ok(q),
            other => Err(ClusterError::Remote(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// Compare-and-set on a GM ring's view (opaque bytes, see
    /// [`Command::SetRingView`]); a GM `ViewAuthority` maps onto this and
    /// [`Metadata::rings`].
    pub async fn set_ring_view(
        &self,
        ring: &str,
        expected_version: u64,
        view: Vec<u8>,
    ) -> Result<RingRecord, ClusterError> {
        match self
            .write(Command::SetRingView {
                ring: ring.into(),
                expected_version,
                view,
            })
            .await?
        {
            Outcome::Ring(r) => Ok(r),
            other => Err(ClusterError::Remote(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// Members, leader and running nodes.
    pub fn cluster_status(&self) -> ClusterStatus {
        let m = self.inner.raft.metrics().borrow().clone();
        let up = self.inner.up.borrow().clone();
        let voters: BTreeSet<NodeId> = m.membership_config.voter_ids().collect();
        let mut members: Vec<MemberStatus> = m
            .membership_config
            .nodes()
            .map(|(id, n)| MemberStatus {
                name: n.name.clone(),
                addr: n.addr.clone(),
                voter: voters.contains(id),
                running: *id == self.inner.id
                    || NodeName::new(n.name.clone()).is_ok_and(|nn| up.contains(&nn)),
            })
            .collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        let leader = m.current_leader.and_then(|l| {
            m.membership_config
                .membership()
                .get_node(&l)
                .map(|n| n.name.clone())
        });
        let running = members
            .iter()
            .filter(|m| m.running)
            .map(|m| m.name.clone())
            .collect();
        ClusterStatus {
            node: self.inner.config.node.to_string(),
            leader,
            members,
            running,
        }
    }

    /// Node up/down events from the failure detector.
    pub fn subscribe(&self) -> broadcast::Receiver<NodeEvent> {
        self.inner.events.subscribe()
    }

    /// The set of other members the failure detector sees as up.
    pub fn up_nodes(&self) -> watch::Receiver<BTreeSet<NodeName>> {
        self.inner.up.subscribe()
    }

    /// How many times the failure detector has seen each other member go
    /// down: a node that came up and went down again between two looks
    /// at [`up_nodes`](Self::up_nodes) has a higher count.
    pub fn downs(&self) -> watch::Receiver<BTreeMap<NodeName, u64>> {
        self.inner.downs.subscribe()
    }

    /// Whether this node sees a majority of the voters up, itself included
    /// (true at start): false from the failure timeout after a partition
    /// left it in a minority, true again once the majority answers.
    pub fn majority(&self) -> watch::Receiver<bool> {
        self.inner.majority.subscribe()
    }

    /// A receiver that changes whenever this node applies new entries (or
    /// installs a snapshot): re-read [`Cluster::local`] then.
    pub fn metadata_changes(&self) -> watch::Receiver<u64> {
        self.inner.sm.subscribe()
    }

    /// Removes a stopped member from the cluster (RabbitMQ's
    /// `forget_cluster_node`). Its queue places are dropped: a queue mastered
    /// there gets its oldest synchronised mirror as master, or is deleted if
    /// it has none. Needs a majority.
    pub async fn forget_cluster_node(&self, node: &NodeName) -> Result<(), ClusterError> {
        if node == &self.inner.config.node {
            return Err(ClusterError::ForgetSelf);
        }
        if self.inner.up.borrow().contains(node) {
            return Err(ClusterError::NodeRunning(node.to_string()));
        }
        let deadline = Instant::now() + self.inner.config.command_timeout;
        match self
            .to_leader(
                "forget_cluster_node",
                AdminRequest::Forget {
                    name: node.to_string(),
                },
                deadline,
            )
            .await?
        {
            AdminResponse::Done => {
                tracing::warn!(node = %self.inner.config.node, forgotten = %node, "forgot cluster node");
                Ok(())
            }
            other => Err(self.unexpected(other)),
        }
    }

    /// Graceful stop: hands off before stopping so the others keep a majority.
    ///
    /// A voter that is not the last one turns itself into a non-voting member
    /// (committed while the others can still commit) and, if it was the
    /// leader, asks another voter to take over at once. The last voter stays a
    /// voter: it is the last node to stop and may start first. Either way the
    /// node then stops; an error means the hand-off did not happen (the node
    /// still stopped).
    pub async fn leave(&self) -> Result<(), ClusterError> {
        let result = self.hand_off().await;
        if let Err(e) = &result {
            tracing::warn!(node = %self.inner.config.node, error = %e, "graceful hand-off failed; stopping anyway");
        }
        self.inner
            .peers
            .say_leaving(self.inner.config.raft_heartbeat_interval)
            .await;
        self.shutdown().await;
        result
    }

    async fn hand_off(&self) -> Result<(), ClusterError> {
        let m = self.inner.raft.metrics().borrow().clone();
        let voters: Vec<NodeId> = m.membership_config.voter_ids().collect();
        if !voters.contains(&self.inner.id) {
            return Ok(());
        }
        if voters.len() == 1 {
            tracing::info!(node = %self.inner.config.node, "last voting member stopping; it must be the first to start");
            return Ok(());
        }
        let was_leader = m.current_leader == Some(self.inner.id);
        let deadline = Instant::now() + self.inner.config.command_timeout;
        match self
            .to_leader(
                "leave",
                AdminRequest::Demote {
                    name: self.inner.config.node.to_string(),
                },
                deadline,
            )
            .await?
        {
            AdminResponse::Done => {}
            other => return Err(self.unexpected(other)),
        }
        tracing::info!(node = %self.inner.config.node, "left the voting members");
        if was_leader {
            let m = self.inner.raft.metrics().borrow().clone();
            let next = m
                .membership_config
                .voter_ids()
                .find(|v| *v != self.inner.id)
                .and_then(|v| m.membership_config.membership().get_node(&v).cloned());
            if let Some(n) = next
                && let Ok(name) = NodeName::new(n.name.clone())
            {
                let _ = self
                    .inner
                    .peers
                    .call(
                        Some(&name),
                        &PeerAddr::new(n.addr.clone()),
                        Request::Admin(AdminRequest::Elect),
                        self.inner.config.raft_heartbeat_interval * 4,
                    )
                    .await;
            }
        }
        Ok(())
    }

    /// Resolves, with the error, once this node's Raft has stopped on a
    /// fault: openraft stops its core on any storage error (a full or
    /// failing disk), after which the node can neither commit metadata nor
    /// learn the cluster's. Never resolves otherwise, [`shutdown`](Self::shutdown) included.
    pub async fn failed(&self) -> String {
        let mut metrics = self.inner.raft.metrics();
        loop {
            if let Err(e) = &metrics.borrow_and_update().running_state
                && !matches!(e, openraft::error::Fatal::Stopped)
            {
                return e.to_string();
            }
            if metrics.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Stops the node at once (no hand-off): Raft, connections, the failure
    /// detector. Safe to call more than once.
    pub async fn shutdown(&self) {
        {
            let mut s = self.inner.stopped.lock().unwrap_or_else(|e| e.into_inner());
            if *s {
                return;
            }
            *s = true;
        }
        self.inner.stop.send_replace(true);
        if tokio::time::timeout(Duration::from_secs(5), self.inner.raft.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(node = %self.inner.config.node, "raft did not stop within 5 s");
        }
        self.inner.peers.stop().await;
        tracing::info!(node = %self.inner.config.node, "cluster node stopped");
    }

    fn unexpected(&self, r: AdminResponse) -> ClusterError {
        ClusterError::Remote(format!("unexpected answer from the leader: {r:?}"))
    }

    fn voter_names(&self) -> Vec<String> {
        let m = self.inner.raft.metrics().borrow().clone();
        let mut names: Vec<String> = m
            .membership_config
            .voter_ids()
            .filter_map(|v| {
                m.membership_config
                    .membership()
                    .get_node(&v)
                    .map(|n| n.name.clone())
            })
            .collect();
        names.sort();
        names
    }

    fn down_voters(&self) -> Vec<String> {
        let up = self.inner.up.borrow().clone();
        let me = self.inner.config.node.to_string();
        self.voter_names()
            .into_iter()
            .filter(|n| n != &me && !NodeName::new(n.clone()).is_ok_and(|nn| up.contains(&nn)))
            .collect()
    }

    fn no_majority(&self, op: &'static str, maybe_applied: bool) -> ClusterError {
        ClusterError::NoMajority {
            op,
            waited: self.inner.config.command_timeout,
            voters: self.voter_names(),
            unreachable: self.down_voters(),
            maybe_applied,
        }
    }

    fn leader_node(&self) -> Option<(NodeId, PeerNode)> {
        let m = self.inner.raft.metrics().borrow().clone();
        let l = m.current_leader?;
        let n = m.membership_config.membership().get_node(&l)?.clone();
        Some((l, n))
    }

    /// Returns once this node no longer takes `leader` for the leader (a new
    /// term began, or Raft stopped).
    async fn leader_moved_from(&self, leader: NodeId) {
        let mut metrics = self.inner.raft.metrics();
        let _ = metrics.wait_for(|m| m.current_leader != Some(leader)).await;
    }

    /// Resolves once a leader other than `known` is known.
    async fn new_leader_other_than(&self, known: Option<NodeId>) {
        let mut metrics = self.inner.raft.metrics();
        let _ = metrics
            .wait_for(|m| m.current_leader.is_some() && m.current_leader != known)
            .await;
    }

    /// Sends an admin request to the leader (or serves it here if this node
    /// leads), retrying only while it surely has not reached a leader (or,
    /// for a read index, until the deadline: asking again is harmless).
    async fn to_leader(
        &self,
        op: &'static str,
        req: AdminRequest,
        deadline: Instant,
    ) -> Result<AdminResponse, ClusterError> {
        let pause = self
            .inner
            .config
            .raft_heartbeat_interval
            .min(Duration::from_millis(100));
        loop {
            if *self.inner.stop.borrow() {
                return Err(ClusterError::Stopped("the node is stopping".into()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.no_majority(op, false));
            }
            let remaining = deadline - now;
            let answer = match self.leader_node() {
                Some((id, _)) if id == self.inner.id => {
                    Some(handle_admin(&self.inner, req.clone(), remaining).await)
                }
                Some((id, node)) => {
                    let name = NodeName::new(node.name.clone())
                        .map_err(|e| ClusterError::Remote(e.to_string()))?;
                    let addr = PeerAddr::new(node.addr.clone());
                    let call = self.inner.peers.call(
                        Some(&name),
                        &addr,
                        Request::Admin(req.clone()),
                        remaining,
                    );
                    // A leader cut off by a partition answers nothing until
                    // the deadline: stop waiting for it once this node sees
                    // another term begin (an election on the majority side).
                    let answer = tokio::select! {
                        answer = call => Some(answer),
                        () = self.leader_moved_from(id) => None,
                    };
                    match answer {
                        None if matches!(req, AdminRequest::ReadIndex) => None,
                        None => return Err(self.no_majority(op, true)),
                        Some(Ok(Response::Admin(a))) => Some(a),
                        Some(Ok(other)) => {
                            return Err(ClusterError::Remote(format!(
                                "unexpected answer {other:?}"
                            )));
                        }
                        Some(Err(CallError::Unreachable { .. })) => None,
                        // A read index asked again is harmless: a link lost
                        // under it (dropped as a duplicate when both nodes
                        // dialed at once, say) is no reason to fail.
                        Some(Err(CallError::Lost { .. }))
                            if matches!(req, AdminRequest::ReadIndex) =>
                        {
                            None
                        }
                        Some(Err(CallError::Lost { .. } | CallError::Timeout { .. })) => {
                            return Err(self.no_majority(op, true));
                        }
                    }
                }
                None => None,
            };
            match answer {
                None | Some(AdminResponse::NotLeader { .. }) => {
                    // Again once another leader is known (an election after
                    // a leader died takes tens of milliseconds), or after a pause.
                    let known = self.leader_node().map(|(id, _)| id);
                    let wait = pause.min(deadline.saturating_duration_since(Instant::now()));
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = self.new_leader_other_than(known) => {}
                    }
                }
                Some(AdminResponse::NoMajority { maybe_applied }) => {
                    return Err(self.no_majority(op, maybe_applied));
                }
                Some(AdminResponse::Failed(e)) => {
                    let e = if e.is_empty() { "no reason given" } else { &e };
                    return Err(ClusterError::Remote(format!(
                        "{op} failed at the leader: {e}"
                    )));
                }
                Some(AdminResponse::NodeRunning(n)) => return Err(ClusterError::NodeRunning(n)),
                Some(AdminResponse::NotAMember(n)) => return Err(ClusterError::NotAMember(n)),
                Some(a) => return Ok(a),
            }
        }
    }

    async fn bootstrap(&self) -> Result<(), ClusterError> {
        let me = PeerNode {
            name: self.inner.config.node.to_string(),
            addr: self.inner.addr.to_string(),
        };
        let members: BTreeMap<NodeId, PeerNode> = [(self.inner.id, me)].into();
        self.inner
            .raft
            .initialize(members)
            .await
            .map_err(|e| ClusterError::Remote(format!("bootstrap: {e}")))?;
        self.inner
            .raft
            .wait(Some(self.inner.config.command_timeout))
            .current_leader(self.inner.id, "bootstrap")
            .await
            .map_err(|_| self.no_majority("bootstrap", false))?;
        tracing::info!(node = %self.inner.config.node, "bootstrapped a new cluster");
        Ok(())
    }

    /// Asks the member at `seed` (or the leader it names) to add this node as
    /// a voter, until the boot wait runs out.
    async fn join_via(&self, seed: &PeerAddr) -> Result<(), ClusterError> {
        let limit = self.inner.config.boot_wait_limit();
        let deadline = Instant::now() + limit;
        let mut target: (Option<NodeName>, PeerAddr) = (None, seed.clone());
        let mut last_err = String::from("no answer");
        let mut next_log = Instant::now();
        let req = AdminRequest::Join {
            name: self.inner.config.node.to_string(),
            addr: self.inner.addr.to_string(),
        };
        while Instant::now() < deadline {
            let timeout = self.inner.config.command_timeout * 2;
            let answer = self
                .inner
                .peers
                .call(
                    target.0.as_ref(),
                    &target.1,
                    Request::Admin(req.clone()),
                    timeout,
                )
                .await;
            match answer {
                Ok(Response::Admin(AdminResponse::Done)) => {
                    let waited = self
                        .inner
                        .raft
                        .wait(Some(self.inner.config.command_timeout))
                        .metrics(
                            |m| m.membership_config.voter_ids().any(|v| v == self.inner.id),
                            "join: become a voter",
                        )
                        .await;
                    if waited.is_ok() {
                        tracing::info!(node = %self.inner.config.node, via = %seed, "joined the cluster as a voter");
                        return Ok(());
                    }
                    last_err = "the leader added this node but it has not seen the change".into();
                }
                Ok(Response::Admin(AdminResponse::NotLeader { leader: Some(l) })) => {
                    target = (NodeName::new(l.name).ok(), PeerAddr::new(l.addr));
                    continue;
                }
                Ok(Response::Admin(AdminResponse::NotLeader { leader: None })) => {
                    last_err = "the member knows no leader".into();
                }
                Ok(other) => last_err = format!("{other:?}"),
                Err(e) => last_err = e.to_string(),
            }
            if Instant::now() >= next_log {
                tracing::info!(node = %self.inner.config.node, via = %target.1, reason = %last_err, "waiting to join the cluster");
                next_log = Instant::now() + self.inner.config.boot_log_interval;
            }
            target = (None, seed.clone());
            tokio::time::sleep(
                self.inner
                    .config
                    .raft_heartbeat_interval
                    .max(Duration::from_millis(50)),
            )
            .await;
        }
        Err(ClusterError::JoinFailed {
            via: seed.to_string(),
            reason: last_err,
        })
    }

    /// At restart: waits for a leader (a majority of voters up), bounded.
    async fn boot_wait(&self) -> Result<(), ClusterError> {
        let cfg = &self.inner.config;
        let limit = cfg.boot_wait_limit();
        let start = Instant::now();
        let mut next_log = start + cfg.boot_log_interval;
        let mut metrics = self.inner.raft.metrics();
        loop {
            // A known leader is not enough (it may be this node's stale view):
            // a read index proves a majority answers.
            if metrics.borrow().current_leader.is_some() {
                let probe = Instant::now()
                    + cfg
                        .command_timeout
                        .min(cfg.boot_log_interval)
                        .max(Duration::from_millis(100));
                match self
                    .to_leader("boot", AdminRequest::ReadIndex, probe.min(start + limit))
                    .await
                {
                    Ok(_) => break,
                    Err(e @ ClusterError::Stopped(_)) => return Err(e),
                    Err(ClusterError::NotAMember(_)) => {
                        return Err(ClusterError::Removed(cfg.node.to_string()));
                    }
                    Err(e) => tracing::debug!(node = %cfg.node, error = %e, "no majority yet"),
                }
            }
            let elapsed = start.elapsed();
            if elapsed >= limit {
                return Err(ClusterError::BootTimeout {
                    waited: elapsed,
                    waiting_for: self.down_voters(),
                });
            }
            if Instant::now() >= next_log {
                let tries_left =
                    (limit - elapsed).as_millis() / cfg.boot_wait_timeout.as_millis().max(1);
                tracing::info!(
                    node = %cfg.node,
                    waiting_for = ?self.down_voters(),
                    tries_left = tries_left as u64,
                    "waiting for a majority of the cluster to start"
                );
                next_log = Instant::now() + cfg.boot_log_interval;
            }
            let wake = (start + limit)
                .min(next_log)
                .min(Instant::now() + cfg.raft_heartbeat_interval.max(Duration::from_millis(50)));
            let _ = tokio::time::timeout_at(wake, metrics.changed()).await;
        }
        let (is_voter, same_addr) = {
            let m = self.inner.raft.metrics().borrow().clone();
            let mc = &m.membership_config;
            (
                mc.voter_ids().any(|v| v == self.inner.id),
                mc.membership()
                    .get_node(&self.inner.id)
                    .is_some_and(|n| n.addr == self.inner.addr.as_str()),
            )
        };
        if !is_voter || !same_addr {
            tracing::info!(node = %cfg.node, is_voter, same_addr, "rejoining as a voter at this address");
            let deadline = Instant::now() + limit.saturating_sub(start.elapsed());
            let req = AdminRequest::Join {
                name: cfg.node.to_string(),
                addr: self.inner.addr.to_string(),
            };
            // Nodes restarted together rejoin together: a membership
            // change in progress is waited out (until the boot deadline).
            loop {
                match self
                    .to_leader("rejoin as a voter", req.clone(), deadline)
                    .await
                {
                    Ok(AdminResponse::Done) => break,
                    Ok(other) => return Err(self.unexpected(other)),
                    Err(ClusterError::Remote(e))
                        if e.contains("undergoing a configuration change")
                            && Instant::now() < deadline =>
                    {
                        tracing::info!(node = %cfg.node, "another membership change is in progress; rejoining after it");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    // The voters are still electing (a new term began under
                    // the call, or the link to the leader it knew was lost
                    // or refused while that node started): asked again
                    // until the boot deadline. A join is idempotent.
                    Err(ClusterError::NoMajority { .. }) if Instant::now() < deadline => {
                        tracing::info!(node = %cfg.node, "no leader took the rejoin yet; asking again");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Whether this node is the Raft leader right now (as it believes).
    pub fn is_leader(&self) -> bool {
        let m = self.inner.raft.metrics().borrow().clone();
        m.state == ServerState::Leader && m.current_leader == Some(self.inner.id)
    }
}

/// Serves a request from a peer.
async fn handle(weak: Weak<Inner>, from: NodeName, req: Request) -> Response {
    // Stopping (or stopped): Raft no longer takes requests.
    let Some(inner) = weak.upgrade().filter(|i| !*i.stop.borrow()) else {
        return match req {
            Request::AppendEntries(_) => Response::AppendEntries(Err("node stopped".into())),
            Request::Vote(_) => Response::Vote(Err("node stopped".into())),
            Request::Snapshot { .. } => Response::Snapshot(Err("node stopped".into())),
            Request::Admin(_) => Response::Admin(AdminResponse::NotLeader { leader: None }),
            Request::Applied { .. } => Response::Applied(false),
        };
    };
    match req {
        Request::AppendEntries(r) => Response::AppendEntries(
            inner
                .raft
                .append_entries(r)
                .await
                .map_err(|e| e.to_string()),
        ),
        Request::Vote(r) => {
            // A node that was forgotten (and restarted with its old data)
            // must not disrupt the cluster with elections it cannot win.
            let candidate = r.vote.leader_id().voted_for();
            let known = {
                let m = inner.raft.metrics().borrow().clone();
                let mc = &m.membership_config;
                mc.log_id().is_none()
                    || candidate.is_some_and(|c| mc.membership().get_node(&c).is_some())
            };
            if !known {
                tracing::warn!(node = %inner.config.node, peer = %from, "refusing a vote request from a node that is not a member");
                return Response::Vote(Err(format!(
                    "{from} is not a member of this cluster (was it forgotten?)"
                )));
            }
            Response::Vote(inner.raft.vote(r).await.map_err(|e| e.to_string()))
        }
        Request::Snapshot { vote, meta, data } => Response::Snapshot(
            inner
                .raft
                .install_full_snapshot(
                    vote,
                    Snapshot {
                        meta,
                        snapshot: Box::new(Cursor::new(data)),
                    },
                )
                .await
                .map_err(|e| e.to_string()),
        ),
        Request::Applied { index } => {
            let mut replayed = inner.replayed.subscribe();
            let done = if replayed.borrow().is_some() {
                let wait = replayed.wait_for(|r| r.is_some_and(|i| i >= index));
                matches!(tokio::time::timeout(APPLIED_WAIT, wait).await, Ok(Ok(_)))
            } else {
                inner
                    .raft
                    .wait(Some(APPLIED_WAIT))
                    .applied_index_at_least(Some(index), "a client's change applied here")
                    .await
                    .is_ok()
            };
            Response::Applied(done)
        }
        Request::Admin(a) => {
            // Only members may ask for anything but to join.
            if !matches!(a, AdminRequest::Join { .. }) && !is_member(&inner, &from) {
                return Response::Admin(AdminResponse::NotAMember(from.to_string()));
            }
            let timeout = inner.config.command_timeout;
            Response::Admin(handle_admin(&inner, a, timeout).await)
        }
    }
}

/// Whether `node` is in this node's (effective) membership; a node with no
/// membership yet knows nobody and refuses nothing.
fn is_member(inner: &Inner, node: &NodeName) -> bool {
    let m = inner.raft.metrics().borrow().clone();
    let mc = &m.membership_config;
    mc.log_id().is_none() || mc.membership().get_node(&node_id(node)).is_some()
}

fn not_leader(inner: &Inner) -> AdminResponse {
    let m = inner.raft.metrics().borrow().clone();
    let leader = m
        .current_leader
        .filter(|l| *l != inner.id)
        .and_then(|l| m.membership_config.membership().get_node(&l).cloned());
    AdminResponse::NotLeader { leader }
}

fn write_err(
    inner: &Inner,
    e: RaftError<NodeId, ClientWriteError<NodeId, PeerNode>>,
) -> AdminResponse {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => not_leader(inner),
        other => AdminResponse::Failed(other.to_string()),
    }
}

/// Serves an admin request on the leader.
async fn handle_admin(inner: &Inner, req: AdminRequest, timeout: Duration) -> AdminResponse {
    let raft = &inner.raft;
    if let AdminRequest::Elect = req {
        tracing::info!(node = %inner.config.node, "asked to take over leadership");
        return match raft.trigger().elect().await {
            Ok(()) => AdminResponse::Done,
            Err(e) => AdminResponse::Failed(e.to_string()),
        };
    }
    let m = raft.metrics().borrow().clone();
    if m.current_leader != Some(inner.id) {
        return not_leader(inner);
    }
    let membership = m.membership_config.membership().clone();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    let lost = AdminResponse::NoMajority {
        maybe_applied: true,
    };
    match req {
        AdminRequest::Write(cmd) => {
            match tokio::time::timeout(timeout, raft.client_write(cmd)).await {
                Ok(Ok(resp)) => {
                    // Followers learn the new commit index now rather than
                    // with the next heartbeat, and apply it.
                    let _ = raft.trigger().heartbeat().await;
                    AdminResponse::Written(resp.data, resp.log_id.index)
                }
                Ok(Err(e)) => write_err(inner, e),
                Err(_) => lost,
            }
        }
        AdminRequest::ReadIndex => {
            match tokio::time::timeout(timeout, raft.ensure_linearizable()).await {
                Ok(Ok(l)) => AdminResponse::ReadIndex(l.map_or(0, |l| l.index)),
                Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(_)))) => {
                    not_leader(inner)
                }
                Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_)))) | Err(_) => {
                    AdminResponse::NoMajority {
                        maybe_applied: false,
                    }
                }
                Ok(Err(e)) => AdminResponse::Failed(e.to_string()),
            }
        }
        AdminRequest::Join { name, addr } => {
            let Ok(nn) = NodeName::new(name.clone()) else {
                return AdminResponse::Failed(format!("invalid node name {name:?}"));
            };
            let id = node_id(&nn);
            let known = membership.get_node(&id).cloned();
            if let Some(other) = &known
                && other.name != name
            {
                return AdminResponse::Failed(format!(
                    "node id collision between {name} and {}",
                    other.name
                ));
            }
            if let Some(known) = &known
                && known.addr != addr
            {
                // The member restarted elsewhere (a new address, or its data
                // directory moved to a new host under the same name). Peers
                // authenticate names, so pointing the id at the new address is safe.
                let node = PeerNode {
                    name: name.clone(),
                    addr: addr.clone(),
                };
                match tokio::time::timeout(
                    timeout,
                    raft.change_membership(ChangeMembers::SetNodes([(id, node)].into()), true),
                )
                .await
                {
                    Ok(Ok(_)) => {
                        tracing::info!(node = %inner.config.node, member = %name, %addr, "member address updated")
                    }
                    Ok(Err(e)) => return write_err(inner, e),
                    Err(_) => return lost,
                }
            }
            if voters.contains(&id) {
                return AdminResponse::Done;
            }
            let deadline = Instant::now() + timeout;
            if membership.get_node(&id).is_none() {
                let node = PeerNode {
                    name: name.clone(),
                    addr,
                };
                match tokio::time::timeout(timeout, raft.add_learner(id, node, false)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return write_err(inner, e),
                    Err(_) => return lost,
                }
                tracing::info!(node = %inner.config.node, joiner = %name, "added learner");
            }
            // Let the learner catch up (bounded) before it counts for quorum.
            let _ = raft
                .wait(Some(deadline.saturating_duration_since(Instant::now())))
                .metrics(
                    |m| {
                        let Some(repl) = &m.replication else {
                            return true;
                        };
                        let matched = repl.get(&id).cloned().flatten().map(|l| l.index);
                        matched.is_some()
                            && matched >= m.last_log_index.map(|i| i.saturating_sub(2))
                    },
                    "learner catch-up",
                )
                .await;
            let remaining = deadline
                .saturating_duration_since(Instant::now())
                .max(timeout / 2);
            match tokio::time::timeout(
                remaining,
                raft.change_membership(ChangeMembers::AddVoterIds([id].into()), true),
            )
            .await
            {
                Ok(Ok(_)) => {
                    tracing::info!(node = %inner.config.node, joiner = %name, "promoted to voter");
                    AdminResponse::Done
                }
                Ok(Err(e)) => write_err(inner, e),
                Err(_) => lost,
            }
        }
        AdminRequest::Demote { name } => {
            let Ok(nn) = NodeName::new(name.clone()) else {
                return AdminResponse::NotAMember(name);
            };
            let id = node_id(&nn);
            if !voters.contains(&id) {
                return AdminResponse::Done;
            }
            if voters.len() == 1 {
                return AdminResponse::Failed(format!("{name} is the last voting member"));
            }
            match tokio::time::timeout(
                timeout,
                raft.change_membership(ChangeMembers::RemoveVoters([id].into()), true),
            )
            .await
            {
                Ok(Ok(_)) => AdminResponse::Done,
                Ok(Err(e)) => write_err(inner, e),
                Err(_) => lost,
            }
        }
        AdminRequest::Forget { name } => {
            let Ok(nn) = NodeName::new(name.clone()) else {
                return AdminResponse::NotAMember(name);
            };
            let id = node_id(&nn);
            if membership.get_node(&id).is_none() {
                return AdminResponse::NotAMember(name);
            }
            if id == inner.id {
                return AdminResponse::Failed("the leader cannot forget itself".into());
            }
            if inner.up.borrow().contains(&nn) {
                return AdminResponse::NodeRunning(name);
            }
            let change = if voters.contains(&id) {
                ChangeMembers::RemoveVoters([id].into())
            } else {
                ChangeMembers::RemoveNodes([id].into())
            };
            match tokio::time::timeout(timeout, raft.change_membership(change, false)).await {
                Ok(Ok(_)) => {
                    inner.peers.drop_link(&nn);
                    AdminResponse::Done
                }
                Ok(Err(e)) => write_err(inner, e),
                Err(_) => lost,
            }
        }
        AdminRequest::Elect => AdminResponse::Done,
    }
}

/// How long a member waits to apply a client's change before it answers
/// [`Cluster::write_everywhere`] anyway (a member that lags further is
/// behind a cut, which the failure detector will report).
pub(crate) const APPLIED_WAIT: Duration = Duration::from_millis(500);

/// How long a dial to a peer whose link just ended may take.
const LOST_LINK_DIAL: Duration = Duration::from_millis(200);

/// When a peer's side ends its link, the waits before each probe of its
/// address (a refusal means its process is gone).
const LOST_LINK_PROBES: [Duration; 4] = [
    Duration::ZERO,
    Duration::from_millis(10),
    Duration::from_millis(30),
    Duration::from_millis(60),
];

/// The members other than this node: id, name and peer address.
fn other_members(
    inner: &Inner,
    m: &openraft::RaftMetrics<NodeId, PeerNode>,
) -> Vec<(NodeId, NodeName, PeerAddr)> {
    m.membership_config
        .nodes()
        .filter(|(id, _)| **id != inner.id)
        .filter_map(|(id, n)| {
            NodeName::new(n.name.clone())
                .ok()
                .map(|nn| (*id, nn, PeerAddr::new(n.addr.clone())))
        })
        .collect()
}

/// The failure detector: heartbeats every member, reports up/down changes.
/// A member is down when it has been silent for the failure timeout, or at
/// once when its address refuses a connection after its link closed (its
/// process is gone: a SIGKILL is seen in milliseconds). When that member
/// led Raft, this voter calls an election at once instead of waiting for
/// the election timeout.
async fn detector(weak: Weak<Inner>) {
    let mut in_flight: BTreeMap<NodeName, tokio::task::JoinHandle<()>> = BTreeMap::new();
    let (interval, mut stop, changed) = match weak.upgrade() {
        Some(inner) => (
            inner.config.heartbeat_interval,
            inner.stop.subscribe(),
            inner.peers.changed(),
        ),
        None => return,
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether Raft may call elections (openraft's default: yes).
    let mut elect = true;
    // The last Raft leader other than this node that the metrics named.
    let mut last_leader: Option<NodeId> = None;
    // The dead leader this node has called elections against, until it is
    // up again or another leader is known.
    let mut stood: Option<NodeId> = None;
    // Members silent for a tenth of the heartbeat interval (50 ms by default)
    // are probed at that pace: over transports that can tell (QUIC, where a
    // dead process's link does not end), a dead process's address refuses,
    // and the member is down at once instead of after the timeout. A probe
    // is one datagram.
    let quiet = interval / 10;
    let mut probe_tick = tokio::time::interval(quiet);
    probe_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = changed.notified() => {}
            _ = probe_tick.tick() => {
                let Some(inner) = weak.upgrade() else { return };
                let now = Instant::now();
                // Each probe waits for its own answer; a slow one does not
                // hold up the next.
                let members = other_members(&inner, &inner.raft.metrics().borrow());
                // Members never heard from (a joining node) are not probed.
                for (_, name, addr) in members {
                    let heard = inner.peers.last_seen(&name);
                    if inner.peers.refused(&name)
                        || heard.is_none_or(|t| now.saturating_duration_since(t) < quiet)
                    {
                        continue;
                    }
                    let peers = inner.peers.clone();
                    tokio::spawn(async move {
                        peers.probe(&name, &addr).await;
                    });
                }
                continue;
            }
            _ = stop.wait_for(|s| *s) => return,
        }
        let Some(inner) = weak.upgrade() else { return };
        let (members, leader, voters): (Vec<(NodeId, NodeName, PeerAddr)>, _, _) = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            let members = other_members(&inner, &m);
            let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
            (members, m.current_leader, voters)
        };
        // A link the peer's side ended: is its process gone? A dial racing
        // the process's exit can be reset rather than refused, so ask again
        // shortly after, instead of waiting for the probe pace.
        for name in inner.peers.take_lost() {
            let Some((_, _, addr)) = members.iter().find(|(_, n, _)| *n == name) else {
                continue;
            };
            let (peers, addr) = (inner.peers.clone(), addr.clone());
            tokio::spawn(async move {
                for wait in LOST_LINK_PROBES {
                    tokio::time::sleep(wait).await;
                    if peers.refused(&name) || peers.has_link(&name) {
                        return;
                    }
                    // A dial (refused over TCP), and the transport's own
                    // probe (QUIC answers a dead port with ICMP).
                    if peers.reach(&name, &addr, LOST_LINK_DIAL).await
                        || peers.probe(&name, &addr).await
                    {
                        return;
                    }
                }
            });
        }
        // What this node's heartbeats say: it leads, or follows a leader
        // it heard within the lease whose address does not refuse it.
        let lease = inner.config.election_timeout_max;
        let leader_live = leader.is_some_and(|l| {
            l == inner.id
                || members.iter().any(|(id, n, _)| {
                    *id == l
                        && !inner.peers.refused(n)
                        && inner
                            .peers
                            .last_seen(n)
                            .is_some_and(|t| t.elapsed() < lease)
                })
        });
        inner.peers.set_leader_live(leader_live);
        in_flight.retain(|_, h| !h.is_finished());
        for (_, name, addr) in &members {
            if in_flight.contains_key(name) {
                continue;
            }
            let peers = inner.peers.clone();
            let (name2, addr2) = (name.clone(), addr.clone());
            let bound = inner.config.failure_timeout;
            in_flight.insert(
                name.clone(),
                tokio::spawn(async move {
                    let _ = peers.heartbeat(&name2, &addr2, bound, 0).await;
                }),
            );
        }
        let now = Instant::now();
        // A peer not heard from yet (and not refusing) counts for the
        // failure timeout after this node started: a restarted node is no
        // minority before its first heartbeats come back (its masters would
        // nack every publish meanwhile).
        let young = now.saturating_duration_since(inner.started) < inner.config.failure_timeout;
        // A peer is up while it is heard and it hears this node: one that
        // says it has not heard this node for the failure timeout is cut
        // off from it one way, and down for it as this node is for the peer
        // (forwarded work then fails at once instead of vanishing).
        let up: BTreeSet<NodeName> = members
            .iter()
            .filter(|(_, n, _)| {
                !inner.peers.refused(n)
                    && inner.peers.last_seen(n).is_some_and(|t| {
                        now.saturating_duration_since(t) < inner.config.failure_timeout
                    })
                    && (young || !inner.peers.deaf(n, inner.config.failure_timeout))
            })
            .map(|(_, n, _)| n.clone())
            .collect();
        let counts = |n: &NodeName| {
            up.contains(n)
                || (young && inner.peers.last_seen(n).is_none() && !inner.peers.refused(n))
        };
        let voters_up = voters
            .iter()
            .filter(|id| **id == inner.id || members.iter().any(|(m, n, _)| m == *id && counts(n)))
            .count();
        let majority = voters.is_empty() || voters_up * 2 > voters.len();
        // Raft elections only while a majority of the voters would grant
        // this node a vote: itself, and each voter whose heartbeat within
        // the lease said it has no live leader (a pre-vote, asked through
        // the heartbeats; openraft 0.9 has none). Otherwise a node cut off
        // from the leader, both ways or one, raises its term in elections
        // it cannot win, and on the heal that term deposes the leader,
        // leaving the cluster without one for seconds. Followers wait the
        // lease and an election timeout before they stand; a peer says its
        // leader is gone once it has not heard it for the lease, a
        // heartbeat interval before that.
        let heard = voters
            .iter()
            .filter(|id| {
                **id == inner.id
                    || members
                        .iter()
                        .any(|(m, n, _)| m == *id && inner.peers.would_vote(n, lease))
            })
            .count();
        let may_elect = voters.len() <= 1 || heard * 2 > voters.len();
        if may_elect != elect {
            elect = may_elect;
            inner.raft.runtime_config().elect(elect);
            tracing::debug!(node = %inner.config.node, elect, would_vote = heard, voters = voters.len(), "Raft election gate");
        }
        if *inner.majority.borrow() != majority {
            if majority {
                tracing::info!(node = %inner.config.node, voters_up, voters = voters.len(), "a majority of the cluster is reachable again");
            } else {
                tracing::warn!(node = %inner.config.node, voters_up, voters = voters.len(), "in a minority: a majority of the cluster is unreachable");
            }
            inner.majority.send_replace(majority);
        }
        // The Raft leader as last known: openraft may already have dropped
        // it (a vote request of a higher term) when its death is seen.
        if leader.is_some_and(|l| l != inner.id) {
            last_leader = leader;
        } else if leader == Some(inner.id) {
            last_leader = None;
        }
        stand_against_a_dead_leader(&inner, &members, &up, &voters, last_leader, &mut stood);
        let before = inner.up.borrow().clone();
        if before != up {
            for n in up.difference(&before) {
                tracing::info!(node = %inner.config.node, peer = %n, "node up");
                let _ = inner.events.send(NodeEvent::Up(n.clone()));
            }
            for n in before.difference(&up) {
                let refused = inner.peers.refused(n);
                if inner.peers.leaving(n) {
                    tracing::info!(node = %inner.config.node, peer = %n, "node down: it stopped cleanly");
                } else {
                    tracing::warn!(node = %inner.config.node, peer = %n, refused, "node down");
                }
                let _ = inner.events.send(NodeEvent::Down(n.clone()));
            }
            // The count first: whoever reads both sees the node down
            // again at the latest once its up set says so.
            inner.downs.send_modify(|downs| {
                for n in before.difference(&up) {
                    *downs.entry(n.clone()).or_default() += 1;
                }
            });
            inner.up.send_replace(up);
        }
    }
}
