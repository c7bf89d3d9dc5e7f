//! A node of several shards (`--shards N`, a single node only): its queues
//! are spread over N brokers, each behind its own lock, so that broker work
//! runs on as many cores as there are shards.
//!
//! Each shard is a [`Broker`] of its own, with its own data directory
//! (shard 0: the node's, so a node that ran unsharded keeps its queues
//! there; shard k: `<data_dir>/shards/<k>`), group commit, ticker and
//! alarms. The shards share their metadata as the nodes of a cluster share
//! theirs, through [`ShardMetadata`]: the cluster's own state machine
//! ([`Metadata`]) in memory, every change appended to a log on disk before
//! it is applied, and replayed on every shard's broker by the cluster's
//! replay loop (`cluster::replay_loop`). A queue's master is a shard (its
//! `queue-master-locator`; `client-local`, the default, is the shard of the
//! declaring connection), and work for a queue of another shard goes there
//! as [`LinkMsg`]s over in-process links ([`start_links`]), exactly as work
//! for a queue of another node goes over the network. Clients are spread
//! over the shards in turn, each served on its shard's thread
//! ([`Shards::spawn`]), and move to the shard of the first existing queue
//! they name (`broker/moving.rs`, `client.rs`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::File;
use std::future::Future;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};
use warren_broker::meta::MetadataStore;
use warren_broker::{Broker, BrokerConfig, LinkMsg};
use warren_cluster::{ClusterError, Command, Metadata, Outcome};
use warren_mirror_driver::MetadataSource;
use warren_transport::NodeName;

use crate::cluster::ClusterStore;
use crate::{Shared, lock, now_ms};

/// Where the shards' metadata lives, under the node's data directory.
const SHARDS_DIR: &str = "shards";

/// The log is folded into a new snapshot once it outgrows this, or the
/// snapshot if that is larger.
const COMPACT_AT: u64 = 1024 * 1024;

/// How often a metadata log that could not be written is tried again.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// How long a change waits for the other shards to have replayed it.
const REPLAY_WAIT: Duration = Duration::from_secs(2);

/// Shard `k`'s name: the node's for shard 0, `<node>/shard<k>` for the
/// others (what the management API shows as a queue's node).
pub(crate) fn shard_name(node: &str, k: usize) -> String {
    if k == 0 {
        node.to_owned()
    } else {
        format!("{node}/shard{k}")
    }
}

/// The first connection id shard `k` gives out: each shard's ids are its
/// own, 2^40 apart.
pub(crate) fn first_conn_id(k: usize) -> u64 {
    1 + ((k as u64) << 40)
}

/// Shard `k`'s data directory.
pub(crate) fn shard_dir(data_dir: &Path, k: usize) -> PathBuf {
    if k == 0 {
        data_dir.to_owned()
    } else {
        data_dir.join(SHARDS_DIR).join(k.to_string())
    }
}

/// Whether `data_dir` was last run with shards (its metadata is then theirs,
/// not `metadata.json`).
pub(crate) fn was_sharded(data_dir: &Path) -> bool {
    data_dir.join(SHARDS_DIR).join(SNAPSHOT).exists()
}

const SNAPSHOT: &str = "metadata.snapshot";
const LOG: &str = "metadata.log";

/// What the snapshot file holds.
#[derive(Serialize, Deserialize)]
struct Snapshot {
    /// The shards' names, in order: a node started with another count is
    /// refused (its queues' masters name these).
    shards: Vec<String>,
    /// Changes applied so far.
    index: u64,
    metadata: Metadata,
}

/// The metadata's files: a snapshot, and the log of changes since.
struct MetaLog {
    dir: PathBuf,
    log: File,
    log_bytes: u64,
    snapshot_bytes: u64,
}

/// Empties the log at `path` and opens it for appending.
fn empty_log(path: &Path) -> std::io::Result<File> {
    File::create(path)?;
    std::fs::OpenOptions::new().append(true).open(path)
}

/// Writes `bytes` to `path` atomically and durably.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

