//! The tokio driver: runs one [`Replica`] over a GM ring and the queue record.
//!
//! [`MirrorHandle::start_master`] / [`MirrorHandle::start_mirror`] spawn one
//! task per replica. It feeds the replica the ring's events (fetching each
//! installed view from the [`ViewAuthority`]), the queue record's changes
//! (from a [`RecordStore`]), a timer (TTL) and the local fsync, broadcasts
//! what the replica asks for, and runs its record compare-and-sets on the
//! side. The handle is what a broker calls; every call is answered by the
//! replica task, in order.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use warren_backing_queue::{BackingQueue, Delivery, DeliveryTag, Dropped, NewMessage, Stats};
use warren_cluster::{Cluster, ClusterError, QueueRecord, QueueView, Rejection};
use warren_gm::{RingEvent, RingHandle, View, ViewAuthority, ViewChange, ViewError, ViewVersion};

use crate::replica::{
    MirrorError, Output, QueueFactory, RecordView, Replica, Role, Settings, Status, SyncStart,
};
use crate::wire::{HeldPublishes, PublishId};

/// Why a record read or compare-and-set failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The record moved on: here is the current one.
    #[error("queue record conflict (now at version {})", .0.version)]
    Conflict(RecordView),
    /// The store could not answer (no majority, stopped, no such queue).
    #[error("queue record store: {0}")]
    Unavailable(String),
}

/// Where a queue's record lives: read, compare-and-set, and change notices.
#[async_trait]
pub trait RecordStore: Send + Sync + std::fmt::Debug {
    /// The record as this node knows it (may be stale).
    fn local(&self) -> Result<RecordView, RecordError>;
    /// Sets `view`'s placement if the record is at `expected`; returns the new record.
    async fn compare_and_set(
        &self,
        expected: u64,
        view: &RecordView,
    ) -> Result<RecordView, RecordError>;
    /// A receiver that changes whenever the record may have changed.
    fn changes(&self) -> watch::Receiver<u64>;
}

fn record_view(q: &QueueRecord) -> RecordView {
    RecordView {
        version: q.view_version,
        master: q.master.clone(),
        mirrors: q.mirrors.clone(),
        synchronised: q.synchronised.clone(),
    }
}

/// A queue's record in the Raft metadata store ([`warren_cluster::Cluster`]).
#[derive(Debug, Clone)]
pub struct ClusterRecords {
    cluster: Cluster,
    vhost: String,
    name: String,
}

impl ClusterRecords {
    /// The record of queue `name` in `vhost` (it must have been declared).
    pub fn new(cluster: Cluster, vhost: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            cluster,
            vhost: vhost.into(),
            name: name.into(),
        }
    }
}

#[async_trait]
impl RecordStore for ClusterRecords {
    fn local(&self) -> Result<RecordView, RecordError> {
        self.cluster
            .local()
            .queue(&self.vhost, &self.name)
            .map(record_view)
            .ok_or_else(|| RecordError::Unavailable(format!("no queue {:?}", self.name)))
    }

    async fn compare_and_set(
        &self,
        expected: u64,
        view: &RecordView,
    ) -> Result<RecordView, RecordError> {
        let qv = QueueView {
            master: view.master.clone(),
            mirrors: view.mirrors.clone(),
            synchronised: view.synchronised.clone(),
        };
        match self
            .cluster
            .set_queue_view(&self.vhost, &self.name, expected, qv)
            .await
        {
            Ok(q) => Ok(record_view(&q)),
            Err(ClusterError::Rejected(Rejection::ViewConflict { .. })) => {
                let meta = self
                    .cluster
                    .read_linearizable()
                    .await
                    .map_err(|e| RecordError::Unavailable(e.to_string()))?;
                meta.queue(&self.vhost, &self.name)
                    .map(|q| RecordError::Conflict(record_view(q)))
                    .ok_or_else(|| RecordError::Unavailable("queue deleted".into()))
                    .and_then(Err)
            }
            Err(e) => Err(RecordError::Unavailable(e.to_string())),
        }
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.cluster.metadata_changes()
    }
}

