//! In-process Warren nodes for the driver's tests: per node a real
//! `warren_broker::Broker` (fed AMQP frames by [`Client`]), the production
//! [`MirrorDriver`] on a runtime of its own (killing the node shuts that
//! runtime down), all over one `MemNetwork` and one [`MemMetadata`].
//!
//! Two ways to run them: on real multi-thread runtimes under an async test
//! ([`Net::new`], [`Net::start`]), or simulated ([`Net::simulated`],
//! [`Net::start_now`]): each node on a current-thread runtime with a paused
//! clock, driven one after the other by [`Net::step`] from a plain test
//! thread, its queues' logs in a `MemStorage`, and the forwarding links
//! between the brokers (the node's `links.rs`) carried by the step itself.

#![allow(dead_code)]

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, connection, queue,
};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::BytesMut;
use tempfile::TempDir;
use warren_backing_queue::MemStorage;
use warren_broker::auth::{PermissionDef, UserDef, hash_password};
use warren_broker::meta::{FileStore, PolicyDef};
use warren_broker::{Broker, BrokerConfig, ConnId};
use warren_cluster::{Command, NodeRecord, PolicyRecord, QueueRecord};
use warren_gm::NodeConfig;
use warren_lock::{MeasuredGuard, MeasuredMutex};
use warren_mirror::{Role, Status};
use warren_mirror_driver::{DriverConfig, MemMetadata, MetadataSource, MirrorDriver};
use warren_transport::mem::MemNetwork;
use warren_transport::{ClusterSecret, NodeName, PeerAddr, TransportConfig};

/// The mirrored queue of every test.
pub const QUEUE: &str = "q";
/// Where `q` dead-letters what expires or is rejected (mirrored too).
pub const DLQ: &str = "dlq";

thread_local! {
    /// The simulation's virtual time (milliseconds since the epoch), which
    /// [`Net::step`] moves; 0 outside the simulation (the wall clock). Per
    /// thread: a simulated net runs all its nodes on its test's thread, and
    /// tests that run at once in one process must not move each other's
    /// clocks.
    static VIRTUAL_MS: Cell<u64> = const { Cell::new(0) };
    /// How many nodes this thread's simulated net has started (for their
    /// GM member ids).
    static STARTS: Cell<u64> = const { Cell::new(0) };
}

pub type Shared = Arc<MeasuredMutex<Broker>>;

pub fn lock(b: &Shared) -> MeasuredGuard<'_, Broker> {
    b.lock()
}

/// The brokers' time: virtual in the simulation, else the wall clock.
pub fn now_ms() -> u64 {
    match VIRTUAL_MS.get() {
        0 => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        virtual_ms => virtual_ms,
    }
}

pub fn name(n: &str) -> NodeName {
    NodeName::new(n).unwrap()
}

/// One running node.
pub struct Node<S: MetadataSource = MemMetadata> {
    pub broker: Shared,
    pub driver: Arc<MirrorDriver<S>>,
    /// Every task of the node runs here: killing the node shuts it down.
    pub rt: tokio::runtime::Runtime,
}