impl MetaLog {
    /// Opens the metadata of `shards` in `dir`: the snapshot, then the
    /// changes logged after it (a torn last record, a crash in its append,
    /// is cut off). What a restart drops (non-durable and exclusive queues,
    /// non-durable exchanges, and their bindings) is dropped, and a fresh
    /// snapshot written.
    fn open(dir: &Path, shards: &[String]) -> anyhow::Result<(Self, Metadata, u64)> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (mut meta, mut index) = match std::fs::read(dir.join(SNAPSHOT)) {
            Ok(bytes) => {
                let s: Snapshot = postcard::from_bytes(&bytes)
                    .with_context(|| format!("reading {}", dir.join(SNAPSHOT).display()))?;
                anyhow::ensure!(
                    s.shards == shards,
                    "{} was run with --shards {}; start it with that count (its queues live on those shards)",
                    dir.display(),
                    s.shards.len()
                );
                (s.metadata, s.index)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Metadata::default(), 0),
            Err(e) => return Err(e).context("reading the shards' metadata snapshot"),
        };
        let mut bytes = Vec::new();
        match File::open(dir.join(LOG)) {
            Ok(mut f) => {
                f.read_to_end(&mut bytes)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).context("reading the shards' metadata log"),
        }
        let mut at = 0;
        while let Some(len) = bytes.get(at..at + 4) {
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let Some(record) = bytes.get(at + 4..at + 4 + len) else {
                break;
            };
            let Ok(cmd) = postcard::from_bytes::<Command>(record) else {
                break;
            };
            let _ = meta.apply(&cmd);
            index += 1;
            at += 4 + len;
        }
        forget_transient(&mut meta);
        let members: BTreeMap<String, String> =
            shards.iter().map(|s| (s.clone(), String::new())).collect();
        meta.apply_membership(index, &members);
        let mut log = Self {
            dir: dir.to_owned(),
            log: empty_log(&dir.join(LOG))?,
            log_bytes: 0,
            snapshot_bytes: 0,
        };
        log.snapshot(&meta, index, shards)?;
        Ok((log, meta, index))
    }

    /// Writes `meta` as the snapshot and empties the log.
    fn snapshot(&mut self, meta: &Metadata, index: u64, shards: &[String]) -> std::io::Result<()> {
        let s = Snapshot {
            shards: shards.to_vec(),
            index,
            metadata: meta.clone(),
        };
        let bytes = postcard::to_stdvec(&s).map_err(std::io::Error::other)?;
        write_atomic(&self.dir.join(SNAPSHOT), &bytes)?;
        self.log = empty_log(&self.dir.join(LOG))?;
        self.log.sync_all()?;
        self.log_bytes = 0;
        self.snapshot_bytes = bytes.len() as u64;
        Ok(())
    }

    /// Appends `cmd` and makes it durable.
    fn append(&mut self, cmd: &Command) -> std::io::Result<()> {
        let record = postcard::to_stdvec(cmd).map_err(std::io::Error::other)?;
        let len = u32::try_from(record.len()).map_err(std::io::Error::other)?;
        let mut buf = Vec::with_capacity(record.len() + 4);
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&record);
        if let Err(e) = self.log.write_all(&buf).and_then(|()| self.log.sync_data()) {
            // Nothing of it may stay for the next record to follow.
            let _ = self.log.set_len(self.log_bytes);
            return Err(e);
        }
        self.log_bytes += buf.len() as u64;
        Ok(())
    }
}

/// Drops what a single node's restart drops: non-durable and exclusive
/// queues, non-durable exchanges, and bindings to or from either.
fn forget_transient(meta: &mut Metadata) {
    meta.queues = std::mem::take(&mut meta.queues)
        .into_iter()
        .filter(|(_, q)| q.durable && q.exclusive_owner.is_none())
        .collect();
    meta.exchanges.retain(|_, x| x.durable);
    let (queues, exchanges) = (&meta.queues, &meta.exchanges);
    let exists = |vhost: &str, name: &str, queue: bool| {
        let key = (vhost.to_owned(), name.to_owned());
        name.is_empty()
            || name.starts_with("amq.")
            || if queue {
                queues.contains_key(&key)
            } else {
                exchanges.contains_key(&key)
            }
    };
    meta.bindings.retain(|b| {
        exists(&b.vhost, &b.source, false)
            && exists(
                &b.vhost,
                &b.destination,
                b.destination_kind == warren_cluster::DestinationKind::Queue,
            )
    });
}

