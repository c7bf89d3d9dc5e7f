//! The driver: [`MirrorDriver`], the shell around one node's broker replicas.
//!
//! - A [`GmNode`] hosts this node's members of every queue ring; its address
//!   is committed to the cluster metadata so that peers can dial it.
//! - A reconciler follows the metadata (queue records, policies) and the
//!   running nodes, and decides with `warren_policy::place` where each
//!   durable queue's replicas live: it points the broker's queues at their
//!   masters, starts this node's replica (master if the record names this
//!   node master, else a mirror) and stops it when it is no longer wanted.
//! - The hub (`hub.rs`) moves every replica's ring traffic: it feeds the
//!   broker the rings' events ([`Broker::mirror_inputs`]) and sends what the
//!   replicas ask for ([`Broker::take_mirror_io`]), broadcasts and record
//!   compare-and-sets.
//! - One task per replica feeds the broker what is rare: view changes (read
//!   from the authority), its queue record, majority changes, ticks, the
//!   stop; then it marks the replica ready for the hub.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{Notify, mpsc, oneshot, watch};
use warren_backing_queue::{BackingQueue, QueueConfig};
use warren_broker::{Broker, MirrorInput, ReplicaEnd, ReplicaStart};
use warren_cluster::{Command, Metadata, QueueRecord};
use warren_gm::{
    DriverError, GmNode, NodeConfig, RingEvent, RingHandle, ViewAuthority, ViewChange,
};
use warren_lock::{MeasuredGuard, MeasuredMutex};
use warren_mirror::{QueueFactory, RecordView, Settings};
use warren_policy::{CandidateOrder, PlacementInput, Policy, PolicyKind, PolicySet, PolicySpec};
use warren_transport::{NodeName, PeerAddr, Transport};

use crate::hub::{Entry, Hub};
use crate::seen::{QueueKey, Seen};
use crate::{
    ClusterDetector, ClusterRecords, ClusterViewAuthority, MetadataSource, RecordError, RecordStore,
};

/// A broker shared with the node's other tasks.
pub(crate) type Shared = Arc<MeasuredMutex<Broker>>;

pub(crate) fn lock(b: &Shared) -> MeasuredGuard<'_, Broker> {
    b.lock()
}

/// The time the driver gives its broker: milliseconds since the Unix
/// epoch, as the node times its connections' input.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The broker's time on a node, in milliseconds since the Unix epoch: the
/// wall clock read once, at the first call, and advanced by the monotonic
/// clock from then on. A step of the system clock (NTP, `date -s`) moves
/// none of the broker's timers (heartbeats, `x-expires`, message TTLs,
/// consumer timeouts, group commits): read directly, a step of an hour
/// forward deleted every queue with a shorter `x-expires` at once, and one
/// back stopped the heartbeats to every client for that hour.
#[must_use]
pub fn steady_clock_ms() -> u64 {
    static START: OnceLock<(Instant, u64)> = OnceLock::new();
    let (at, wall) = START.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        (Instant::now(), wall)
    });
    wall + at.elapsed().as_millis() as u64
}

/// Operator policies are stored under this prefix (the node's metadata store
/// keeps both kinds in one map).
const OPERATOR_PREFIX: &str = "operator-policy:";

/// How long a starting driver waits for a majority to confirm the queue
/// records it points the broker's queues with (then it uses its own).
const FIRST_READ: Duration = Duration::from_secs(2);

/// How often a master whose disk failed tries to open its queue's log again.
const REOPEN_RETRY: Duration = Duration::from_secs(1);

/// The longest a mirror removed from its ring while claiming the master's
/// place waits for the claim's outcome (a metadata write gives up within
/// 25 s) before it takes the record as it knows it.
const CLAIM_WAIT: Duration = Duration::from_secs(30);

/// How a node's [`MirrorDriver`] runs.
#[derive(Clone)]
pub struct DriverConfig {
    /// This node's GM node: its name (the node's) and where it listens.
    pub gm: NodeConfig,
    /// Where this node listens for forwarded queue work (recorded in the
    /// metadata with the ring address).
    pub link_addr: String,
    /// How often each replica's task drives its replica without an event.
    pub replica_tick: Duration,
    /// How often the reconciler runs without a metadata change.
    pub reconcile_interval: Duration,
    /// The broker's time (expiries are timed by it): [`steady_clock_ms`], or
    /// the simulation's virtual one.
    pub clock: Clock,
}

impl std::fmt::Debug for DriverConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverConfig")
            .field("gm", &self.gm)
            .field("link_addr", &self.link_addr)
            .field("replica_tick", &self.replica_tick)
            .field("reconcile_interval", &self.reconcile_interval)
            .finish_non_exhaustive()
    }
}