/// A [`ViewAuthority`] for GM rings whose views live in the Raft metadata
/// store: each view is postcard-encoded in the cluster's ring register
/// ([`Cluster::set_ring_view`]), whose version is the view's version, so
/// every ring change is a compare-and-set committed by a majority. A node in
/// a minority reads its last applied view and cannot change any.
#[derive(Debug, Clone)]
pub struct ClusterViewAuthority {
    cluster: Cluster,
}

impl ClusterViewAuthority {
    /// An authority over this node's cluster handle.
    pub fn new(cluster: Cluster) -> Self {
        Self { cluster }
    }

    fn decode(bytes: Option<&[u8]>) -> View {
        bytes
            .and_then(|b| postcard::from_bytes(b).ok())
            .unwrap_or_else(View::empty)
    }

    fn local_view(&self, ring: &str) -> View {
        Self::decode(
            self.cluster
                .local()
                .rings
                .get(ring)
                .map(|r| r.view.as_slice()),
        )
    }
}

#[async_trait]
impl ViewAuthority for ClusterViewAuthority {
    async fn current(&self, ring: &str) -> Result<View, ViewError> {
        // A stale view would make the ring drop a proposal (a removal or an
        // erasure it thinks already done), so try hard for a fresh one.
        for _ in 0..3 {
            if let Ok(meta) = self.cluster.read_linearizable().await {
                return Ok(Self::decode(
                    meta.rings.get(ring).map(|r| r.view.as_slice()),
                ));
            }
        }
        // In a minority: what this node applied (it cannot change anything anyway).
        Ok(self.local_view(ring))
    }

    async fn current_local(&self, ring: &str) -> Result<View, ViewError> {
        // What this node applied: no round trip to the leader (the GM
        // driver's poll reads 1,000 rings a second on a node with 1,000
        // queues; linearizable, that was a fifth of an idle node's CPU).
        Ok(self.local_view(ring))
    }

    async fn update(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: ViewChange,
    ) -> Result<View, ViewError> {
        let current = self.current(ring).await?;
        if current.version != expected {
            return Err(ViewError::Conflict {
                expected,
                current: current.version,
            });
        }
        let next = current.apply(&change)?;
        let bytes = postcard::to_allocvec(&next).map_err(|_| ViewError::Conflict {
            expected,
            current: current.version,
        })?;
        match self.cluster.set_ring_view(ring, expected, bytes).await {
            Ok(_) => Ok(next),
            Err(ClusterError::Rejected(Rejection::ViewConflict { current, .. })) => {
                Err(ViewError::Conflict { expected, current })
            }
            Err(e) => {
                tracing::warn!(%ring, error = %e, "ring view change not committed");
                Err(ViewError::Conflict {
                    expected,
                    current: expected,
                })
            }
        }
    }
}

/// A queue record in memory, shared by the replicas of one process (tests,
/// single-process simulations).
#[derive(Debug)]
pub struct MemRecords {
    record: Mutex<RecordView>,
    changes: watch::Sender<u64>,
}

impl MemRecords {
    /// A record with this placement at version 1.
    pub fn new(master: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            record: Mutex::new(RecordView {
                version: 1,
                master: master.into(),
                mirrors: Vec::new(),
                synchronised: Vec::new(),
            }),
            changes: watch::Sender::new(0),
        })
    }

    /// The current record.
    pub fn get(&self) -> RecordView {
        self.record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[async_trait]
impl RecordStore for MemRecords {
    fn local(&self) -> Result<RecordView, RecordError> {
        Ok(self.get())
    }

    async fn compare_and_set(
        &self,
        expected: u64,
        view: &RecordView,
    ) -> Result<RecordView, RecordError> {
        let mut r = self.record.lock().unwrap_or_else(|e| e.into_inner());
        if r.version != expected {
            return Err(RecordError::Conflict(r.clone()));
        }
        *r = RecordView {
            version: expected + 1,
            ..view.clone()
        };
        let out = r.clone();
        drop(r);
        self.changes.send_modify(|v| *v += 1);
        Ok(out)
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// How a publish ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// Held by every member of the view (and on disk where it must be): `basic.ack`.
    Ack,
    /// Will not be confirmed by this master (deposed or stopped): `basic.nack`, resend.
    Nack,
}

/// What a replica tells its broker besides call results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MirrorEvent {
    /// This replica became master; publishes up to `held[publisher]` are held
    /// (confirm the ones pending at the old master), the others must be
    /// resent. Resolve them before publishing anything to this master.
    Promoted {
        /// The new epoch.
        epoch: u64,
        /// Held publishes per publisher.
        held: HeldPublishes,
    },
    /// This master was deposed (its pending publishes were nacked).
    Deposed {
        /// Its epoch.
        epoch: u64,
    },
    /// This mirror now holds the master's state.
    SyncComplete,
    /// The master dropped messages (dead-lettering input).
    Dropped(Vec<Dropped>),
    /// The replica stopped (removed from the ring, deposed, or stop requested).
    Stopped,
}

/// Settings of one replica task.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// The queue's name (for logs).
    pub queue: String,
    /// This node's name (as in the queue record).
    pub node: String,
    /// The ring's name (as joined with [`warren_gm::GmNode::join`]).
    pub ring: String,
    /// Mirroring settings.
    pub settings: Settings,
    /// Timer period: TTL expiry and sync pacing.
    pub tick: Duration,
}