/// The metadata and its files, shared by the shards' handles.
struct MetaState {
    meta: Arc<Metadata>,
    index: u64,
    log: MetaLog,
    shards: Vec<String>,
}

struct MetaShared {
    state: Mutex<MetaState>,
    changes: watch::Sender<u64>,
    up: watch::Sender<BTreeSet<NodeName>>,
    downs: watch::Sender<BTreeMap<NodeName, u64>>,
    majority: watch::Sender<bool>,
    /// The shards, in order.
    names: Vec<NodeName>,
    /// What each shard's broker has replayed (`None`: its replays have
    /// not started; its first takes in everything).
    replayed: BTreeMap<NodeName, watch::Sender<Option<u64>>>,
}

/// The shards' metadata, as one shard sees it: the [`MetadataSource`] its
/// broker's store, commits and replays go through (as a cluster node's go
/// through Raft). Every shard is always up and in the majority.
#[derive(Clone)]
pub(crate) struct ShardMetadata {
    me: NodeName,
    shared: Arc<MetaShared>,
}

impl std::fmt::Debug for ShardMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardMetadata")
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

impl ShardMetadata {
    /// Opens the metadata of the `n` shards of node `node` in `data_dir`,
    /// seen from shard 0 ([`for_shard`](Self::for_shard) for the others).
    pub(crate) fn open(data_dir: &Path, node: &str, n: usize) -> anyhow::Result<Self> {
        let shards: Vec<String> = (0..n).map(|k| shard_name(node, k)).collect();
        let names: Vec<NodeName> = shards
            .iter()
            .map(|s| NodeName::new(s.clone()))
            .collect::<Result<_, _>>()
            .context("a shard's name")?;
        let (log, meta, index) = MetaLog::open(&data_dir.join(SHARDS_DIR), &shards)?;
        let shared = MetaShared {
            state: Mutex::new(MetaState {
                meta: Arc::new(meta),
                index,
                log,
                shards,
            }),
            changes: watch::Sender::new(index),
            up: watch::Sender::new(names.iter().cloned().collect()),
            downs: watch::Sender::new(BTreeMap::new()),
            majority: watch::Sender::new(true),
            replayed: names
                .iter()
                .map(|n| (n.clone(), watch::Sender::new(None)))
                .collect(),
            names,
        };
        Ok(Self {
            me: shared.names[0].clone(),
            shared: Arc::new(shared),
        })
    }