impl DriverConfig {
    /// Defaults: a replica tick and a reconcile pass every second,
    /// [`steady_clock_ms`].
    pub fn new(gm: NodeConfig, link_addr: impl Into<String>) -> Self {
        Self {
            gm,
            link_addr: link_addr.into(),
            replica_tick: Duration::from_secs(1),
            reconcile_interval: Duration::from_secs(1),
            clock: Arc::new(steady_clock_ms),
        }
    }
}

/// What wakes one replica's task, from the reconciler.
struct Signals {
    /// Ring traffic or broker output for the replica.
    notify: Arc<Notify>,
    /// The reconciler wants the replica gone.
    stopping: Arc<AtomicBool>,
    /// The queue record's view version changed.
    record: watch::Receiver<u64>,
}

/// This node's replica of one queue, as the reconciler tracks it.
struct Running {
    /// The declaration of the queue it is a replica of
    /// ([`warren_cluster::QueueRecord::serial`]).
    serial: u64,
    master: bool,
    settings: Settings,
    /// Wakes the replica's task.
    notify: Arc<Notify>,
    /// Set when the reconciler wants the replica gone; read by the
    /// replica's task on each turn.
    stopping: Arc<AtomicBool>,
    /// The queue record's view version as the reconciler last saw it: the
    /// replica's task reads the record again when it changes (rather than
    /// on every change of the cluster's metadata).
    record: watch::Sender<u64>,
    /// Whether a master keeps its messages when it stops (the queue stops
    /// being mirrored) rather than handing over (the master moves).
    keep: bool,
}

/// The mirroring side of a clustered node: its GM node, the reconciler and
/// one task per replica, over the metadata `S`.
pub struct MirrorDriver<S: MetadataSource> {
    node: String,
    source: S,
    replica_tick: Duration,
    reconcile_interval: Duration,
    clock: Clock,
    broker: Shared,
    gm: GmNode,
    authority: Arc<dyn ViewAuthority>,
    replicas: Mutex<HashMap<(String, String), Running>>,
    /// Queues whose replica task ended since the reconciler's last pass:
    /// the next pass looks at them again, changed or not (a replica of a
    /// queue declared again starts once its predecessor's has gone).
    ended: Mutex<BTreeSet<QueueKey>>,
    /// Replica tasks still running (for a clean stop).
    tasks: Mutex<tokio::task::JoinSet<()>>,
    /// Set when the node is shutting down: replicas stop but leave their
    /// files as they are (the next start decides what they are). A watch,
    /// not a `Notify`: a task busy when it is set still sees it.
    stop: watch::Sender<bool>,
    /// The task that moves every replica's ring traffic.
    hub: Arc<Hub>,
    /// The hub's task, ended once the replicas have stopped.
    hub_task: Mutex<Option<tokio::task::AbortHandle>>,
    /// The id of the next replica started (the hub's name for it).
    next_id: AtomicU64,
}