/// A runtime for one node's tasks.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// The queue `q` (master `n1`) and its dead-letter queue `dlq`, and their
/// policies: mirrored on every node, synchronised automatically in batches
/// of `batch`; `q` dead-letters to `dlq`.
pub fn queue_commands(batch: u64) -> Vec<Command> {
    let ha = format!(r#""ha-mode":"all","ha-sync-mode":"automatic","ha-sync-batch-size":{batch}"#);
    let policy = |name: &str, queue: &str, definition: String| {
        Command::PutPolicy(PolicyRecord {
            vhost: "/".into(),
            name: name.into(),
            pattern: format!("^{queue}$"),
            apply_to: "queues".into(),
            priority: 0,
            definition,
        })
    };
    let declare = |queue: &str| {
        Command::DeclareQueue(QueueRecord {
            vhost: "/".into(),
            name: queue.into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: Default::default(),
            master: "n1".into(),
            mirrors: vec![],
            synchronised: vec![],
            view_version: 0,
            serial: 0,
        })
    };
    vec![
        Command::PutVhost { name: "/".into() },
        policy(
            "ha",
            QUEUE,
            format!(r#"{{{ha},"dead-letter-exchange":"","dead-letter-routing-key":"{DLQ}"}}"#),
        ),
        policy("ha-dlq", DLQ, format!("{{{ha}}}")),
        declare(QUEUE),
        declare(DLQ),
    ]
}

/// A transport of node `n` on `mem`.
pub fn transport(mem: &MemNetwork, n: &str) -> Arc<warren_transport::mem::MemTransport> {
    Arc::new(mem.transport(TransportConfig::new(
        name(n),
        ClusterSecret::new("mirror-driver-test"),
    )))
}

/// Logs to the test's output (`RUST_LOG`; by default `warn`, or `info`
/// when a simulation seed is replayed, `WARREN_SIM_SEED`).
pub fn init_tracing() {
    let default = if std::env::var_os("WARREN_SIM_SEED").is_some() {
        "info"
    } else {
        "warn"
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .with_test_writer()
        .try_init();
}

/// A simulated node's runtime: one thread (the test's), its clock paused
/// (it moves only as [`Net::step`] drives it).
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

/// Node `n`'s broker with its data in `dir` (its queues' logs in `storage`
/// if given): guest, vhost `/` and the queue declared (as the node's
/// metadata replay does).
pub fn open_broker(n: &str, dir: &Path, storage: Option<&MemStorage>) -> Shared {
    let mut cfg = BrokerConfig::new(dir);
    cfg.node_name = n.to_owned();
    if let Some(storage) = storage {
        cfg.storage = Arc::new(storage.clone());
    }
    let store = FileStore::open(dir.join("metadata.json")).unwrap();
    let mut broker = Broker::open(cfg, Box::new(store)).unwrap();
    broker.add_vhost("/").unwrap();
    broker
        .put_user(UserDef {
            name: "guest".into(),
            password_hash: hash_password("guest"),
            tags: vec!["administrator".into()],
            loopback_only: true,
        })
        .unwrap();
    broker
        .set_permissions(PermissionDef {
            user: "guest".into(),
            vhost: "/".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        })
        .unwrap();
    let broker: Shared = Arc::new(MeasuredMutex::new(broker));
    let mut client = Client::connect(&broker);
    client.declare(QUEUE);
    client.declare(DLQ);
    // The policies, as the node's metadata replay hands them to its broker
    // (`q`'s dead-letter keys are the broker's to apply).
    let policies: Vec<PolicyDef> = queue_commands(8)
        .into_iter()
        .filter_map(|c| match c {
            Command::PutPolicy(p) => Some(PolicyDef {
                vhost: p.vhost,
                name: p.name,
                pattern: p.pattern,
                apply_to: p.apply_to,
                priority: p.priority,
                definition: serde_json::from_str(&p.definition).unwrap(),
                operator: false,
            }),
            _ => None,
        })
        .collect();
    lock(&broker).apply_policies(&policies);
    broker
}

/// The driver's settings of node `n` in these tests (short intervals).
fn driver_config(n: &str) -> DriverConfig {
    let mut gm = NodeConfig::new(name(n), PeerAddr::new(format!("gm-{n}")));
    gm.tick_interval = Duration::from_millis(5);
    gm.redial_interval = Duration::from_millis(30);
    let virtual_ms = VIRTUAL_MS.get();
    if virtual_ms != 0 {
        // Simulated: member ids from the virtual clock and the start count,
        // not at random, so that a seed replays the same run (ids and all).
        let starts = STARTS.get() + 1;
        STARTS.set(starts);
        let mut h = DefaultHasher::new();
        (n, virtual_ms, starts).hash(&mut h);
        gm.member_ids_from = h.finish() >> 8;
    }
    let mut config = DriverConfig::new(gm, format!("link-{n}"));
    config.replica_tick = Duration::from_millis(20);
    config.reconcile_interval = Duration::from_millis(100);
    config.clock = Arc::new(now_ms);
    config
}

/// The node's broker loops, on the current runtime: its ticker and its
/// group commits.
async fn broker_loops(b: Shared) {
    let mut iv = tokio::time::interval(Duration::from_millis(20));
    loop {
        iv.tick().await;
        lock(&b).tick(now_ms());
        let mut batch = lock(&b).prepare_sync();
        if !batch.is_empty() {
            batch.run();
            lock(&b).complete_sync(batch, now_ms());
        }
    }
}

impl<S: MetadataSource> Node<S> {
    /// Starts node `n` on `rt` with its data in `dir`: a broker with guest,
    /// vhost `/` and the queue declared (as the node's metadata replay
    /// does), its ticker and group commits, and the mirror driver over
    /// `source`.
    pub async fn start(
        rt: tokio::runtime::Runtime,
        mem: &MemNetwork,
        n: &str,
        dir: &Path,
        source: S,
    ) -> Self {
        let broker = open_broker(n, dir, None);
        let transport = transport(mem, n);
        let (b, config) = (broker.clone(), driver_config(n));
        let driver = rt
            .spawn(async move { MirrorDriver::start(source, transport, b, config).await })
            .await
            .unwrap()
            .unwrap();
        rt.spawn(broker_loops(broker.clone()));
        Self { broker, driver, rt }
    }

    /// [`start`](Self::start) from outside any runtime, on `rt` (a paused
    /// one: the simulation), the queues' logs in `storage`.
    pub fn start_now(
        rt: tokio::runtime::Runtime,
        mem: &MemNetwork,
        n: &str,
        dir: &Path,
        source: S,
        storage: &MemStorage,
    ) -> Self {
        let broker = open_broker(n, dir, Some(storage));
        let transport = transport(mem, n);
        let driver = rt
            .block_on(MirrorDriver::start(
                source,
                transport,
                broker.clone(),
                driver_config(n),
            ))
            .unwrap();
        rt.spawn(broker_loops(broker.clone()));
        Self { broker, driver, rt }
    }

    /// Stops the node cleanly.
    pub async fn stop(self) {
        let d = self.driver.clone();
        let _ = self
            .rt
            .spawn(async move { d.stop(Duration::from_secs(5)).await })
            .await;
        self.rt.shutdown_background();
    }

    /// The queue's replica status on this node.
    pub fn status(&self) -> Option<Status> {
        self.status_of(QUEUE)
    }

    /// Queue `name`'s replica status on this node.
    pub fn status_of(&self, name: &str) -> Option<Status> {
        lock(&self.broker).replica_status("/", name)
    }

    pub fn role(&self) -> Option<Role> {
        self.status().map(|s| s.role)
    }

    /// (ready, unacked) as this node's broker counts the queue.
    pub fn counts(&self) -> (u64, u64) {
        lock(&self.broker)
            .queues(Some("/"))
            .into_iter()
            .find(|q| q.name == QUEUE)
            .map_or((0, 0), |q| (q.messages_ready, q.messages_unacknowledged))
    }
}

/// The cluster: the network, the metadata, the nodes and their data dirs.
pub struct Net {
    pub mem: MemNetwork,
    pub meta: MemMetadata,
    pub nodes: BTreeMap<String, Node>,
    dirs: BTreeMap<String, TempDir>,
    joined: u64,
    /// Simulated ([`Net::simulated`]): each node's queue logs, kept across
    /// its restarts.
    pub storage: BTreeMap<String, MemStorage>,
    /// Simulated: the node pairs whose forwarding link is up.
    links: BTreeSet<(String, String)>,
    /// Simulated: the virtual time [`Net::step`] has run.
    pub elapsed: Duration,
    /// Each node's handle on the metadata (its latest start's).
    handles: BTreeMap<String, MemMetadata>,
}

impl Net {
    /// A cluster whose queue `q` (master `n1`) is mirrored on every node,
    /// synchronised automatically in batches of `batch`.
    pub fn new(seed: u64, batch: u64) -> Self {
        init_tracing();
        let meta = MemMetadata::new(name("n1"));
        for cmd in queue_commands(batch) {
            meta.apply(&cmd).unwrap();
        }
        Self {
            mem: MemNetwork::new(seed),
            meta,
            nodes: BTreeMap::new(),
            dirs: BTreeMap::new(),
            joined: 0,
            storage: BTreeMap::new(),
            links: BTreeSet::new(),
            elapsed: Duration::ZERO,
            handles: BTreeMap::new(),
        }
    }

    /// The same cluster, simulated: start its nodes with
    /// [`start_now`](Self::start_now) and run it with [`step`](Self::step).
    /// Its brokers then run on virtual time, which starts at a fixed
    /// instant.
    pub fn simulated(seed: u64, batch: u64) -> Self {
        VIRTUAL_MS.set(1_800_000_000_000);
        Self::new(seed, batch)
    }

    /// Node `n`'s data directory and metadata handle, entering it in the
    /// cluster's node list the first time.
    fn admit(&mut self, n: &str) -> (PathBuf, MemMetadata) {
        let dir: PathBuf = self
            .dirs
            .entry(n.to_owned())
            .or_insert_with(|| tempfile::tempdir().unwrap())
            .path()
            .to_owned();
        if !self.meta.local().nodes.contains_key(n) {
            self.joined += 1;
            let joined_at = self.joined;
            self.meta.modify(|m| {
                m.nodes.insert(
                    n.to_owned(),
                    NodeRecord {
                        name: n.to_owned(),
                        peer_addr: n.to_owned(),
                        joined_at,
                        ring_addr: None,
                        link_addr: None,
                        listeners: Vec::new(),
                    },
                );
            });
        }
        let handle = self.meta.for_node(name(n));
        self.handles.insert(n.to_owned(), handle.clone());
        (dir, handle)
    }

    /// Cuts node `n` off from the metadata's majority, or joins it again
    /// ([`MemMetadata::cut_off`]).
    pub fn cut_off(&self, n: &str, cut: bool) {
        if let Some(h) = self.handles.get(n) {
            h.cut_off(cut);
        }
    }

    /// Makes node `n`'s metadata writes take `latency` to commit
    /// ([`MemMetadata::set_write_latency`]).
    pub fn slow_writes(&self, n: &str, latency: Duration) {
        if let Some(h) = self.handles.get(n) {
            h.set_write_latency(latency);
        }
    }

    /// Node `n` runs: the cluster sees it up.
    fn running(&mut self, n: &str, node: Node) {
        let mut up = self.up();
        up.insert(name(n));
        self.meta.set_up(up);
        self.nodes.insert(n.to_owned(), node);
    }

    /// Starts node `n` (again, on its old data directory, after a kill):
    /// its broker with the queue declared, and its mirror driver.
    pub async fn start(&mut self, n: &str) {
        let (dir, source) = self.admit(n);
        let node = Node::start(runtime(), &self.mem, n, &dir, source).await;
        self.running(n, node);
    }

    /// [`start`](Self::start) in a simulated cluster: on a paused runtime,
    /// the queues' logs in the node's `MemStorage` (what a restart finds).
    pub fn start_now(&mut self, n: &str) {
        let (dir, source) = self.admit(n);
        let storage = self.storage.entry(n.to_owned()).or_default().clone();
        let node = Node::start_now(paused_runtime(), &self.mem, n, &dir, source, &storage);
        self.running(n, node);
    }

    fn up(&self) -> BTreeSet<NodeName> {
        self.meta.up_now()
    }

    /// Kills node `n`: its tasks stop at once, its connections break, the
    /// cluster sees it down. Its data directory stays.
    pub fn kill(&mut self, n: &str) {
        if let Some(node) = self.nodes.remove(n) {
            node.rt.shutdown_background();
        }
        self.mem.disconnect(&name(n));
        let mut up = self.up();
        up.remove(&name(n));
        self.meta.set_up(up);
    }

    /// Simulated: runs every node for `d` of virtual time, one after the
    /// other (in name order), then carries the forwarding links' messages.
    pub fn step(&mut self, d: Duration) {
        for node in self.nodes.values() {
            node.rt.block_on(async { tokio::time::sleep(d).await });
        }
        self.elapsed += d;
        let virtual_ms = VIRTUAL_MS.get();
        if virtual_ms != 0 {
            VIRTUAL_MS.set(virtual_ms + d.as_millis() as u64);
        }
        self.carry_links();
    }

    /// Simulated: steps (`step` each time) until `ok`, failing after
    /// `limit` of virtual time.
    pub fn step_until(
        &mut self,
        what: &str,
        step: Duration,
        limit: Duration,
        mut ok: impl FnMut(&Self) -> bool,
    ) {
        let until = self.elapsed + limit;
        while !ok(self) {
            assert!(
                self.elapsed < until,
                "gave up waiting {limit:?} (virtual) for: {what}"
            );
            self.step(step);
        }
    }

    /// The forwarding links between the brokers, as the node's `links.rs`
    /// keeps them: a pair's link is up while both nodes run and the network
    /// carries frames both ways; when it goes down both ends drop what went
    /// through it (`link_down`) and what is on its way is lost; when it
    /// comes back (a new session) each end asks the other again for its
    /// consumers' deliveries (`resubscribe`). Messages go in node order.
    fn carry_links(&mut self) {
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        let mut now_up = BTreeSet::new();
        for (i, a) in names.iter().enumerate() {
            for b in &names[i + 1..] {
                if self.mem.reaches(&name(a), &name(b)) && self.mem.reaches(&name(b), &name(a)) {
                    now_up.insert((a.clone(), b.clone()));
                }
            }
        }
        for (a, b) in self.links.difference(&now_up) {
            for (me, peer) in [(a, b), (b, a)] {
                if let Some(node) = self.nodes.get(me) {
                    tracing::info!(node = %me, %peer, "sim: forwarding link down");
                    lock(&node.broker).link_down(peer, now_ms());
                }
            }
        }
        for (a, b) in now_up.difference(&self.links) {
            for (me, peer) in [(a, b), (b, a)] {
                tracing::info!(node = %me, %peer, "sim: forwarding link up");
                lock(&self.nodes[me].broker).resubscribe(peer);
            }
        }
        self.links = now_up;
        for from in &names {
            let mut out = lock(&self.nodes[from].broker).take_link_out();
            out.sort_by(|x, y| x.0.cmp(&y.0));
            for (to, msgs) in out {
                let pair = if *from < to {
                    (from.clone(), to.clone())
                } else {
                    (to.clone(), from.clone())
                };
                let n = msgs.len();
                if self.links.contains(&pair) {
                    lock(&self.nodes[&to].broker).link_input(from, msgs, now_ms());
                    lock(&self.nodes[from].broker).link_sent(&to, n);
                } else {
                    // A batch that cannot be sent fails the node's
                    // forwarded work (as `links.rs` does).
                    let mut b = lock(&self.nodes[from].broker);
                    b.link_sent(&to, n);
                    b.link_down(&to, now_ms());
                }
            }
        }
    }

    /// Simulated: publishes messages `1..=n` (persistent) through `c` and
    /// steps (`step` each time, at most `limit`) until all are confirmed.
    pub fn publish_confirmed_now(
        &mut self,
        c: &mut Client,
        n: u64,
        step: Duration,
        limit: Duration,
    ) {
        for seq in 1..=n {
            c.publish(seq, true);
        }
        self.step_until("every publish confirmed", step, limit, |_| {
            c.poll();
            c.acked.len() as u64 == n
        });
    }

    /// The queue's record.
    pub fn record(&self) -> QueueRecord {
        self.record_of(QUEUE)
    }

    /// The record of queue `name`.
    pub fn record_of(&self, name: &str) -> QueueRecord {
        self.meta.local().queue("/", name).unwrap().clone()
    }

    /// Stops every node cleanly.
    pub async fn stop(mut self) {
        for (_, node) in std::mem::take(&mut self.nodes) {
            node.stop().await;
        }
    }
}

/// Waits (bounded: a hang fails the test) until `ok`.
pub async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    for _ in 0..6_000 {
        if ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("gave up waiting for: {what}");
}

fn frame(f: &AMQPFrame) -> Vec<u8> {
    gen_frame(f)(WriteContext::from(Vec::new()))
        .expect("encode")
        .into_inner()
        .0
}

fn method(ch: u16, class: AMQPClass) -> Vec<u8> {
    frame(&AMQPFrame::Method(ch, class))
}

/// A message taken with `basic.get`.
#[derive(Debug, Clone)]
pub struct Got {
    pub tag: u64,
    pub redelivered: bool,
    /// The reason of its first `x-death` entry, if it was dead-lettered.
    pub death: Option<String>,
    /// The publisher's sequence number it carries.
    pub seq: u64,
}

/// An AMQP client on one channel in confirm mode, feeding a broker directly.
pub struct Client {
    broker: Shared,
    id: ConnId,
    input: BytesMut,
    output: BytesMut,
    /// Confirm tag → the seq of the message it published.
    pending: BTreeMap<u64, u64>,
    next_tag: u64,
    /// Seqs confirmed (`basic.ack`) and refused (`basic.nack`).
    pub acked: BTreeSet<u64>,
    pub nacked: BTreeSet<u64>,
    /// Answers to `basic.get`, in order (`None`: empty).
    gets: VecDeque<Option<Got>>,
    /// Deliveries to this client's consumer, in order.
    deliveries: VecDeque<Got>,
    /// A get-ok or deliver waiting for its content.
    partial: Option<Partial>,
    closed: Option<String>,
}

/// A get-ok or deliver whose content is still arriving.
struct Partial {
    tag: u64,
    redelivered: bool,
    /// A deliver (to the consumer), not a get-ok.
    pushed: bool,
    /// The body's size, from the content header.
    size: u64,
    /// The first `x-death` reason, from the content header.
    death: Option<String>,
    body: Vec<u8>,
}

/// Every [`LARGE_EVERY`]th message carries a body of [`LARGE_BYTES`]: more
/// than a ring broadcast batch takes (4 MiB), so it travels alone.
pub const LARGE_EVERY: u64 = 25;
/// See [`LARGE_EVERY`].
pub const LARGE_BYTES: usize = 6 << 20;
/// The largest body frame the client sends (its negotiated frame_max).
const BODY_FRAME: usize = 131_072 - 8;

/// The body of message `seq`: its number, padded with dots for a large one.
fn body_of(seq: u64) -> Vec<u8> {
    let mut body = seq.to_string().into_bytes();
    if seq.is_multiple_of(LARGE_EVERY) {
        body.resize(LARGE_BYTES, b'.');
    }
    body
}

/// The message number a body carries (and checks a large one's padding).
fn seq_of(body: &[u8]) -> u64 {
    let digits = body.iter().take_while(|b| b.is_ascii_digit()).count();
    let seq: u64 = String::from_utf8_lossy(&body[..digits]).parse().unwrap();
    assert_eq!(
        body,
        body_of(seq).as_slice(),
        "message {seq} came back altered"
    );
    seq
}

impl Client {
    /// Connects as guest to vhost `/` and opens channel 1 in confirm mode.
    pub fn connect(broker: &Shared) -> Self {
        let id = lock(broker).connect(SocketAddr::from(([127, 0, 0, 1], 40000)), Arc::new(|| {}));
        let mut c = Self {
            broker: broker.clone(),
            id,
            input: BytesMut::new(),
            output: BytesMut::new(),
            pending: BTreeMap::new(),
            next_tag: 0,
            acked: BTreeSet::new(),
            nacked: BTreeSet::new(),
            gets: VecDeque::new(),
            deliveries: VecDeque::new(),
            partial: None,
            closed: None,
        };
        c.send(b"AMQP\x00\x00\x09\x01");
        c.send(&method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
        ));
        c.send(&method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 16,
                frame_max: 131_072,
                heartbeat: 0,
            })),
        ));
        c.send(&method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        ));
        c.send(&method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        c.send(&method(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: true,
            })),
        ));
        c.poll();
        assert!(c.closed.is_none(), "connection refused: {:?}", c.closed);
        c
    }

    fn send(&mut self, bytes: &[u8]) {
        self.input.extend_from_slice(bytes);
        lock(&self.broker).handle_input(self.id, &mut self.input, now_ms());
    }

    /// Declares a durable queue.
    pub fn declare(&mut self, q: &str) {
        self.send(&method(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: q.into(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ));
        self.poll();
        assert!(self.closed.is_none(), "declare refused: {:?}", self.closed);
    }

    /// Deletes queue `q`.
    pub fn delete(&mut self, q: &str) {
        self.send(&method(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
                queue: q.into(),
                if_unused: false,
                if_empty: false,
                nowait: false,
            })),
        ));
        self.poll();
        assert!(self.closed.is_none(), "delete refused: {:?}", self.closed);
    }

    /// Publishes a message carrying `seq` to the queue (a large one every
    /// [`LARGE_EVERY`]).
    pub fn publish(&mut self, seq: u64, persistent: bool) {
        self.publish_expiring(seq, persistent, None);
    }

    /// [`publish`](Self::publish), expiring after `ttl_ms` if given.
    pub fn publish_expiring(&mut self, seq: u64, persistent: bool, ttl_ms: Option<u64>) {
        let body = body_of(seq);
        let mut props =
            BasicProperties::default().with_delivery_mode(if persistent { 2 } else { 1 });
        if let Some(ttl) = ttl_ms {
            props = props.with_expiration(ttl.to_string().into());
        }
        let mut bytes = method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: QUEUE.into(),
                mandatory: false,
                immediate: false,
            })),
        );
        bytes.extend(frame(&AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties: props,
            },
        )));
        for chunk in body.chunks(BODY_FRAME) {
            bytes.extend(frame(&AMQPFrame::Body(1, chunk.to_vec())));
        }
        self.next_tag += 1;
        self.pending.insert(self.next_tag, seq);
        self.send(&bytes);
    }

    /// Reads and handles whatever the broker has written.
    pub fn poll(&mut self) {
        let mut out = BytesMut::new();
        lock(&self.broker).take_output(self.id, &mut out);
        self.output.extend_from_slice(&out);
        loop {
            let parsed = match parse_frame(&self.output[..]) {
                Ok((rest, f)) => Some((self.output.len() - rest.len(), f)),
                Err(_) => None,
            };
            let Some((used, f)) = parsed else { break };
            let _ = self.output.split_to(used);
            self.on_frame(f);
        }
    }

    fn on_frame(&mut self, f: AMQPFrame) {
        match f {
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                self.settle(a.delivery_tag, a.multiple, true);
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                self.settle(n.delivery_tag, n.multiple, false);
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::GetOk(g))) => {
                self.partial = Some(Partial {
                    tag: g.delivery_tag,
                    redelivered: g.redelivered,
                    pushed: false,
                    size: 0,
                    death: None,
                    body: Vec::new(),
                });
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                self.partial = Some(Partial {
                    tag: d.delivery_tag,
                    redelivered: d.redelivered,
                    pushed: true,
                    size: 0,
                    death: None,
                    body: Vec::new(),
                });
            }
            AMQPFrame::Header(_, h) => {
                if let Some(p) = &mut self.partial {
                    p.size = h.body_size;
                    p.death = first_death(&h.properties);
                }
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => {
                self.gets.push_back(None);
            }
            AMQPFrame::Body(_, body) => {
                let Some(p) = &mut self.partial else { return };
                p.body.extend_from_slice(&body);
                if (p.body.len() as u64) < p.size {
                    return;
                }
                let Some(p) = self.partial.take() else { return };
                let got = Got {
                    tag: p.tag,
                    redelivered: p.redelivered,
                    death: p.death,
                    seq: seq_of(&p.body),
                };
                if p.pushed {
                    self.deliveries.push_back(got);
                } else {
                    self.gets.push_back(Some(got));
                }
            }
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                self.closed = Some(c.reply_text.to_string());
            }
            AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                self.closed = Some(c.reply_text.to_string());
            }
            _ => {}
        }
    }

    fn settle(&mut self, tag: u64, multiple: bool, ack: bool) {
        let tags: Vec<u64> = if multiple {
            self.pending.range(..=tag).map(|(t, _)| *t).collect()
        } else {
            vec![tag]
        };
        for t in tags {
            if let Some(seq) = self.pending.remove(&t) {
                if ack {
                    self.acked.insert(seq);
                } else {
                    self.nacked.insert(seq);
                }
            }
        }
    }

    /// Waits until every publish is acked or nacked.
    pub async fn settled(&mut self) {
        for _ in 0..6_000 {
            self.poll();
            if self.pending.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("publishes never settled: {:?}", self.pending);
    }

    /// The seqs published and not yet settled.
    pub fn unsettled(&self) -> Vec<u64> {
        self.pending.values().copied().collect()
    }

    /// `basic.get` (to be acked); `None` if the queue is empty.
    pub async fn get(&mut self) -> Option<Got> {
        self.request_get();
        for _ in 0..6_000 {
            if let Some(g) = self.take_get() {
                return g;
            }
            assert!(self.closed.is_none(), "get refused: {:?}", self.closed);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("basic.get never answered");
    }

    /// Sends a `basic.get` (to be acked); its answer comes with
    /// [`take_get`](Self::take_get).
    pub fn request_get(&mut self) {
        self.request_get_from(QUEUE);
    }

    /// [`request_get`](Self::request_get) from `queue`.
    pub fn request_get_from(&mut self, queue: &str) {
        self.send(&method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue.into(),
                no_ack: false,
            })),
        ));
    }

    /// The oldest answer to a `basic.get` not taken yet (`Some(None)`: the
    /// queue was empty), after reading what the broker wrote.
    pub fn take_get(&mut self) -> Option<Option<Got>> {
        self.poll();
        self.gets.pop_front()
    }

    /// Starts a consumer of the queue (deliveries to be acked, at most
    /// `prefetch` unacked); its deliveries come with
    /// [`take_delivery`](Self::take_delivery).
    pub fn consume(&mut self, prefetch: u16) {
        let mut bytes = method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: prefetch,
                global: false,
            })),
        );
        bytes.extend(method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: QUEUE.into(),
                consumer_tag: "c".into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ));
        self.send(&bytes);
    }

    /// The oldest delivery to this client's consumer not taken yet, after
    /// reading what the broker wrote.
    pub fn take_delivery(&mut self) -> Option<Got> {
        self.poll();
        self.deliveries.pop_front()
    }

    /// Closes the connection as a client going away does (its unacked
    /// deliveries are requeued, its consumer goes).
    pub fn disconnect(self) {
        let departed = lock(&self.broker).disconnect(self.id, now_ms());
        drop(departed);
    }

    /// Why the broker closed the channel or connection, if it did.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    /// Publishes `seqs` and returns the confirmed ones once every one is
    /// settled (none may be nacked).
    pub async fn publish_confirmed(
        &mut self,
        seqs: impl IntoIterator<Item = u64>,
    ) -> BTreeSet<u64> {
        for seq in seqs {
            self.publish(seq, true);
        }
        self.settled().await;
        assert!(self.nacked.is_empty(), "nacked: {:?}", self.nacked);
        self.acked.clone()
    }

    /// Gets and acks every message left; returns them.
    pub async fn drain(&mut self) -> Vec<Got> {
        let mut out = Vec::new();
        while let Some(g) = self.get().await {
            self.ack(g.tag);
            out.push(g);
        }
        out
    }

    /// Acks one delivery.
    pub fn ack(&mut self, tag: u64) {
        self.send(&method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: tag,
                multiple: false,
            })),
        ));
    }

    /// Rejects one delivery, requeued.
    pub fn requeue(&mut self, tag: u64) {
        self.send(&method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag: tag,
                requeue: true,
            })),
        ));
    }

    /// Rejects one delivery, not requeued (dead-lettered).
    pub fn reject(&mut self, tag: u64) {
        self.send(&method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag: tag,
                requeue: false,
            })),
        ));
    }
}

/// The reason of the first `x-death` entry of a message's headers.
fn first_death(props: &BasicProperties) -> Option<String> {
    let deaths = props.headers().as_ref()?.inner().get("x-death")?.clone();
    let AMQPValue::FieldArray(deaths) = deaths else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    match first.inner().get("reason")? {
        AMQPValue::LongString(r) => Some(r.to_string()),
        AMQPValue::ShortString(r) => Some(r.to_string()),
        _ => None,
    }
}