    /// The same metadata, seen from shard `k`.
    pub(crate) fn for_shard(&self, k: usize) -> Self {
        let me = self
            .shared
            .names
            .get(k)
            .cloned()
            .unwrap_or_else(|| self.me.clone());
        Self {
            me,
            shared: self.shared.clone(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MetaState> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies `cmd` once it is on disk; the index it was applied at.
    /// Applies `cmd` once it is on disk; the index it was applied at. A
    /// log that cannot be written (a full disk) is tried again every
    /// [`RETRY_EVERY`] until it can, as a single node's metadata file is:
    /// the change is answered then, never refused for the disk.
    fn write_now(&self, cmd: &Command) -> Result<(Outcome, u64), ClusterError> {
        let mut failed = false;
        loop {
            let mut st = self.state();
            let mut next = Metadata::clone(&st.meta);
            let outcome = next.apply(cmd).result?;
            if let Err(e) = st.log.append(cmd) {
                if !failed {
                    tracing::error!(error = %e, "writing the shards' metadata log failed; retrying every second");
                    failed = true;
                }
                // Not holding the metadata: its readers go on meanwhile.
                drop(st);
                std::thread::sleep(RETRY_EVERY);
                continue;
            }
            st.index += 1;
            let index = st.index;
            if st.log.log_bytes > COMPACT_AT.max(st.log.snapshot_bytes) {
                let shards = st.shards.clone();
                if let Err(e) = st.log.snapshot(&next, index, &shards) {
                    // The log still holds every change: compacted next time.
                    tracing::warn!(error = %e, "could not write the shards' metadata snapshot");
                }
            }
            st.meta = Arc::new(next);
            drop(st);
            if failed {
                tracing::info!("the shards' metadata log is written again");
            }
            self.shared.changes.send_replace(index);
            return Ok((outcome, index));
        }
    }
}

#[async_trait]
impl MetadataSource for ShardMetadata {
    fn node(&self) -> &NodeName {
        &self.me
    }

    fn local(&self) -> Arc<Metadata> {
        self.state().meta.clone()
    }

    async fn read_linearizable(&self) -> Result<Arc<Metadata>, ClusterError> {
        Ok(self.local())
    }

    async fn write(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.write_now(&cmd).map(|(o, _)| o))
            .await
            .map_err(|e| ClusterError::Stopped(e.to_string()))?
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
        self.shared.majority.subscribe()
    }

    fn local_at(&self) -> (Arc<Metadata>, u64) {
        let st = self.state();
        (st.meta.clone(), st.index)
    }

    fn replayed(&self, index: u64) {
        if let Some(r) = self.shared.replayed.get(&self.me) {
            r.send_if_modified(|r| match r {
                Some(i) if *i >= index => false,
                _ => {
                    *r = Some(index);
                    true
                }
            });
        }
    }

    async fn write_everywhere(&self, cmd: Command) -> Result<Outcome, ClusterError> {
        let me = self.clone();
        let (outcome, index) = tokio::task::spawn_blocking(move || me.write_now(&cmd))
            .await
            .map_err(|e| ClusterError::Stopped(e.to_string()))??;
        for (shard, replayed) in &self.shared.replayed {
            if *shard == self.me {
                continue;
            }
            let mut rx = replayed.subscribe();
            if rx.borrow().is_none() {
                continue;
            }
            if tokio::time::timeout(REPLAY_WAIT, rx.wait_for(|r| r.is_some_and(|r| r >= index)))
                .await
                .is_err()
            {
                tracing::debug!(%shard, index, "a shard did not replay a change in time");
            }
        }
        Ok(outcome)
    }
}

/// The node's shards, the threads they run on, and the turn in which
/// clients are given to them.
#[derive(Clone)]
pub(crate) struct Shards {
    brokers: Arc<[Shared]>,
    /// Each shard's own thread (a current-thread runtime) where its
    /// clients, tick and links run, so that a shard's work is never spread
    /// over threads that would wait for each other on its lock. None for a
    /// node of one shard: its work runs on the node's runtime.
    threads: Arc<[tokio::runtime::Handle]>,
    /// Each shard's node name.
    names: Arc<[Arc<str>]>,
    next: Arc<AtomicUsize>,
}

impl Shards {
    /// The shards, in order (one: an unsharded node), each of several
    /// started on a thread of its own.
    pub(crate) fn new(brokers: Vec<Shared>) -> anyhow::Result<Self> {
        let mut threads = Vec::new();
        if brokers.len() > 1 {
            for k in 0..brokers.len() {
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::Builder::new()
                    .name(format!("warren-shard-{k}"))
                    .spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build();
                        match rt {
                            Ok(rt) => {
                                let _ = tx.send(Ok(rt.handle().clone()));
                                // The shard runs as long as the process.
                                rt.block_on(std::future::pending::<()>());
                            }
                            Err(e) => {
                                let _ = tx.send(Err(e));
                            }
                        }
                    })
                    .context("starting a shard's thread")?;
                threads.push(
                    rx.recv()
                        .context("a shard's thread ended")?
                        .context("starting a shard's runtime")?,
                );
            }
        }
        let names: Vec<Arc<str>> = brokers
            .iter()
            .map(|b| Arc::from(lock(b).node_name()))
            .collect();
        Ok(Self {
            brokers: brokers.into(),
            threads: threads.into(),
            names: names.into(),
            next: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Runs `task` on shard `k`'s thread (the caller's runtime for a node
    /// of one shard).
    pub(crate) fn spawn<F>(&self, k: usize, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self.threads.get(k) {
            Some(rt) => rt.spawn(task),
            None => tokio::spawn(task),
        }
    }

    /// Serves a client accepted on one of the node's listeners (AMQP or
    /// AMQPS) on shard `k`'s thread, its socket moved to that thread's
    /// runtime.
    pub(crate) fn serve_on<S: crate::client::ClientStream>(
        &self,
        k: usize,
        stream: S,
        peer: std::net::SocketAddr,
        running: Arc<AtomicBool>,
        socket: crate::sockets::HeldSocket,
    ) {
        let shards = self.clone();
        if self.threads.is_empty() {
            tokio::spawn(crate::client::serve(
                shards, k, stream, peer, running, socket,
            ));
            return;
        }
        match stream.unhome() {
            crate::client::Unhomed::Away(away) => {
                self.spawn(k, async move {
                    match S::rehome(away) {
                        Ok(s) => crate::client::serve(shards, k, s, peer, running, socket).await,
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "could not hand a client to its shard");
                        }
                    }
                });
            }
            crate::client::Unhomed::Lost => {
                tracing::warn!(%peer, "could not hand a client to its shard: its socket failed");
            }
        }
    }

    /// Every shard's broker, shard 0 first.
    pub(crate) fn all(&self) -> &[Shared] {
        &self.brokers
    }

    /// Shard 0's broker: the one the management API and the node's
    /// control act through.
    pub(crate) fn first(&self) -> &Shared {
        &self.brokers[0]
    }

    /// The shard named `name`.
    pub(crate) fn by_name(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| **n == *name)
    }