impl<S: MetadataSource> std::fmt::Debug for MirrorDriver<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirrorDriver")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl<S: MetadataSource> MirrorDriver<S> {
    /// Starts the GM node (as `config.gm` says) on `transport`, records its
    /// address and the link address in the metadata and starts the
    /// reconciler, on the caller's runtime. The node's name is the
    /// metadata's ([`MetadataSource::node`]).
    pub async fn start(
        source: S,
        transport: Arc<dyn Transport>,
        broker: Arc<MeasuredMutex<Broker>>,
        config: DriverConfig,
    ) -> Result<Arc<Self>, DriverError> {
        let node = source.node().to_string();
        let authority: Arc<dyn ViewAuthority> = Arc::new(ClusterViewAuthority::new(source.clone()));
        let gm = GmNode::start(
            config.gm,
            transport,
            authority.clone(),
            Box::new(ClusterDetector::new(source.up_nodes(), source.downs())),
        )
        .await?;
        let addr = gm.local_addr().to_string();
        tracing::info!(node = %node, ring_addr = %addr, "queue rings listening");
        let me = Arc::new(Self {
            node,
            source,
            replica_tick: config.replica_tick,
            reconcile_interval: config.reconcile_interval,
            clock: config.clock,
            broker,
            gm,
            authority,
            replicas: Mutex::new(HashMap::new()),
            ended: Mutex::new(BTreeSet::new()),
            tasks: Mutex::new(tokio::task::JoinSet::new()),
            stop: watch::channel(false).0,
            hub: Arc::new(Hub::default()),
            hub_task: Mutex::new(None),
            next_id: AtomicU64::new(0),
        });
        let hub = tokio::spawn(me.hub.clone().run(
            me.node.clone(),
            me.broker.clone(),
            me.clock.clone(),
        ));
        *me.hub_task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(hub.abort_handle());
        // Without the hub no replica of this node moves.
        warren_gm::abort_if_panics(hub, me.node.to_string(), "the replica hub");
        // Before the node takes clients: its broker serves the queues it
        // recovered from its own disk, and a mirror's copy is stale. Point
        // them at their masters as the cluster has them now (as of a
        // linearizable read when a majority answers soon, else as this node
        // applied them), not at the reconciler's first pass.
        let meta = match tokio::time::timeout(FIRST_READ, me.source.read_linearizable()).await {
            Ok(Ok(meta)) => meta,
            _ => me.source.local(),
        };
        me.hold_recovered_masters(&meta);
        me.point_queues(&meta, None);
        tokio::spawn(me.clone().register(addr, config.link_addr));
        tokio::spawn(me.clone().reconcile_loop());
        Ok(me)
    }

    /// Commits this node's ring and link addresses (retrying while there is
    /// no majority).
    async fn register(self: Arc<Self>, ring_addr: String, link_addr: String) {
        loop {
            let cmd = Command::SetNodeServices {
                node: self.node.clone(),
                ring_addr: ring_addr.clone(),
                link_addr: link_addr.clone(),
            };
            match self.source.write(cmd).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "recording the ring address failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    async fn reconcile_loop(self: Arc<Self>) {
        let mut changes = self.source.changes();
        let mut up = self.source.up_nodes();
        let mut every = tokio::time::interval(self.reconcile_interval);
        let mut peers: BTreeMap<String, String> = BTreeMap::new();
        let mut seen = Seen::default();
        // Every `reconcile_interval`, a pass over every queue: what a pass
        // decides from the broker's state (a master alone in its ring) and
        // retries come round again.
        let mut full = true;
        loop {
            let meta = self.source.local();
            for (name, n) in &meta.nodes {
                let Some(addr) = &n.ring_addr else { continue };
                if *name == self.node || peers.get(name) == Some(addr) {
                    continue;
                }
                if let Ok(nn) = NodeName::new(name.clone())
                    && self
                        .gm
                        .add_peer(nn, PeerAddr::new(addr.clone()))
                        .await
                        .is_ok()
                {
                    peers.insert(name.clone(), addr.clone());
                }
            }
            let mut running: Vec<String> = up.borrow().iter().map(ToString::to_string).collect();
            if !running.contains(&self.node) {
                running.push(self.node.clone());
            }
            let only = seen
                .update(&meta, &running)
                .filter(|_| !full)
                .map(|mut only| {
                    only.append(
                        &mut self
                            .ended
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner),
                    );
                    only
                });
            if only.is_none() {
                self.ended
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clear();
            }
            self.reconcile(&meta, &running, only.as_ref());
            full = false;
            // Not held while waiting: the state machine would copy the
            // whole metadata for each change it applies.
            drop(meta);
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                r = up.changed() => if r.is_err() { return },
                _ = every.tick() => full = true,
                () = self.stopped() => return,
            }
        }
    }

    /// Tells the broker which node serves each queue of `meta` (of `only`,
    /// if given).
    fn point_queues(&self, meta: &Metadata, only: Option<&BTreeSet<QueueKey>>) {
        let mut b = lock(&self.broker);
        for ((vhost, name), q) in queues_of(meta, only) {
            if q.exclusive_owner.is_none() {
                let master = (q.master != self.node).then_some(q.master.as_str());
                b.set_queue_master(vhost, name, master);
            }
        }
    }

    /// Holds the mirrored queues that this node recovered from its disk and
    /// masters, whose records count other nodes' mirrors synchronised,
    /// until their replicas start here (`Broker::hold_for_replica`): what
    /// this node's store did outside the ring, such a mirror, promoted
    /// later, would not know (seed 309 of the simulation: a restarted
    /// master handed out messages to another node's consumer before its
    /// replica started, and the mirror promoted next delivered them again
    /// without `redelivered`).
    fn hold_recovered_masters(&self, meta: &Metadata) {
        let policies = policy_set(meta);
        let mut b = lock(&self.broker);
        for ((vhost, name), q) in &meta.queues {
            if q.master == self.node
                && q.exclusive_owner.is_none()
                && q.synchronised.iter().any(|n| *n != self.node)
                && policies
                    .effective_for_queue(vhost, name, false)
                    .mirroring()
                    .is_some()
            {
                b.hold_for_replica(vhost, name);
            }
        }
    }

    /// One pass: point the broker's queues at their masters, and start and
    /// stop this node's replicas to match the metadata; for the queues in
    /// `only` alone if given (nothing else the pass reads has changed).
    fn reconcile(
        self: &Arc<Self>,
        meta: &Metadata,
        running: &[String],
        only: Option<&BTreeSet<QueueKey>>,
    ) {
        self.point_queues(meta, only);
        let policies = policy_set(meta);
        let cluster_nodes: Vec<String> = meta.nodes.keys().cloned().collect();
        let mut wanted: BTreeMap<(String, String), (bool, Settings, u64)> = BTreeMap::new();
        let mut mirrored = BTreeSet::new();
        // Mastered here and mirrored by no policy: served by this node.
        let mut unmirrored = Vec::new();
        for ((vhost, name), q) in queues_of(meta, only) {
            if q.exclusive_owner.is_some() {
                continue;
            }
            let eff = policies.effective_for_queue(vhost, name, false);
            let Some(ha) = eff.mirroring() else {
                if q.master == self.node {
                    unmirrored.push((vhost, name));
                }
                continue;
            };
            let placement = warren_policy::place(&PlacementInput {
                mode: Some(&ha.mode),
                master: &q.master,
                mirrors: &q.mirrors,
                synchronised: &q.synchronised,
                cluster_nodes: &cluster_nodes,
                running_nodes: running,
                order: CandidateOrder::Seeded(seed(vhost, name)),
            });
            mirrored.insert((vhost.clone(), name.clone()));
            let master = q.master == self.node;
            // `nodes` moves the master once a listed node is synchronised:
            // this master then hands over (stops) and is not wanted.
            let here = if placement.master_moves {
                placement.master == self.node || placement.mirrors.contains(&self.node)
            } else {
                master || placement.mirrors.contains(&self.node)
            };
            if here {
                wanted.insert(
                    (vhost.clone(), name.clone()),
                    (master, Settings::from_policy(ha), q.serial),
                );
            }
        }
        if !unmirrored.is_empty() {
            let mut b = lock(&self.broker);
            for (vhost, name) in unmirrored {
                b.serve_unmirrored(vhost, name);
            }
        }
        let mut reps = self
            .replicas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, (master, settings, serial)) in &wanted {
            match reps.get_mut(key) {
                None => {
                    let notify = Arc::new(Notify::new());
                    let stopping = Arc::new(AtomicBool::new(false));
                    let version = meta.queues.get(key).map_or(0, |q| q.view_version);
                    let (record, record_rx) = watch::channel(version);
                    reps.insert(
                        key.clone(),
                        Running {
                            serial: *serial,
                            master: *master,
                            settings: *settings,
                            notify: notify.clone(),
                            stopping: stopping.clone(),
                            record,
                            keep: true,
                        },
                    );
                    let me = self.clone();
                    let (k, m, s, n) = (key.clone(), *master, *settings, *serial);
                    self.tasks
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .spawn(async move {
                            let signals = Signals {
                                notify,
                                stopping,
                                record: record_rx,
                            };
                            me.run_replica(k, n, m, s, signals).await;
                        });
                }
                Some(r) if r.serial != *serial => {}
                Some(r) if r.settings != *settings && !r.stopping.load(Ordering::SeqCst) => {
                    r.settings = *settings;
                    lock(&self.broker).set_replica_settings(&key.0, &key.1, *settings);
                }
                Some(_) => {}
            }
        }
        // The replicas of the queues looked at: found by key when they are
        // few (a pass after a declare does not visit every replica).
        match only {
            Some(keys) => {
                for key in keys {
                    if let Some(r) = reps.get_mut(key) {
                        self.follow_record(key, r, meta, &wanted, &mirrored);
                    }
                }
            }
            None => {
                for (key, r) in reps.iter_mut() {
                    self.follow_record(key, r, meta, &wanted, &mirrored);
                }
            }
        }
    }

    /// Tells replica `r` of queue `key` its record's view version, and
    /// stops it if this node no longer wants it (`wanted`, as the pass
    /// found it).
    fn follow_record(
        &self,
        key: &QueueKey,
        r: &mut Running,
        meta: &Metadata,
        wanted: &BTreeMap<QueueKey, (bool, Settings, u64)>,
        mirrored: &BTreeSet<QueueKey>,
    ) {
        if let Some(q) = meta.queues.get(key)
            && q.serial == r.serial
        {
            r.record
                .send_if_modified(|v| std::mem::replace(v, q.view_version) != q.view_version);
        }
        let same = |(_, _, serial): &(bool, Settings, u64)| *serial == r.serial;
        if wanted.get(key).is_some_and(same) || r.stopping.load(Ordering::SeqCst) {
            return;
        }
        // A master that stops being mirrored keeps its queue: it leaves
        // the ring once its mirrors have gone. A master that moves hands
        // over at once. A replica of a queue deleted (and perhaps
        // declared again) goes.
        let gone = meta.queues.get(key).is_none_or(|q| q.serial != r.serial);
        let unmirrored = !mirrored.contains(key);
        if r.master && !gone && unmirrored && !lock(&self.broker).replica_alone(&key.0, &key.1) {
            return;
        }
        r.keep = unmirrored;
        r.stopping.store(true, Ordering::SeqCst);
        tracing::info!(node = %self.node, vhost = %key.0, queue = %key.1, master = r.master, "dropping this node's replica");
        r.notify.notify_one();
    }

    /// Joins the queue's ring, claims this node's place in the queue record,
    /// turns the broker's queue into a replica and moves its traffic until it
    /// stops.
    async fn run_replica(
        self: Arc<Self>,
        key: (String, String),
        serial: u64,
        master: bool,
        settings: Settings,
        signals: Signals,
    ) {
        let (vhost, name) = (key.0.clone(), key.1.clone());
        // The broker's queue is this declaration's if the metadata still
        // has the declaration after the broker had that queue: a node's
        // broker deletes a queue before the metadata does, and a client's
        // declare after a delete waits until this node applied the delete.
        // The replica takes that queue and no other (the queue may be
        // deleted and declared again while the replica starts).
        let queue = lock(&self.broker).queue_uid(&vhost, &name);
        let (ring_id, queue) = match (self.source.local().queue(&vhost, &name), queue) {
            (Some(q), Some(queue)) if q.serial == serial => (q.ring(), queue),
            _ => {
                self.forget(&key);
                return;
            }
        };
        let records = ClusterRecords::new(self.source.clone(), vhost.clone(), name.clone(), serial);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let started = self
            .start_replica(
                &vhost, &name, queue, &ring_id, master, settings, id, &records,
            )
            .await;
        let ring = match started {
            Ok(Some(ring)) => ring,
            Ok(None) => {
                self.forget(&key);
                return;
            }
            Err(e) => {
                // A queue deleted (or declared again) meanwhile wants no
                // replica of this declaration: nothing to retry.
                let current = self
                    .source
                    .local()
                    .queue(&vhost, &name)
                    .is_some_and(|q| q.serial == serial);
                if current {
                    tracing::warn!(node = %self.node, %vhost, queue = %name, error = %e, "could not start a replica; will retry");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                } else {
                    tracing::debug!(node = %self.node, %vhost, queue = %name, error = %e, "queue deleted before its replica started");
                }
                self.forget(&key);
                return;
            }
        };
        self.pump(&vhost, &name, id, ring, signals, &records).await;
        self.forget(&key);
    }

    fn forget(&self, key: &(String, String)) {
        self.replicas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key);
        self.ended
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.clone());
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_replica(
        &self,
        vhost: &str,
        name: &str,
        queue: u64,
        ring_id: &str,
        master: bool,
        settings: Settings,
        id: u64,
        records: &ClusterRecords<S>,
    ) -> Result<Option<RingHandle>, String> {
        let node = self.node.clone();
        let record = claim(records, |r| {
            let mut v = r.clone();
            if master {
                // Only the master the record names: one that another node
                // took over meanwhile (this node's view was older) is not
                // claimed back.
                if v.master == node {
                    v.mirrors.retain(|n| *n != node);
                    v.synchronised.retain(|n| *n != node);
                }
            } else {
                v.synchronised.retain(|n| *n != node);
                if !v.mirrors.contains(&node) && v.master != node {
                    v.mirrors.push(node.clone());
                }
            }
            v
        })
        .await
        .map_err(|e| format!("claiming the queue record: {e}"))?;
        // A master only where the record names this node (another node
        // may have taken over meanwhile: this node's view was older), and
        // a mirror only where it names another: the reconciler chose a
        // mirror from a record that was behind, and a mirror here would
        // wait for a master that never starts. The next pass starts the
        // right one.
        if master != (record.master == self.node) {
            return Ok(None);
        }
        self.remove_stale_members(ring_id).await?;
        let ring = self
            .gm
            .join(ring_id)
            .await
            .map_err(|e| format!("joining ring {ring_id}: {e}"))?;
        let waker = {
            let hub = self.hub.clone();
            Arc::new(move || hub.ready(id))
        };
        let start = ReplicaStart {
            queue,
            ring: ring_id.to_owned(),
            member: ring.member(),
            settings,
            record,
            master,
            waker,
        };
        let started = {
            let mut b = lock(&self.broker);
            let factory = fresh_queue(&b, vhost, name);
            b.start_replica(vhost, name, start, factory)
        };
        if !started {
            ring.leave().await;
            return Ok(None);
        }
        tracing::info!(node = %self.node, %vhost, queue = %name, ring = %ring_id, master, "replica started");
        Ok(Some(ring))
    }

    /// Removes this node's members of a previous run (a crash or restart
    /// left them in the ring's view, alive to a failure detector that sees
    /// this node up again: this node has no member in the ring right now),
    /// and members on nodes no longer in the cluster (forgotten).
    async fn remove_stale_members(&self, ring_id: &str) -> Result<(), String> {
        for _ in 0..100 {
            let view = self
                .authority
                .current(ring_id)
                .await
                .map_err(|e| format!("reading ring {ring_id}: {e}"))?;
            let members = self.source.local();
            let Some(stale) = view
                .entries
                .iter()
                .find(|e| {
                    e.alive
                        && (e.node.as_str() == self.node
                            || !members.nodes.contains_key(e.node.as_str()))
                })
                .map(|e| e.id)
            else {
                return Ok(());
            };
            tracing::info!(node = %self.node, ring = %ring_id, member = %stale, "removing this node's member from an earlier run");
            let _ = self
                .authority
                .update(ring_id, view.version, ViewChange::Remove(stale))
                .await;
        }
        Err(format!(
            "could not clean ring {ring_id} of this node's earlier members"
        ))
    }

    fn input(&self, vhost: &str, name: &str, input: MirrorInput) {
        lock(&self.broker).mirror_input(vhost, name, input, (self.clock)());
    }

    /// Feeds one replica what is rare (view changes and the ring events
    /// after them, its queue record, majority changes, ticks, the stop)
    /// while the hub moves its ring traffic, until it stops.
    async fn pump(
        &self,
        vhost: &str,
        name: &str,
        id: u64,
        ring: RingHandle,
        signals: Signals,
        records: &ClusterRecords<S>,
    ) {
        let Signals {
            notify,
            stopping,
            record: mut changes,
        } = signals;
        let ring = Arc::new(ring);
        let ring_id = ring.ring().to_owned();
        // Expiries are the broker's tick's; this one is only a safety net,
        // rare because every replica has one (1,000 queues at 50 ms were
        // 20,000 wake-ups a second per node).
        let mut tick = tokio::time::interval(self.replica_tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut majority = self.source.majority();
        let (rec_tx, mut rec_rx) = mpsc::channel::<RecordView>(16);
        let (slow_tx, mut slow_rx) = mpsc::unbounded_channel();
        let (done_tx, mut done_rx) = oneshot::channel();
        let joined = Arc::new(AtomicBool::new(false));
        let slow = Arc::new(AtomicBool::new(false));
        let propose = {
            let records = records.clone();
            Box::new(move |expected: u64, view: RecordView| {
                let records = records.clone();
                let tx = rec_tx.clone();
                tokio::spawn(async move {
                    let rec = match records.compare_and_set(expected, &view).await {
                        Ok(r) | Err(RecordError::Conflict(r)) => r,
                        // Deleted (or declared again): nothing to update.
                        Err(RecordError::Gone) => return,
                        Err(e) => {
                            tracing::warn!(error = %e, "queue record update failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            match records.local() {
                                Ok(r) => r,
                                Err(_) => return,
                            }
                        }
                    };
                    let _ = tx.send(rec).await;
                });
            })
        };
        self.hub.add(
            id,
            Entry {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
                ring: ring.clone(),
                joined: joined.clone(),
                slow: slow.clone(),
                slow_tx,
                propose,
                done: done_tx,
            },
        );
        {
            let hub = self.hub.clone();
            ring.on_ready(Arc::new(move || hub.ready(id)));
        }
        if !*majority.borrow_and_update() {
            self.input(vhost, name, MirrorInput::Majority(false));
        }
        // The record as the replica last had it.
        let mut seen: Option<RecordView> = None;
        let mut stop_requested = false;
        let stopped = self.stopped();
        tokio::pin!(stopped);
        let storage_failed = loop {
            tokio::select! {
                r = &mut done_rx => break r.unwrap_or(false),
                Some(events) = slow_rx.recv() => {
                    if self.on_ring(vhost, name, &ring, events).await {
                        joined.store(true, Ordering::SeqCst);
                    }
                    slow.store(false, Ordering::SeqCst);
                }
                () = notify.notified() => {}
                r = changes.changed() => {
                    if r.is_ok()
                        && let Ok(rec) = records.local()
                        && seen.as_ref() != Some(&rec)
                    {
                        seen = Some(rec.clone());
                        self.input(vhost, name, MirrorInput::Record(rec));
                    }
                }
                Some(rec) = rec_rx.recv() => {
                    seen = Some(rec.clone());
                    self.input(vhost, name, MirrorInput::RecordSettled(rec));
                }
                r = majority.changed() => {
                    if r.is_ok() {
                        let m = *majority.borrow_and_update();
                        self.input(vhost, name, MirrorInput::Majority(m));
                    }
                }
                _ = tick.tick() => self.input(vhost, name, MirrorInput::Tick),
                () = &mut stopped, if !stop_requested => {
                    stop_requested = true;
                    self.input(vhost, name, MirrorInput::Stop);
                }
            }
            if !stop_requested && stopping.load(Ordering::SeqCst) {
                stop_requested = true;
                self.input(vhost, name, MirrorInput::Stop);
            }
            // The hub takes and sends what the replica has to say.
            self.hub.ready(id);
        };
        ring.leave().await;
        // A mirror removed from its ring while its claim to be master was
        // on its way: the claim may still land, and then the record names
        // this node master and this copy is the one to serve (dropped, no
        // node would hold the queue). Its outcome decides, not the record
        // as this node last applied it.
        let mut claimed = None;
        if lock(&self.broker).replica_promoting(vhost, name)
            && !records.local().is_ok_and(|r| r.master == self.node)
        {
            tokio::select! {
                r = tokio::time::timeout(CLAIM_WAIT, rec_rx.recv()) => claimed = r.ok().flatten(),
                () = self.stopped() => {}
            }
        }
        // A master keeps its messages unless it handed over, or the
        // record names another master (which holds them). A node
        // that is stopping keeps them on disk but takes no more work.
        let (keep, ended_itself) = {
            let reps = self
                .replicas
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let r = reps.get(&(vhost.to_owned(), name.to_owned()));
            (
                r.is_none_or(|r| r.keep),
                r.is_some_and(|r| !r.stopping.load(Ordering::SeqCst)),
            )
        };
        let record = match (records.local().ok(), claimed) {
            (Some(local), Some(claimed)) if claimed.version > local.version => Some(claimed),
            (local, _) => local,
        };
        let serve = keep && record.as_ref().is_some_and(|r| r.master == self.node);
        // Removed from its ring, not stopped by the reconciler: the queue
        // is still mirrored, and a mirror the record counts synchronised
        // may be promoted. Its copy waits for this node's next replica.
        let hold = ended_itself
            && record
                .as_ref()
                .is_some_and(|r| r.synchronised.iter().any(|n| *n != self.node));
        // A master whose disk failed keeps its log but takes no more
        // work; a stopping node keeps what it has for its restart.
        let end = if storage_failed {
            ReplicaEnd::Failed
        } else if self.shutting_down() {
            ReplicaEnd::Keep
        } else if serve && hold {
            ReplicaEnd::Hold
        } else if serve {
            ReplicaEnd::Serve
        } else {
            ReplicaEnd::Drop
        };
        {
            let mut b = lock(&self.broker);
            let mut factory = fresh_queue(&b, vhost, name);
            b.end_replica(vhost, name, &mut factory, end);
        }
        tracing::info!(node = %self.node, %vhost, queue = %name, ring = %ring_id, "replica stopped");
        if storage_failed {
            self.recover_failed_master(vhost, name, records).await;
        }
    }

    /// After its disk failed, a master's replica stays down (the reconciler
    /// starts none here) until the record names another master (a
    /// synchronised mirror took over; this node becomes a mirror), or until
    /// the queue's log opens again (the disk works; every
    /// [`REOPEN_RETRY`]): the reconciler then starts it again as master from
    /// what the log holds, as a restart of the node would.
    async fn recover_failed_master(&self, vhost: &str, name: &str, records: &ClusterRecords<S>) {
        let mut changes = records.changes();
        let mut failures = 0u32;
        loop {
            if !records.local().is_ok_and(|r| r.master == self.node) || self.shutting_down() {
                return;
            }
            tokio::select! {
                r = changes.changed() => {
                    if r.is_err() { return }
                    continue;
                }
                () = tokio::time::sleep(REOPEN_RETRY) => {}
                () = self.stopped() => return,
            }
            if !records.local().is_ok_and(|r| r.master == self.node) {
                return;
            }
            match self.reopen(vhost, name) {
                Ok(()) => return,
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!(node = %self.node, %vhost, queue = %name, error = %e, "the queue's log does not open yet; retrying");
                    }
                }
            }
        }
    }

    /// Opens the log of queue `name` again after its disk failed (off the
    /// broker's lock) and hands the broker what it holds.
    fn reopen(&self, vhost: &str, name: &str) -> Result<(), String> {
        // A queue deleted meanwhile, or one with nothing on disk: nothing to open.
        let Some(plan) = lock(&self.broker).reopen_plan(vhost, name) else {
            return Ok(());
        };
        let (bq, report) = plan.open().map_err(|e| e.to_string())?;
        let meta = self.source.local();
        let serve = policy_set(&meta)
            .effective_for_queue(vhost, name, false)
            .mirroring()
            .is_none();
        if lock(&self.broker).restore_queue(vhost, name, bq, serve) {
            let cut = report
                .truncated
                .map(|(file, at)| format!("{}@{at}", file.display()));
            tracing::info!(node = %self.node, %vhost, queue = %name, messages = report.messages, torn_tail_cut = ?cut, "queue opened again from its log after the disk failure");
        }
        Ok(())
    }

    /// Whether the node is shutting down ([`stop`](Self::stop)).
    fn shutting_down(&self) -> bool {
        *self.stop.borrow()
    }

    /// Resolves once the node is shutting down (at once if it is).
    async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Feeds ring events; a view change is read from the authority first.
    /// Returns whether a view was installed.
    async fn on_ring(
        &self,
        vhost: &str,
        name: &str,
        ring: &RingHandle,
        events: Vec<RingEvent>,
    ) -> bool {
        let mut batch = Vec::new();
        let mut installed = false;
        for e in events {
            if let RingEvent::View { .. } = e {
                if !batch.is_empty() {
                    self.input(vhost, name, MirrorInput::Ring(std::mem::take(&mut batch)));
                }
                if let Ok(view) = self.authority.current(ring.ring()).await {
                    self.input(vhost, name, MirrorInput::View(view));
                    installed = true;
                }
            } else {
                batch.push(e);
            }
        }
        if !batch.is_empty() {
            self.input(vhost, name, MirrorInput::Ring(batch));
        }
        installed
    }

    /// Clean stop of every replica (masters hand over to synchronised
    /// mirrors), waiting at most `limit`.
    pub async fn stop(&self, limit: Duration) {
        self.stop.send_replace(true);
        let mut tasks = std::mem::take(
            &mut *self
                .tasks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let _ =
            tokio::time::timeout(limit, async { while tasks.join_next().await.is_some() {} }).await;
        if let Some(hub) = self
            .hub_task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            hub.abort();
        }
        // Let the last frames (a master's `Stopping`, the members' removal
        // from their rings) reach the peers before the connections drop.
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.gm.shutdown();
    }

    /// What the replica hub has done since the node started.
    pub fn hub_stats(&self) -> crate::HubStats {
        self.hub.stats()
    }

    /// Messages left to send while a sync of queue `name` runs on this node.
    pub fn sync_left(&self, vhost: &str, name: &str) -> Option<u64> {
        let p = lock(&self.broker).replica_status(vhost, name)?.syncing?;
        Some(p.total.saturating_sub(p.synced))
    }

    /// Starts a sync of a queue whose master is on this node.
    pub fn sync(&self, vhost: &str, name: &str) -> Result<(), String> {
        lock(&self.broker).sync_queue(vhost, name)
    }

    /// Cancels a sync of a queue whose master is on this node.
    pub fn cancel_sync(&self, vhost: &str, name: &str) -> Result<(), String> {
        lock(&self.broker).cancel_sync_queue(vhost, name)
    }
}