impl DriverConfig {
    /// Defaults: a 10 ms tick.
    pub fn new(queue: impl Into<String>, node: impl Into<String>, ring: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            node: node.into(),
            ring: ring.into(),
            settings: Settings::default(),
            tick: Duration::from_millis(10),
        }
    }
}

type Reply<T> = oneshot::Sender<Result<T, MirrorError>>;

enum Cmd {
    Publish(PublishId, NewMessage, oneshot::Sender<Confirm>),
    Fetch(Reply<Option<Delivery>>),
    Ack(DeliveryTag, Reply<()>),
    Requeue(DeliveryTag, Reply<()>),
    Discard(DeliveryTag, Reply<()>),
    Purge(Reply<u64>),
    Stats(oneshot::Sender<Option<Stats>>),
    Sync(Reply<SyncStart>),
    CancelSync(Reply<bool>),
    SetSettings(Settings),
    Stop(oneshot::Sender<()>),
}

/// The async API of one replica (master or mirror) of a mirrored queue.
///
/// Cheap to clone; the task stops when [`stop`](Self::stop) is called, the
/// ring member is removed, or every handle is dropped.
#[derive(Debug, Clone)]
pub struct MirrorHandle {
    cmd: mpsc::Sender<Cmd>,
    status: watch::Receiver<Status>,
    events: broadcast::Sender<MirrorEvent>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl MirrorHandle {
    /// Starts this node's replica as the queue's master, holding `bq` (new or
    /// recovered; made with `record_ops`). It first claims the record (a
    /// compare-and-set naming this node master), whose new version is its epoch.
    pub async fn start_master(
        cfg: DriverConfig,
        ring: RingHandle,
        authority: Arc<dyn ViewAuthority>,
        records: Arc<dyn RecordStore>,
        factory: QueueFactory,
        bq: BackingQueue,
    ) -> Result<Self, RecordError> {
        let rec = claim(&*records, |r| RecordView {
            master: cfg.node.clone(),
            mirrors: r
                .mirrors
                .iter()
                .filter(|n| **n != cfg.node)
                .cloned()
                .collect(),
            synchronised: r
                .synchronised
                .iter()
                .filter(|n| **n != cfg.node)
                .cloned()
                .collect(),
            ..r.clone()
        })
        .await?;
        let replica = Replica::new_master(
            cfg.queue.clone(),
            cfg.node.clone(),
            ring.member(),
            cfg.settings,
            factory,
            bq,
            rec,
        );
        Ok(Self::spawn(cfg, ring, authority, records, replica))
    }

    /// Starts this node's replica as a mirror: records the node as an
    /// unsynchronised mirror (dropping any old claim to be synchronised),
    /// then follows the master; it holds nothing until synchronised.
    pub async fn start_mirror(
        cfg: DriverConfig,
        ring: RingHandle,
        authority: Arc<dyn ViewAuthority>,
        records: Arc<dyn RecordStore>,
        factory: QueueFactory,
    ) -> Result<Self, RecordError> {
        let node = cfg.node.clone();
        let rec = claim(&*records, |r| {
            let mut v = r.clone();
            v.synchronised.retain(|n| *n != node);
            if !v.mirrors.contains(&node) && v.master != node {
                v.mirrors.push(node.clone());
            }
            v
        })
        .await?;
        let replica = Replica::new_mirror(
            cfg.queue.clone(),
            cfg.node.clone(),
            ring.member(),
            cfg.settings,
            factory,
            rec,
        );
        Ok(Self::spawn(cfg, ring, authority, records, replica))
    }

    fn spawn(
        cfg: DriverConfig,
        ring: RingHandle,
        authority: Arc<dyn ViewAuthority>,
        records: Arc<dyn RecordStore>,
        replica: Replica,
    ) -> Self {
        let (cmd_tx, cmd_rx) = mpsc::channel(4096);
        let (status_tx, status_rx) = watch::channel(replica.status());
        let (events, _) = broadcast::channel(1024);
        let (rec_tx, rec_rx) = mpsc::channel(16);
        let task = Task {
            cfg,
            ring: Arc::new(ring),
            authority,
            records,
            replica,
            status: status_tx,
            events: events.clone(),
            confirms: BTreeMap::new(),
            fetches: BTreeMap::new(),
            outgoing: Vec::new(),
            sends: Vec::new(),
            joined: false,
            rec_tx,
            stopping: None,
        };
        tokio::spawn(task.run(cmd_rx, rec_rx));
        Self {
            cmd: cmd_tx,
            status: status_rx,
            events,
        }
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, MirrorError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(make(tx))
            .await
            .map_err(|_| MirrorError::Stopped)?;
        rx.await.map_err(|_| MirrorError::Stopped)?
    }

    /// Publishes (master only). The receiver yields [`Confirm::Ack`] once the
    /// message is confirmed, [`Confirm::Nack`] if it never will be; it is
    /// dropped without a value if the replica stops first (treat as nack).
    /// On a mirror the publish is nacked at once: forward it to the master.
    pub async fn publish(
        &self,
        id: PublishId,
        msg: NewMessage,
    ) -> Result<oneshot::Receiver<Confirm>, MirrorError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Publish(id, msg, tx))
            .await
            .map_err(|_| MirrorError::Stopped)?;
        Ok(rx)
    }

    /// Fetches the next message, pending ack (master only); `None` if empty.
    pub async fn fetch(&self) -> Result<Option<Delivery>, MirrorError> {
        self.call(Cmd::Fetch).await
    }

    /// Acks a delivery (master only).
    pub async fn ack(&self, tag: DeliveryTag) -> Result<(), MirrorError> {
        self.call(|r| Cmd::Ack(tag, r)).await
    }

    /// Requeues a delivery (master only).
    pub async fn requeue(&self, tag: DeliveryTag) -> Result<(), MirrorError> {
        self.call(|r| Cmd::Requeue(tag, r)).await
    }

    /// Rejects a delivery without requeue (master only).
    pub async fn discard(&self, tag: DeliveryTag) -> Result<(), MirrorError> {
        self.call(|r| Cmd::Discard(tag, r)).await
    }

    /// Purges the ready messages (master only); returns how many.
    pub async fn purge(&self) -> Result<u64, MirrorError> {
        self.call(Cmd::Purge).await
    }

    /// Message counts, if this replica holds the queue's state.
    pub async fn stats(&self) -> Option<Stats> {
        let (tx, rx) = oneshot::channel();
        self.cmd.send(Cmd::Stats(tx)).await.ok()?;
        rx.await.ok().flatten()
    }

    /// Starts synchronising unsynchronised mirrors (master only); returns at once.
    pub async fn sync(&self) -> Result<SyncStart, MirrorError> {
        self.call(Cmd::Sync).await
    }

    /// Cancels a running sync (master only); `false` if none was running.
    pub async fn cancel_sync(&self) -> Result<bool, MirrorError> {
        self.call(Cmd::CancelSync).await
    }

    /// Applies new mirroring settings (a policy changed).
    pub async fn set_settings(&self, settings: Settings) -> Result<(), MirrorError> {
        self.cmd
            .send(Cmd::SetSettings(settings))
            .await
            .map_err(|_| MirrorError::Stopped)
    }

    /// Role and synchronisation state, as of the replica's last turn.
    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// A receiver of status changes.
    pub fn watch_status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Promotion, deposition, sync and drop events.
    pub fn events(&self) -> broadcast::Receiver<MirrorEvent> {
        self.events.subscribe()
    }

    /// Clean stop: a master tells its mirrors (promotion per
    /// `ha-promote-on-shutdown`) and nacks what it had not confirmed. The
    /// caller then leaves the ring (stops its GM node or member).
    pub async fn stop(&self) {
        let (tx, rx) = oneshot::channel();
        if self.cmd.send(Cmd::Stop(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// Reads the record and compare-and-sets `make(current)` until it sticks.
async fn claim(
    records: &dyn RecordStore,
    make: impl Fn(&RecordView) -> RecordView,
) -> Result<RecordView, RecordError> {
    let mut current = records.local()?;
    for _ in 0..100 {
        match records
            .compare_and_set(current.version, &make(&current))
            .await
        {
            Ok(r) => return Ok(r),
            Err(RecordError::Conflict(now)) => current = now,
            Err(e) => return Err(e),
        }
    }
    Err(RecordError::Unavailable("too many record conflicts".into()))
}

struct Task {
    cfg: DriverConfig,
    ring: Arc<RingHandle>,
    authority: Arc<dyn ViewAuthority>,
    records: Arc<dyn RecordStore>,
    replica: Replica,
    status: watch::Sender<Status>,
    events: broadcast::Sender<MirrorEvent>,
    confirms: BTreeMap<PublishId, oneshot::Sender<Confirm>>,
    fetches: BTreeMap<u64, Reply<Option<Delivery>>>,
    outgoing: Vec<Bytes>,
    /// Point-to-point messages to send ([`Output::Send`]).
    sends: Vec<(warren_gm::MemberId, Bytes)>,
    joined: bool,
    rec_tx: mpsc::Sender<RecordView>,
    stopping: Option<oneshot::Sender<()>>,
}

impl Task {
    async fn run(
        mut self,
        mut cmd_rx: mpsc::Receiver<Cmd>,
        mut rec_rx: mpsc::Receiver<RecordView>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut changes = self.records.changes();
        let mut ring_events = Vec::new();
        let ring = self.ring.clone();
        loop {
            tokio::select! {
                alive = ring.next_events(&mut ring_events) => {
                    if !alive {
                        self.replica.handle_removed();
                    } else {
                        let events = std::mem::take(&mut ring_events);
                        self.on_ring(events).await;
                    }
                }
                cmd = cmd_rx.recv() => match cmd {
                    Some(cmd) => {
                        self.on_cmd(cmd);
                        // Take whatever else is ready: one flush per turn.
                        for _ in 0..256 {
                            match cmd_rx.try_recv() {
                                Ok(cmd) => self.on_cmd(cmd),
                                Err(_) => break,
                            }
                        }
                    }
                    None => self.replica.stop(),
                },
                changed = changes.changed() => {
                    if changed.is_ok() && let Ok(rec) = self.records.local() {
                        self.replica.handle_record(rec);
                    }
                }
                Some(rec) = rec_rx.recv() => self.replica.record_settled(rec),
                _ = tick.tick() => self.replica.tick(now_ms()),
            }
            self.replica.flush();
            if self.replica.needs_storage_sync()
                && let Err(e) = self.replica.sync_storage()
            {
                tracing::error!(node = %self.cfg.node, queue = %self.cfg.queue, view = self.replica.epoch(), error = %e, "local fsync failed");
            }
            self.drain_outputs().await;
            let _ = self.status.send_replace(self.replica.status());
            if self.replica.role() == Role::Stopped {
                let _ = self.events.send(MirrorEvent::Stopped);
                for (_, tx) in std::mem::take(&mut self.confirms) {
                    let _ = tx.send(Confirm::Nack);
                }
                if let Some(tx) = self.stopping.take() {
                    let _ = tx.send(());
                }
                tracing::info!(node = %self.cfg.node, queue = %self.cfg.queue, view = self.replica.epoch(), "replica task stopped");
                return;
            }
        }
    }

    async fn on_ring(&mut self, events: Vec<RingEvent>) {
        for e in events {
            match e {
                RingEvent::View { .. } => {
                    self.joined = true;
                    if let Ok(view) = self.authority.current(&self.cfg.ring).await {
                        // Whatever the ring delivered before that view was
                        // committed is in the queue already: take it first.
                        let mut more = Vec::new();
                        while let Some(true) = self.ring.next_events(&mut more).now_or_never() {
                            if more.is_empty() {
                                break;
                            }
                            for e in more.drain(..) {
                                self.replica.handle_ring_event(e);
                            }
                        }
                        self.replica.handle_view(view);
                    }
                }
                e => self.replica.handle_ring_event(e),
            }
        }
    }

    fn on_cmd(&mut self, cmd: Cmd) {
        let r = &mut self.replica;
        match cmd {
            Cmd::Publish(id, msg, tx) => match r.publish(now_ms(), id, msg) {
                Ok(()) => {
                    self.confirms.insert(id, tx);
                }
                Err(_) => {
                    let _ = tx.send(Confirm::Nack);
                }
            },
            Cmd::Fetch(tx) => match r.fetch(now_ms()) {
                Ok(token) => {
                    self.fetches.insert(token, tx);
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            },
            Cmd::Ack(tag, tx) => {
                let _ = tx.send(r.ack(tag));
            }
            Cmd::Requeue(tag, tx) => {
                let _ = tx.send(r.requeue(tag));
            }
            Cmd::Discard(tag, tx) => {
                let _ = tx.send(r.discard(tag));
            }
            Cmd::Purge(tx) => {
                let _ = tx.send(r.purge());
            }
            Cmd::Stats(tx) => {
                let _ = tx.send(r.stats());
            }
            Cmd::Sync(tx) => {
                let _ = tx.send(r.sync());
            }
            Cmd::CancelSync(tx) => {
                let _ = tx.send(r.cancel_sync());
            }
            Cmd::SetSettings(s) => r.set_settings(s),
            Cmd::Stop(tx) => {
                r.stop();
                self.stopping = Some(tx);
            }
        }
    }

    async fn drain_outputs(&mut self) {
        let outputs: Vec<Output> = self.replica.drain_outputs().collect();
        for o in outputs {
            match o {
                Output::Broadcast(b) => self.outgoing.push(b),
                Output::Send { to, payload } => self.sends.push((to, payload)),
                Output::ProposeRecord {
                    expected_version,
                    view,
                } => {
                    let records = self.records.clone();
                    let tx = self.rec_tx.clone();
                    tokio::spawn(async move {
                        let rec = match records.compare_and_set(expected_version, &view).await {
                            Ok(r) | Err(RecordError::Conflict(r)) => r,
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
                }
                Output::Confirmed(ids) => {
                    for id in ids {
                        if let Some(tx) = self.confirms.remove(&id) {
                            let _ = tx.send(Confirm::Ack);
                        }
                    }
                }
                Output::Nacked(ids) => {
                    for id in ids {
                        if let Some(tx) = self.confirms.remove(&id) {
                            let _ = tx.send(Confirm::Nack);
                        }
                    }
                }
                Output::Fetched { token, delivery } => {
                    if let Some(tx) = self.fetches.remove(&token) {
                        let _ = tx.send(Ok(delivery));
                    }
                }
                Output::FetchFailed { token } => {
                    if let Some(tx) = self.fetches.remove(&token) {
                        let _ = tx.send(Err(MirrorError::Stopped));
                    }
                }
                Output::Promoted { epoch, held } => {
                    let _ = self.events.send(MirrorEvent::Promoted { epoch, held });
                }
                Output::Deposed { epoch } => {
                    let _ = self.events.send(MirrorEvent::Deposed { epoch });
                }
                Output::SyncComplete => {
                    let _ = self.events.send(MirrorEvent::SyncComplete);
                }
                Output::Dropped(d) => {
                    let _ = self.events.send(MirrorEvent::Dropped(d));
                }
            }
        }
        if self.joined && !self.outgoing.is_empty() {
            let batch = std::mem::take(&mut self.outgoing);
            if let Err(e) = self.ring.broadcast(batch).await {
                tracing::warn!(node = %self.cfg.node, queue = %self.cfg.queue, view = self.replica.epoch(), error = %e, "ring broadcast failed");
                self.replica.handle_removed();
            }
        }
        for (to, payload) in std::mem::take(&mut self.sends) {
            // Lost only with the link; a new link has the replica report again.
            let _ = self.ring.send(to, payload).await;
        }
    }
}