    /// The shard a new client connection goes to (each in turn).
    pub(crate) fn pick(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.brokers.len()
    }
}

/// One direction of an in-process link: what shard `from` sent to a shard,
/// waiting for that shard to take it in.
#[derive(Default)]
struct Pipe {
    msgs: Mutex<VecDeque<LinkMsg>>,
    wake: Notify,
}

/// Carries [`LinkMsg`]s between the shards of `names` (each its broker in
/// `shards`): a task per shard takes its batches ([`Broker::take_link_out`])
/// and one per ordered pair of shards hands them to the receiver
/// ([`Broker::link_input`]), with the flow control of a network link:
/// a forwarded publish into a queue that falls behind waits, and the
/// publishes behind it.
///
/// [`Broker::take_link_out`]: warren_broker::Broker::take_link_out
/// [`Broker::link_input`]: warren_broker::Broker::link_input
fn start_links(shards: &Shards, names: &[String]) {
    let n = shards.all().len();
    // Every shard's waker before any input can come.
    let wakes: Vec<Arc<Notify>> = (0..n).map(|_| Arc::new(Notify::new())).collect();
    for (shard, wake) in shards.all().iter().zip(&wakes) {
        let w = wake.clone();
        lock(shard).set_link_waker(Arc::new(move || w.notify_one()));
    }
    let mut pipes: BTreeMap<(usize, usize), Arc<Pipe>> = BTreeMap::new();
    for from in 0..n {
        for to in (0..n).filter(|&to| to != from) {
            let pipe = Arc::new(Pipe::default());
            pipes.insert((from, to), pipe.clone());
            let (src, dst) = (shards.all()[from].clone(), shards.all()[to].clone());
            let (src_name, dst_name) = (names[from].clone(), names[to].clone());
            shards.spawn(to, receive(pipe, src, src_name, dst, dst_name));
        }
    }
    for (from, wake) in wakes.into_iter().enumerate() {
        let src = shards.all()[from].clone();
        let outs: BTreeMap<String, Arc<Pipe>> = (0..n)
            .filter(|&to| to != from)
            .filter_map(|to| Some((names[to].clone(), pipes.get(&(from, to))?.clone())))
            .collect();
        shards.spawn(from, async move {
            loop {
                wake.notified().await;
                let out = lock(&src).take_link_out();
                for (node, msgs) in out {
                    match outs.get(&node) {
                        Some(pipe) => {
                            pipe.msgs
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .extend(msgs);
                            pipe.wake.notify_one();
                        }
                        None => {
                            tracing::warn!(%node, "dropping link messages for a node that is not a shard of this one");
                            lock(&src).link_sent(&node, msgs.len());
                        }
                    }
                }
            }
        });
    }
}