/// Reads the record and compare-and-sets `make(current)` until it sticks.
async fn claim(
    records: &impl RecordStore,
    make: impl Fn(&RecordView) -> RecordView,
) -> Result<RecordView, RecordError> {
    let mut current = records.local()?;
    for _ in 0..100 {
        let want = make(&current);
        if want.master == current.master
            && want.mirrors == current.mirrors
            && want.synchronised == current.synchronised
        {
            return Ok(current);
        }
        match records.compare_and_set(current.version, &want).await {
            Ok(r) => return Ok(r),
            Err(RecordError::Conflict(now)) => current = now,
            Err(e) => return Err(e),
        }
    }
    Err(RecordError::Unavailable("too many record conflicts".into()))
}

/// Makes a replica's fresh backing queue: an empty log in a durable queue's
/// directory on the broker's storage (old content deleted); for a
/// non-durable queue, memory and, past its budget, a log in its transient
/// directory; in memory alone for a queue with neither.
fn fresh_queue(b: &Broker, vhost: &str, name: &str) -> QueueFactory {
    let dir = b.queue_dir(vhost, name);
    let spill = b.spill_dir(vhost, name);
    let storage = b.storage();
    let journal = b.journal();
    let store = b.store_config(vhost, name);
    Box::new(move |cfg: QueueConfig| match (&dir, &spill) {
        (None, Some(spill)) => Ok(BackingQueue::spilling(storage.clone(), spill, cfg, store)),
        (Some(dir), _) => {
            if let Err(e) = warren_backing_queue::remove_log_dir(&*storage, journal.as_deref(), dir)
            {
                tracing::warn!(dir = %dir.display(), error = %e, "could not clear a mirror's old content");
            }
            BackingQueue::open_in(storage.clone(), dir, cfg, store).map(|(bq, _)| bq)
        }
        (None, None) => Ok(BackingQueue::in_memory(cfg)),
    })
}

/// The queues of `meta`, or those of them in `only`.
fn queues_of<'a>(
    meta: &'a Metadata,
    only: Option<&'a BTreeSet<QueueKey>>,
) -> Box<dyn Iterator<Item = (&'a QueueKey, &'a QueueRecord)> + 'a> {
    match only {
        None => Box::new(meta.queues.iter()),
        Some(keys) => Box::new(keys.iter().filter_map(|k| meta.queues.get_key_value(k))),
    }
}

/// A per-queue seed for spreading `exactly` mirrors over the nodes.
fn seed(vhost: &str, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in vhost.bytes().chain([0]).chain(name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cluster's policies as a matching set (invalid stored ones are skipped).
fn policy_set(meta: &Metadata) -> PolicySet {
    let mut set = PolicySet::new();
    for p in meta.policies.values() {
        let Ok(mut spec) = p.to_spec() else { continue };
        let kind = match p.name.strip_prefix(OPERATOR_PREFIX) {
            Some(n) => {
                spec = PolicySpec {
                    name: n.to_owned(),
                    ..spec
                };
                PolicyKind::Operator
            }
            None => PolicyKind::Regular,
        };
        if let Ok(policy) = Policy::new(kind, &spec) {
            set.set(policy);
        }
    }
    set
}