/// Hands what `src` sent through `pipe` to `dst`, holding back a forwarded
/// publish into a queue that falls behind (and the publishes, gets and
/// counts that follow it) until it catches up; acks, consumes and cancels
/// go on past them, as over a network link (`links::held_back`). Tells
/// `src` how many messages were taken in.
async fn receive(pipe: Arc<Pipe>, src: Shared, src_name: String, dst: Shared, dst_name: String) {
    let mut held = false;
    loop {
        if held {
            tokio::select! {
                () = pipe.wake.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(2)) => {}
            }
        } else {
            pipe.wake.notified().await;
        }
        let taken = {
            let mut b = lock(&dst);
            let mut q = pipe.msgs.lock().unwrap_or_else(PoisonError::into_inner);
            let mut msgs = Vec::with_capacity(q.len());
            let mut waiting = VecDeque::new();
            for m in q.drain(..) {
                let waits = crate::links::held_back(&m)
                    && (!waiting.is_empty()
                        || matches!(&m, LinkMsg::Publish { vhost, queue, .. } if b.publish_waits(&src_name, vhost, queue)));
                if waits {
                    waiting.push_back(m);
                } else {
                    msgs.push(m);
                }
            }
            *q = waiting;
            held = !q.is_empty();
            drop(q);
            let n = msgs.len();
            if n > 0 {
                b.link_input(&src_name, msgs, now_ms());
            }
            n
        };
        if taken > 0 {
            lock(&src).link_sent(&dst_name, taken);
        }
    }
}

/// Shard `k`'s broker configuration, of `n`, before the node's settings.
pub(crate) fn config(data_dir: &Path, node: &str, k: usize, n: usize) -> BrokerConfig {
    let mut cfg = BrokerConfig::new(shard_dir(data_dir, k));
    cfg.node_name = shard_name(node, k);
    cfg.first_conn_id = first_conn_id(k);
    cfg.siblings = (0..n)
        .filter(|&s| s != k)
        .map(|s| Arc::from(shard_name(node, s)))
        .collect();
    // Clients see the node's name, whichever shard serves them.
    cfg.amqp.cluster_name = Some(node.to_owned());
    cfg
}

/// A sharded node's metadata, open, while its shards' brokers open on it.
pub(crate) struct Opening {
    meta: ShardMetadata,
    /// Where the metadata's commits run: a runtime of its own, as an
    /// operator's change waits for its commit under a shard's lock.
    rt: tokio::runtime::Handle,
    /// Each shard's store's flag, set while its replay runs.
    replaying: Vec<Arc<AtomicBool>>,
}

impl Opening {
    /// Opens the metadata of node `node`'s `n` shards in `data_dir`; the
    /// first sharded start of a node that ran unsharded imports its
    /// `metadata.json` (its queues are then shard 0's, in their place).
    pub(crate) async fn open(data_dir: &Path, node: &str, n: usize) -> anyhow::Result<Self> {
        let imported = !was_sharded(data_dir);
        let meta = ShardMetadata::open(data_dir, node, n)?;
        let file = data_dir.join("metadata.json");
        if imported && file.exists() {
            crate::cluster::import_file_store(&meta, &file).await?;
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("warren-shards-meta")
            .enable_all()
            .build()
            .context("starting the shards' metadata runtime")?;
        // The runtime lives as long as the process.
        let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(rt));
        Ok(Self {
            meta,
            rt: rt.handle().clone(),
            replaying: Vec::new(),
        })
    }

    /// Shard `k`'s metadata store (call for each shard in order).
    pub(crate) fn store(&mut self, k: usize) -> Box<dyn MetadataStore> {
        let r = Arc::new(AtomicBool::new(false));
        self.replaying.push(r.clone());
        Box::new(
            ClusterStore::new(self.meta.for_shard(k), self.rt.clone(), r).closing_after_commit(),
        )
    }

    /// Starts the shards' brokers on the metadata: each pointed at the
    /// other shards' queues, replaying every change and making its clients'
    /// commits, and the links between them.
    pub(crate) fn start(self, shards: &Shards) -> ShardMetadata {
        let mut names = Vec::new();
        for (k, (b, r)) in shards.all().iter().zip(self.replaying).enumerate() {
            let meta = self.meta.for_shard(k);
            names.push(meta.node().to_string());
            point_at_masters(&meta, b);
            crate::cluster::attach(meta, self.rt.clone(), r, b.clone());
        }
        start_links(shards, &names);
        self.meta
    }
}

/// Makes each shard's broker serve its queues and forward the others: the
/// queues of the metadata mastered on another shard are pointed there.
fn point_at_masters(meta: &ShardMetadata, broker: &Shared) {
    let m = meta.local();
    let me = meta.node().as_str();
    let mut b = lock(broker);
    for q in m.queues.values() {
        if q.master != me {
            b.set_queue_master(&q.vhost, &q.name, Some(&q.master));
        }
    }
}

/// Whether the node was asked for shards and may have them.
pub(crate) fn check(n: usize, clustered: bool) -> anyhow::Result<()> {
    anyhow::ensure!(n >= 1, "--shards must be at least 1");
    anyhow::ensure!(
        n == 1 || !clustered,
        "--shards above 1 is not yet supported on a cluster member (--peer-addr)"
    );
    Ok(())
}

/// A node of `n` shards inside the process, without listeners: the brokers,
/// their metadata, links and services as `warren --shards N` runs them, and
/// clients served by the node's own connection shell over in-process
/// streams instead of sockets (`benches/shards.rs`). With one shard, its
/// metadata is kept as a sharded node's (an unsharded node keeps
/// `metadata.json`; the data path is the same).
pub struct InProcess {
    shards: Shards,
    services: Option<crate::services::Services>,
    running: Arc<AtomicBool>,
    sockets: crate::sockets::ClientSockets,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcess")
            .field("shards", &self.shards.all().len())
            .finish_non_exhaustive()
    }
}

impl InProcess {
    /// Starts `n` shards on the data in `data_dir` (the default user
    /// `guest` on a new one).
    pub async fn start(data_dir: &Path, n: usize) -> anyhow::Result<Self> {
        let node = "warren@localhost";
        let mut opening = Opening::open(data_dir, node, n).await?;
        let mut brokers = Vec::with_capacity(n);
        for k in 0..n {
            let broker = Broker::open(config(data_dir, node, k, n), opening.store(k))?;
            brokers.push(Arc::new(warren_lock::MeasuredMutex::new(broker)));
        }
        let shards = Shards::new(brokers)?;
        opening.start(&shards);
        let services = crate::services::Services::start(&shards)?;
        Ok(Self {
            shards,
            services: Some(services),
            running: Arc::new(AtomicBool::new(true)),
            sockets: crate::sockets::ClientSockets::for_fd_limit(None),
        })
    }

    /// A new client connection to shard `k` (modulo the shards): the
    /// client's end of a stream the node's connection shell serves.
    pub async fn connect(&self, k: usize) -> tokio::io::DuplexStream {
        let (client, server) = tokio::io::duplex(256 * 1024);
        let k = k % self.shards.all().len();
        let socket = self.sockets.reserve().await.hold();
        let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let shards = self.shards.clone();
        self.shards.spawn(
            k,
            crate::client::serve(shards, k, server, peer, self.running.clone(), socket),
        );
        client
    }

    /// How long each shard's broker lock has been held so far.
    pub fn lock_held(&self) -> Vec<Duration> {
        self.shards.all().iter().map(|b| b.stats().held).collect()
    }

    /// Closes every client and stops, everything on disk.
    pub async fn stop(mut self) {
        self.running.store(false, Ordering::SeqCst);
        for b in self.shards.all() {
            lock(b).close_all("broker shutdown");
        }
        if let Some(s) = self.services.take() {
            s.stop(&self.shards).await;
        }
    }
}
