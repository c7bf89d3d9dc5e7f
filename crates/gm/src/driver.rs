//! The async driver: runs a node's ring members over any [`Transport`].
//!
//! One [`GmNode`] per node. It hosts members of any number of rings and keeps
//! one connection per pair of nodes, shared by all rings: every frame is a
//! [`PeerFrame::Ring`] naming its ring. The node with the smaller name dials,
//! the other accepts; a broken connection is redialled, and the members next
//! to a member on that node resynchronise (catchup) over the new one.
//!
//! Threads and tasks: one task per node runs every local member; per
//! connection a reader task hands it *batches* of frames and a writer task
//! takes *batches* of frames from an outbox, so no message crosses a task
//! boundary on its own. Membership goes through the [`ViewAuthority`]: joins,
//! removals of members on nodes the [`FailureDetector`] suspects (reported by
//! their ring neighbours only), and erasures of drained dead members.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use warren_transport::{Connection, FrameSender, PeerAddr, Transport, TransportError};

pub use crate::event::RingEvent;
use warren_wire::{NodeName, PeerFrame, encode_message, encode_ring_frame};

use crate::authority::ViewAuthority;
use crate::detector::FailureDetector;
use crate::frame::{Frame, FrameRef, Seq, decode_borrowed};
use crate::member::{Action, Config, GmError, Member, Phase};
use crate::view::{MemberId, View, ViewChange, ViewError, ViewVersion};

/// Why a driver operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// The transport failed (listening, typically).
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// The view authority refused a change.
    #[error("view authority: {0}")]
    Authority(#[from] ViewError),
    /// The member refused the broadcast.
    #[error("member: {0}")]
    Member(#[from] GmError),
    /// The node has stopped.
    #[error("the GM node has stopped")]
    Stopped,
    /// No such ring member on this node.
    #[error("no member {0} of ring {1:?} on this node")]
    NoSuchMember(MemberId, String),
}

/// Settings of a [`GmNode`].
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's name (the transport's node name).
    pub node: NodeName,
    /// Where to listen for peers.
    pub listen: PeerAddr,
    /// Settings of every member this node runs.
    pub member: Config,
    /// Timer period: heartbeats, failure detection, view polling.
    pub tick_interval: Duration,
    /// Poll the authority for every local ring's view every this many ticks
    /// (a safety net for a missed view change; with many rings, less often:
    /// at most 10 views are read a tick).
    pub view_poll_ticks: u32,
    /// Wait between two dials of an unreachable peer.
    pub redial_interval: Duration,
    /// A connection to a peer that carried nothing (not even a heartbeat)
    /// for this long is replaced: one that lived through a network cut may
    /// sit in TCP's retransmission backoff for many seconds after the heal,
    /// holding every ring that crosses it.
    pub silent_link_after: Duration,
    /// Where this node's member ids start (each join takes the next): random
    /// by default, so that a restarted node never reuses an id still in a
    /// view; a simulation sets it from its seed to replay a run exactly.
    pub member_ids_from: u64,
}

impl NodeConfig {
    /// Defaults: 10 ms ticks, view polling every 20 ticks, redial every
    /// 100 ms, a silent connection replaced after 3 s (heartbeats of the
    /// failure detector must be more frequent).
    pub fn new(node: NodeName, listen: PeerAddr) -> Self {
        Self {
            node,
            listen,
            member: Config::default(),
            tick_interval: Duration::from_millis(10),
            view_poll_ticks: 20,
            redial_interval: Duration::from_millis(100),
            silent_link_after: Duration::from_secs(3),
            member_ids_from: rand::random::<u64>() >> 8,
        }
    }
}

/// A frame for a peer node and the transport lane it goes on.
type Outgoing = (u64, Bytes);

/// The transport lane of the heartbeats; rings' lanes are odd ([`lane`]).
const HEARTBEAT_LANE: u64 = 0;

/// The transport lane of a ring's frames: they stay in order, and may be
/// overtaken by other rings' frames and heartbeats while one is long.
fn lane(ring: &str) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::hash::DefaultHasher::new();
    ring.hash(&mut h);
    h.finish() | 1
}

/// Most ring views the driver's safety-net poll reads in one tick.
const MAX_VIEW_POLLS_PER_TICK: usize = 10;

/// Proposes `change` to `ring`'s `view` once. Returns whether that settled
/// it (made, the new view handed to the node task; or refused) rather than
/// lost to a concurrent change (read the view again and retry).
async fn update_view(
    authority: &dyn ViewAuthority,
    in_tx: &mpsc::Sender<Inbound>,
    ring: &str,
    view: &View,
    change: ViewChange,
) -> bool {
    match authority.update(ring, view.version, change).await {
        Ok(view) => {
            let _ = in_tx
                .send(Inbound::View {
                    ring: ring.to_owned(),
                    view,
                    announce: true,
                    polled: false,
                })
                .await;
            true
        }
        Err(ViewError::Conflict { .. }) => {
            tokio::task::yield_now().await;
            false
        }
        Err(ViewError::Unavailable(e)) => {
            // No leader, no majority, a failing store: retrying at once
            // would burn the proposal's attempts (and the CPU) before an
            // election could end.
            tracing::debug!(%ring, error = %e, "view change not decided: retrying");
            tokio::time::sleep(UNDECIDED_RETRY).await;
            false
        }
        Err(e) => {
            tracing::debug!(%ring, error = %e, "view change refused");
            true
        }
    }
}

/// How long a proposal the authority could not decide waits before it is
/// made again ([`ViewError::Unavailable`]).
const UNDECIDED_RETRY: Duration = Duration::from_millis(50);

/// How often the removals of the members next to a node still suspected are
/// proposed again: a proposal gives up after its attempts (an authority
/// without a leader for seconds), and a suspicion is otherwise reported
/// only when it starts or a view is installed.
const SUSPECTS_REREPORT: Duration = Duration::from_secs(1);

/// How often a join waiting for a suspected node's members to leave the
/// ring looks again (see [`NodeTask::propose_join`]).
const JOIN_RETRY: Duration = Duration::from_millis(500);

/// How often a join waiting for the ring's dead members to be erased looks
/// again, and for how long at most it waits (see
/// [`NodeTask::propose_join`]).
const SETTLE_RETRY: Duration = Duration::from_millis(50);
const SETTLE_WAIT_MAX: Duration = Duration::from_secs(3);

/// The body of a [`PeerFrame::Ring`].
#[derive(Debug, Clone, Serialize)]
enum RingMsg {
    /// A member's frame for member `to`.
    Frame { to: MemberId, frame: Frame },
    /// The ring's view changed: fetch it.
    ViewChanged { version: ViewVersion },
    /// A message from member `from` to member `to` alone.
    Message {
        to: MemberId,
        from: MemberId,
        payload: Bytes,
    },
}

/// [`RingMsg`] decoded in place (the same wire format).
#[derive(Deserialize)]
enum RingMsgRef<'a> {
    Frame {
        to: MemberId,
        #[serde(borrow)]
        frame: FrameRef<'a>,
    },
    ViewChanged {
        version: ViewVersion,
    },
    Message {
        to: MemberId,
        from: MemberId,
        payload: &'a [u8],
    },
}

/// The variants of [`PeerFrame`] this driver reads, decoded in place (the same
/// wire format, checked by a test), so that payloads are never copied.
#[derive(Deserialize)]
enum PeerFrameRef<'a> {
    Heartbeat {
        #[allow(dead_code, reason = "only the frame's arrival matters")]
        seq: u64,
    },
    Ring {
        ring: &'a str,
        body: &'a [u8],
    },
}

/// What a consumer of ring events asks to be called with when there are
/// some ([`RingHandle::on_ready`]).
pub type ReadyHook = Arc<dyn Fn() + Send + Sync>;

/// A queue of items handed from one task to another in batches.
struct Handoff<T> {
    items: Mutex<(VecDeque<T>, bool)>,
    notify: Notify,
    /// Called on each wake as well, once set.
    hook: std::sync::OnceLock<ReadyHook>,
}

impl<T> std::fmt::Debug for Handoff<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff").finish_non_exhaustive()
    }
}

impl<T> Handoff<T> {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            items: Mutex::new((VecDeque::new(), false)),
            notify: Notify::new(),
            hook: std::sync::OnceLock::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (VecDeque<T>, bool)> {
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends items (the caller wakes the consumer with `wake`).
    fn extend(&self, items: impl IntoIterator<Item = T>) {
        self.lock().0.extend(items);
    }

    fn wake(&self) {
        self.notify.notify_one();
        if let Some(hook) = self.hook.get() {
            hook();
        }
    }

    fn close(&self) {
        self.lock().1 = true;
        self.wake();
    }

    /// Takes every item there is without waiting; `false` (taking
    /// nothing) once closed.
    fn try_take(&self, out: &mut Vec<T>) -> bool {
        let mut g = self.lock();
        if g.1 {
            return false;
        }
        out.extend(g.0.drain(..));
        true
    }

    /// Waits for items and takes them all; `false` once closed.
    async fn take(&self, out: &mut Vec<T>) -> bool {
        loop {
            let before = out.len();
            if !self.try_take(out) {
                return false;
            }
            if out.len() > before {
                return true;
            }
            self.notify.notified().await;
        }
    }
}

/// A running node: hosts ring members and talks to peer nodes.
#[derive(Debug)]
pub struct GmNode {
    node: NodeName,
    local_addr: PeerAddr,
    cmd: mpsc::Sender<Command>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

/// A local member of one ring, for the application.
#[derive(Debug)]
pub struct RingHandle {
    ring: String,
    member: MemberId,
    cmd: mpsc::Sender<Command>,
    events: Arc<Handoff<RingEvent>>,
}

enum Command {
    AddPeer(NodeName, PeerAddr),
    Join(String, oneshot::Sender<RingHandle>),
    Leave(String, MemberId),
    Broadcast {
        ring: String,
        member: MemberId,
        payloads: Vec<Bytes>,
        /// Where the outcome goes; without one, a failure reaches the
        /// member's events as [`RingEvent::Removed`].
        reply: Option<oneshot::Sender<Result<Seq, DriverError>>>,
        events: Arc<Handoff<RingEvent>>,
    },
    Send {
        ring: String,
        from: MemberId,
        to: MemberId,
        payload: Bytes,
    },
}

enum Inbound {
    Connected {
        peer: NodeName,
        conn: u64,
        sender: Box<dyn FrameSender>,
        /// Ends the connection's reader (the connection is replaced).
        close: Arc<Notify>,
    },
    Frames {
        peer: NodeName,
        conn: u64,
        frames: Vec<Bytes>,
    },
    Down {
        peer: NodeName,
        conn: u64,
    },
    View {
        ring: String,
        view: View,
        announce: bool,
        /// Read by the safety-net poll (this node's own copy), not by a
        /// fetch: it does not end a fetch in flight.
        polled: bool,
    },
    Proposed {
        ring: String,
        member: MemberId,
    },
}

/// Fail-stop for a task every ring of the node depends on: if it panics,
/// the process aborts. Otherwise the node would stay up with every mirrored
/// queue on it hanging; a node that stops is one the cluster fails over
/// from. `what` names the task in the log.
pub fn abort_if_panics(task: tokio::task::JoinHandle<()>, node: String, what: &'static str) {
    tokio::spawn(async move {
        if let Err(e) = task.await
            && e.is_panic()
        {
            tracing::error!(node = %node, "{what} panicked: stopping the node so that the cluster fails over");
            std::process::abort();
        }
    });
}

fn spawn_tracked<F>(tasks: &Mutex<Vec<AbortHandle>>, fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let handle = tokio::spawn(fut);
    let mut t = tasks.lock().unwrap_or_else(|e| e.into_inner());
    t.retain(|h| !h.is_finished());
    t.push(handle.abort_handle());
}

impl GmNode {
    /// Starts a node: listens at `config.listen` and runs its event loop.
    pub async fn start(
        config: NodeConfig,
        transport: Arc<dyn Transport>,
        authority: Arc<dyn ViewAuthority>,
        detector: Box<dyn FailureDetector>,
    ) -> Result<Self, DriverError> {
        let mut listener = transport.listen(&config.listen).await?;
        let local_addr = listener.local_addr();
        let tasks = Arc::new(Mutex::new(Vec::new()));
        let (cmd_tx, cmd_rx) = mpsc::channel(1024);
        let (in_tx, in_rx) = mpsc::channel(1024);
        let conn_ids = Arc::new(AtomicU64::new(1));
        {
            let in_tx = in_tx.clone();
            let conn_ids = conn_ids.clone();
            let tasks2 = tasks.clone();
            spawn_tracked(&tasks, async move {
                while let Ok(conn) = listener.accept().await {
                    let id = conn_ids.fetch_add(1, Ordering::Relaxed);
                    if !adopt(conn, id, &in_tx, &tasks2, None).await {
                        break;
                    }
                }
            });
        }
        let task = NodeTask {
            cfg: config.clone(),
            transport,
            authority,
            detector,
            rings: BTreeMap::new(),
            peers: BTreeMap::new(),
            in_tx,
            cmd_tx: cmd_tx.clone(),
            conn_ids,
            tasks: tasks.clone(),
            id_base: config.member_ids_from,
            next_member: 0,
            hb_seq: 0,
            poll_credit: 0.0,
            poll_cursor: String::new(),
            fetching: BTreeSet::new(),
            removing: BTreeSet::new(),
            suspects: Arc::default(),
            suspects_reported: Instant::now(),
            loopback: VecDeque::new(),
            woken: BTreeSet::new(),
            dirty: BTreeSet::new(),
        };
        let run = tokio::spawn(task.run(cmd_rx, in_rx));
        tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(run.abort_handle());
        // Without its task no ring of this node moves.
        abort_if_panics(run, config.node.to_string(), "the GM node task");
        Ok(Self {
            node: config.node,
            local_addr,
            cmd: cmd_tx,
            tasks,
        })
    }

    /// This node's name.
    pub fn node(&self) -> &NodeName {
        &self.node
    }

    /// The address peers dial.
    pub fn local_addr(&self) -> &PeerAddr {
        &self.local_addr
    }

    /// Tells the node where a peer node listens.
    pub async fn add_peer(&self, node: NodeName, addr: PeerAddr) -> Result<(), DriverError> {
        self.cmd
            .send(Command::AddPeer(node, addr))
            .await
            .map_err(|_| DriverError::Stopped)
    }

    /// Joins `ring` with a new member (spliced in after the ring's last alive
    /// member). The handle's events say when the view with it is installed.
    pub async fn join(&self, ring: &str) -> Result<RingHandle, DriverError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(Command::Join(ring.to_owned(), tx))
            .await
            .map_err(|_| DriverError::Stopped)?;
        rx.await.map_err(|_| DriverError::Stopped)
    }

    /// Stops every task of the node at once (connections drop, as in a crash).
    pub fn shutdown(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        for t in tasks {
            t.abort();
        }
    }
}

impl Drop for GmNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl RingHandle {
    /// The ring's name.
    pub fn ring(&self) -> &str {
        &self.ring
    }

    /// This member's id.
    pub fn member(&self) -> MemberId {
        self.member
    }

    /// Broadcasts a batch of payloads; returns the last one's sequence number.
    pub async fn broadcast(&self, payloads: Vec<Bytes>) -> Result<Seq, DriverError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(Command::Broadcast {
                ring: self.ring.clone(),
                member: self.member,
                payloads,
                reply: Some(tx),
                events: self.events.clone(),
            })
            .await
            .map_err(|_| DriverError::Stopped)?;
        rx.await.map_err(|_| DriverError::Stopped)?
    }

    /// Broadcasts a batch of payloads without waiting for the node's task to
    /// take them (the caller moves on at once). If the member cannot
    /// broadcast (removed, or not joined), its events get
    /// [`RingEvent::Removed`], as a failed [`broadcast`](Self::broadcast)
    /// would be handled.
    pub async fn broadcast_later(&self, payloads: Vec<Bytes>) -> Result<(), DriverError> {
        self.cmd
            .send(Command::Broadcast {
                ring: self.ring.clone(),
                member: self.member,
                payloads,
                reply: None,
                events: self.events.clone(),
            })
            .await
            .map_err(|_| DriverError::Stopped)
    }

    /// Sends `payload` to member `to` of the ring alone (one hop, not round
    /// the ring); it arrives as [`RingEvent::Message`], unordered with
    /// broadcasts, and is lost if `to` is not in this member's view or the
    /// link to its node breaks.
    pub async fn send(&self, to: MemberId, payload: Bytes) -> Result<(), DriverError> {
        self.cmd
            .send(Command::Send {
                ring: self.ring.clone(),
                from: self.member,
                to,
                payload,
            })
            .await
            .map_err(|_| DriverError::Stopped)
    }

    /// Leaves the ring: the member stops at once (as if it crashed) and its
    /// removal from the view is proposed, so the others carry on without it.
    pub async fn leave(&self) {
        let _ = self
            .cmd
            .send(Command::Leave(self.ring.clone(), self.member))
            .await;
    }

    /// Waits for events and appends all that are ready to `out`; `false` once the node stopped.
    pub async fn next_events(&self, out: &mut Vec<RingEvent>) -> bool {
        self.events.take(out).await
    }

    /// Appends the events that are ready to `out` without waiting; `false`
    /// once the node stopped.
    pub fn try_events(&self, out: &mut Vec<RingEvent>) -> bool {
        self.events.try_take(out)
    }

    /// Has `hook` called whenever events arrive (and once now), for a
    /// consumer that serves many members from one task with
    /// [`try_events`](Self::try_events). Only the first hook set counts.
    pub fn on_ready(&self, hook: ReadyHook) {
        let _ = self.events.hook.set(hook);
        self.events.wake();
    }
}

/// Splits a new connection: the reader starts, the sender goes to the node task.
async fn adopt(
    conn: Connection,
    id: u64,
    in_tx: &mpsc::Sender<Inbound>,
    tasks: &Mutex<Vec<AbortHandle>>,
    down: Option<Arc<Notify>>,
) -> bool {
    let peer = conn.peer_node().clone();
    let (sender, mut receiver) = conn.split();
    let close = Arc::new(Notify::new());
    let connected = Inbound::Connected {
        peer: peer.clone(),
        conn: id,
        sender,
        close: close.clone(),
    };
    if in_tx.send(connected).await.is_err() {
        return false;
    }
    let in_tx = in_tx.clone();
    spawn_tracked(tasks, async move {
        let mut frames = Vec::new();
        loop {
            let got = tokio::select! {
                r = receiver.recv_batch(&mut frames, 4096) => r,
                () = close.notified() => break,
            };
            match got {
                Ok(n) if n > 0 => {
                    let batch = Inbound::Frames {
                        peer: peer.clone(),
                        conn: id,
                        frames: std::mem::take(&mut frames),
                    };
                    if in_tx.send(batch).await.is_err() {
                        return;
                    }
                }
                _ => break,
            }
        }
        let _ = in_tx.send(Inbound::Down { peer, conn: id }).await;
        if let Some(down) = down {
            down.notify_one();
        }
    });
    true
}

struct Peer {
    /// Where the peer listens (its dialer follows changes: a restarted
    /// node listens elsewhere).
    addr: Option<watch::Sender<PeerAddr>>,
    conn: u64,
    outbox: Option<Arc<Handoff<Outgoing>>>,
    dialing: bool,
    /// When the current connection last carried a frame.
    heard: Instant,
    /// Ends the current connection's reader.
    close: Option<Arc<Notify>>,
}

struct Local {
    member: Member,
    events: Arc<Handoff<RingEvent>>,
}

struct NodeTask {
    cfg: NodeConfig,
    transport: Arc<dyn Transport>,
    authority: Arc<dyn ViewAuthority>,
    detector: Box<dyn FailureDetector>,
    rings: BTreeMap<String, BTreeMap<MemberId, Local>>,
    peers: BTreeMap<NodeName, Peer>,
    in_tx: mpsc::Sender<Inbound>,
    cmd_tx: mpsc::Sender<Command>,
    conn_ids: Arc<AtomicU64>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
    id_base: u64,
    next_member: u64,
    hb_seq: u64,
    /// View reads the poll may make now (fractional: a ring every so many ticks).
    poll_credit: f64,
    /// The ring whose view the poll read last.
    poll_cursor: String,
    fetching: BTreeSet<String>,
    removing: BTreeSet<(String, MemberId)>,
    /// Nodes suspected dead and not heard from since: a removal proposed
    /// because of a suspicion is dropped once its node is heard from again
    /// (a healed partition), however long the proposal took.
    suspects: Arc<Mutex<BTreeSet<NodeName>>>,
    /// When the suspects' neighbours were last reported again
    /// ([`SUSPECTS_REREPORT`]).
    suspects_reported: Instant,
    loopback: VecDeque<(String, MemberId, Frame)>,
    woken: BTreeSet<NodeName>,
    /// Members that took input since the last flush.
    dirty: BTreeSet<(String, MemberId)>,
}

impl NodeTask {
    async fn run(
        mut self,
        mut cmd_rx: mpsc::Receiver<Command>,
        mut in_rx: mpsc::Receiver<Inbound>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.tick_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                cmd = cmd_rx.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => return,
                },
                msg = in_rx.recv() => match msg {
                    Some(msg) => self.on_inbound(msg),
                    None => return,
                },
                _ = tick.tick() => self.on_tick(),
            }
            // Take whatever else is ready before flushing: one flush per turn.
            for _ in 0..64 {
                let mut idle = true;
                if let Ok(msg) = in_rx.try_recv() {
                    self.on_inbound(msg);
                    idle = false;
                }
                if let Ok(cmd) = cmd_rx.try_recv() {
                    self.on_command(cmd);
                    idle = false;
                }
                if idle {
                    break;
                }
            }
            self.flush_all();
        }
    }

    fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        spawn_tracked(&self.tasks, fut);
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::AddPeer(node, addr) => {
                let now = Instant::now();
                self.detector.watch(&node, now);
                let peer = self.peers.entry(node.clone()).or_insert(Peer {
                    addr: None,
                    conn: 0,
                    outbox: None,
                    dialing: false,
                    heard: Instant::now(),
                    close: None,
                });
                match &peer.addr {
                    Some(tx) => {
                        tx.send_replace(addr);
                    }
                    None => {
                        let (tx, rx) = watch::channel(addr);
                        peer.addr = Some(tx);
                        if self.cfg.node < node && !peer.dialing {
                            peer.dialing = true;
                            self.spawn_dialer(node, rx);
                        }
                    }
                }
            }
            Command::Leave(ring, member) => {
                if let Some(r) = self.rings.get_mut(&ring) {
                    r.remove(&member);
                }
                self.remove(ring, member, None);
            }
            Command::Join(ring, reply) => {
                self.next_member += 1;
                let id = MemberId(self.id_base.wrapping_add(self.next_member));
                let events = Handoff::new();
                let local = Local {
                    member: Member::new(id, self.cfg.member.clone()),
                    events: events.clone(),
                };
                self.rings
                    .entry(ring.clone())
                    .or_default()
                    .insert(id, local);
                let _ = reply.send(RingHandle {
                    ring: ring.clone(),
                    member: id,
                    cmd: self.cmd_tx.clone(),
                    events,
                });
                self.propose_join(ring, id);
            }
            Command::Broadcast {
                ring,
                member,
                payloads,
                reply,
                events,
            } => {
                let failed = |e: DriverError, reply: Option<oneshot::Sender<_>>| match reply {
                    Some(reply) => {
                        let _ = reply.send(Err(e));
                    }
                    None => {
                        tracing::debug!(error = %e, "ring broadcast failed");
                        events.extend([RingEvent::Removed]);
                        events.wake();
                    }
                };
                let Some(local) = self.rings.get_mut(&ring).and_then(|r| r.get_mut(&member)) else {
                    failed(DriverError::NoSuchMember(member, ring), reply);
                    return;
                };
                let mut result = Ok(local.member.last_broadcast());
                for p in payloads {
                    match local.member.broadcast(p) {
                        Ok(seq) => result = Ok(seq),
                        Err(e) => {
                            result = Err(e.into());
                            break;
                        }
                    }
                }
                match (result, reply) {
                    (result, Some(reply)) => {
                        let _ = reply.send(result);
                    }
                    (Err(e), None) => failed(e, None),
                    (Ok(_), None) => {}
                }
                self.dirty.insert((ring.clone(), member));
                self.drive(&ring, member);
            }
            Command::Send {
                ring,
                from,
                to,
                payload,
            } => {
                let node = self
                    .rings
                    .get(&ring)
                    .and_then(|r| r.get(&from))
                    .and_then(|l| l.member.view().entry(to))
                    .map(|e| e.node.clone());
                match node {
                    Some(node) if node == self.cfg.node => {
                        self.hand_message(&ring, to, from, payload)
                    }
                    Some(node) => {
                        let msg = RingMsg::Message { to, from, payload };
                        if let Some(bytes) = self.ring_frame(&ring, &msg) {
                            self.push_to(&node, bytes);
                        }
                    }
                    None => {}
                }
            }
        }
    }

    /// Gives a point-to-point message to local member `to`, if it is here.
    fn hand_message(&mut self, ring: &str, to: MemberId, from: MemberId, payload: Bytes) {
        if let Some(local) = self.rings.get(ring).and_then(|r| r.get(&to)) {
            local.events.extend([RingEvent::Message { from, payload }]);
            local.events.wake();
        }
    }

    fn spawn_dialer(&self, peer: NodeName, addr: watch::Receiver<PeerAddr>) {
        let transport = self.transport.clone();
        let in_tx = self.in_tx.clone();
        let conn_ids = self.conn_ids.clone();
        let tasks = self.tasks.clone();
        let redial = self.cfg.redial_interval;
        self.spawn(async move {
            loop {
                let target = addr.borrow().clone();
                if let Ok(conn) = transport.connect(&target).await
                    && conn.peer_node() == &peer
                {
                    let down = Arc::new(Notify::new());
                    let id = conn_ids.fetch_add(1, Ordering::Relaxed);
                    if !adopt(conn, id, &in_tx, &tasks, Some(down.clone())).await {
                        return;
                    }
                    down.notified().await;
                }
                tokio::time::sleep(redial).await;
            }
        });
    }

    fn on_inbound(&mut self, msg: Inbound) {
        match msg {
            Inbound::Connected {
                peer,
                conn,
                sender,
                close,
            } => {
                let outbox = Handoff::new();
                let entry = self.peers.entry(peer.clone()).or_insert(Peer {
                    addr: None,
                    conn: 0,
                    outbox: None,
                    dialing: false,
                    heard: Instant::now(),
                    close: None,
                });
                if conn < entry.conn {
                    return;
                }
                entry.conn = conn;
                entry.heard = Instant::now();
                if let Some(old) = entry.outbox.replace(outbox.clone()) {
                    old.close();
                }
                if let Some(old) = entry.close.replace(close) {
                    old.notify_one();
                }
                self.detector.watch(&peer, Instant::now());
                self.spawn(write_loop(sender, outbox));
                self.link_reset(&peer);
            }
            Inbound::Down { peer, conn } => {
                if let Some(p) = self.peers.get_mut(&peer)
                    && p.conn == conn
                    && let Some(outbox) = p.outbox.take()
                {
                    outbox.close();
                }
            }
            Inbound::Frames { peer, conn, frames } => {
                let now = Instant::now();
                match self.peers.get_mut(&peer) {
                    Some(p) if p.conn == conn => p.heard = now,
                    _ => return,
                }
                self.detector.heard_from(&peer, now);
                self.suspects
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(&peer);
                for bytes in frames {
                    self.on_peer_frame(bytes);
                }
            }
            Inbound::View {
                ring,
                view,
                announce,
                polled,
            } => {
                if !polled {
                    self.fetching.remove(&ring);
                }
                if announce {
                    self.announce(&ring, &view);
                }
                self.install(&ring, &view);
            }
            Inbound::Proposed { ring, member } => {
                self.removing.remove(&(ring, member));
            }
        }
    }

    fn on_peer_frame(&mut self, bytes: Bytes) {
        let Ok(PeerFrameRef::Ring { ring, body }) = decode_borrowed::<PeerFrameRef<'_>>(&bytes)
        else {
            return; // heartbeats only feed the detector; the rest is not ours
        };
        match decode_borrowed::<RingMsgRef<'_>>(body) {
            Ok(RingMsgRef::Frame { to, frame }) => {
                let frame = frame.into_frame(&bytes);
                if let Some(local) = self.rings.get_mut(ring).and_then(|r| r.get_mut(&to)) {
                    local.member.handle_frame(frame);
                    self.dirty.insert((ring.to_owned(), to));
                    self.drive(ring, to);
                    self.run_loopback();
                }
            }
            Ok(RingMsgRef::ViewChanged { version }) => {
                let behind = self
                    .rings
                    .get(ring)
                    .is_some_and(|r| r.values().any(|l| l.member.view().version < version));
                if behind {
                    self.fetch(ring);
                }
            }
            Ok(RingMsgRef::Message { to, from, payload }) => {
                let payload = bytes.slice_ref(payload);
                self.hand_message(ring, to, from, payload);
            }
            Err(e) => tracing::debug!(%ring, error = %e, "malformed ring frame ignored"),
        }
    }

    /// The connection to `peer` was (re)established: members next to a member
    /// on `peer` resynchronise over it, and every member of a ring with a
    /// member on `peer` hears of it ([`RingEvent::LinkReset`]).
    fn link_reset(&mut self, peer: &NodeName) {
        let mut touched = Vec::new();
        for (ring, members) in &mut self.rings {
            for (&id, local) in members.iter_mut() {
                let view = local.member.view().clone();
                let on_peer = |m: MemberId| view.entry(m).is_some_and(|e| &e.node == peer);
                if view.alive().any(on_peer) {
                    local.events.extend([RingEvent::LinkReset]);
                    local.events.wake();
                }
                for n in [view.left_of(id), view.right_of(id)].into_iter().flatten() {
                    if n != id && on_peer(n) {
                        local.member.handle_link_reset(n);
                        touched.push((ring.clone(), id));
                    }
                }
            }
        }
        for (ring, id) in touched {
            self.dirty.insert((ring.clone(), id));
            self.drive(&ring, id);
        }
        self.run_loopback();
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        self.replace_silent_links(now);
        if self.detector.heartbeat_due(now) {
            self.hb_seq += 1;
            let hb = encode_message(&PeerFrame::Heartbeat { seq: self.hb_seq })
                .map(|hb| (HEARTBEAT_LANE, Bytes::from(hb)))
                .ok();
            if let Some(hb) = hb {
                let names: Vec<NodeName> = self.peers.keys().cloned().collect();
                for name in names {
                    self.push_to(&name, hb.clone());
                }
            }
        }
        for suspect in self.detector.poll_suspects(now) {
            tracing::info!(node = %self.cfg.node, %suspect, "peer node suspected dead");
            self.suspects
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(suspect.clone());
            self.report_neighbours_on(&suspect);
        }
        if now.saturating_duration_since(self.suspects_reported) >= SUSPECTS_REREPORT {
            self.suspects_reported = now;
            let still: Vec<NodeName> = self
                .suspects
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .cloned()
                .collect();
            // A removal still in flight is not proposed twice (`remove`).
            for suspect in still {
                self.report_neighbours_on(&suspect);
            }
        }
        self.poll_views();
        // Every member ticks in place; only those with something to do are
        // driven (1,000 rings: no key copied, no view cloned when idle).
        let mut busy = Vec::new();
        for (ring, members) in &mut self.rings {
            for (id, local) in members.iter_mut() {
                local.member.handle_tick();
                if local.member.has_actions() {
                    busy.push((ring.clone(), *id));
                }
            }
        }
        self.each_member(busy, |_| {});
    }

    /// Drops each connection that carried nothing for
    /// [`NodeConfig::silent_link_after`]: its reader ends, the dialing side
    /// dials again, and the rings resend their state over the new one.
    fn replace_silent_links(&mut self, now: Instant) {
        let after = self.cfg.silent_link_after;
        for (node, p) in &mut self.peers {
            if p.outbox.is_none() || now.saturating_duration_since(p.heard) < after {
                continue;
            }
            tracing::info!(node = %self.cfg.node, peer = %node, silent_ms = after.as_millis() as u64, "ring connection silent: replacing it");
            if let Some(outbox) = p.outbox.take() {
                outbox.close();
            }
            if let Some(close) = p.close.take() {
                close.notify_one();
            }
        }
    }

    /// The safety net for a missed view change: reads the views of the
    /// local rings in turn, each about every `view_poll_ticks` ticks, but
    /// never more than [`MAX_VIEW_POLLS_PER_TICK`] a tick (with 1,000 rings
    /// each is read every second instead of 5,000 reads a second).
    fn poll_views(&mut self) {
        let period = f64::from(self.cfg.view_poll_ticks.max(1));
        self.poll_credit = (self.poll_credit + self.rings.len() as f64 / period)
            .min(MAX_VIEW_POLLS_PER_TICK as f64);
        let due = self.poll_credit as usize;
        if due == 0 {
            return;
        }
        self.poll_credit -= due as f64;
        // The rings after the last one polled, then from the start.
        let after = (
            std::ops::Bound::Excluded(self.poll_cursor.as_str()),
            std::ops::Bound::Unbounded,
        );
        let next: Vec<String> = self
            .rings
            .range::<str, _>(after)
            .chain(self.rings.iter())
            .map(|(ring, _)| ring.clone())
            .take(due.min(self.rings.len()))
            .collect();
        for ring in next {
            self.fetch_view(&ring, false);
            self.poll_cursor = ring;
        }
    }

    /// Applies `f` to the local members `keys` and runs their actions.
    fn each_member(&mut self, keys: Vec<(String, MemberId)>, f: fn(&mut Member)) {
        for (ring, id) in keys {
            if let Some(local) = self.rings.get_mut(&ring).and_then(|r| r.get_mut(&id)) {
                f(&mut local.member);
            }
            self.drive(&ring, id);
            self.run_loopback();
        }
    }

    /// Reports members on `suspect` that neighbour a local member.
    fn report_neighbours_on(&mut self, suspect: &NodeName) {
        let rings: Vec<String> = self.rings.keys().cloned().collect();
        for ring in rings {
            self.report_neighbours(&ring, |node| node == suspect);
        }
    }

    /// Proposes removing each member of `ring` next to a local member whose
    /// node `suspected` says is suspected dead.
    fn report_neighbours(&mut self, ring: &str, suspected: impl Fn(&NodeName) -> bool) {
        let mut victims = Vec::new();
        for (&id, local) in self.rings.get(ring).into_iter().flatten() {
            if local.member.phase() == Phase::Removed {
                continue;
            }
            let view = local.member.view();
            for n in [view.left_of(id), view.right_of(id)].into_iter().flatten() {
                if let Some(e) = view.entry(n).filter(|e| e.alive && suspected(&e.node)) {
                    victims.push((n, e.node.clone()));
                }
            }
        }
        for (victim, node) in victims {
            self.remove(ring.to_owned(), victim, Some(node));
        }
    }

    /// Proposes removing `victim` from `ring`; when that is because its node
    /// `suspect` is suspected dead, only while it still is.
    fn remove(&mut self, ring: String, victim: MemberId, suspect: Option<NodeName>) {
        if !self.removing.insert((ring.clone(), victim)) {
            return;
        }
        let in_tx = self.in_tx.clone();
        let ring2 = ring.clone();
        let suspects = self.suspects.clone();
        // A later report of the same member is allowed a second after this
        // one is settled or given up (not while it runs: reports come every
        // [`SUSPECTS_REREPORT`] while a suspicion lasts).
        let settled = async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = in_tx
                .send(Inbound::Proposed {
                    ring: ring2,
                    member: victim,
                })
                .await;
        };
        let make = move |view: &View| {
            let still = suspect.as_ref().is_none_or(|n| {
                suspects
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .contains(n)
            });
            if !still {
                tracing::info!(%victim, "its node was heard from again: member not removed");
            }
            (still && view.is_alive(victim)).then_some(ViewChange::Remove(victim))
        };
        self.propose(ring, make, settled);
    }

    /// Proposes that member `id` of this node joins `ring`, after its last
    /// alive member; while a member of the ring lives on a node this node
    /// suspects, it waits (the two could not pass the ring's traffic to
    /// each other: the member beside it would be removed at once, and ours
    /// by the other side, over and over while the cut lasts).
    fn propose_join(&self, ring: String, id: MemberId) {
        let authority = self.authority.clone();
        let in_tx = self.in_tx.clone();
        let suspects = self.suspects.clone();
        let node = self.cfg.node.clone();
        self.spawn(async move {
            let mut waited = false;
            let mut settling = Duration::ZERO;
            loop {
                let Ok(view) = authority.current(&ring).await else {
                    return;
                };
                // A dead member is erased by the alive member that inherits
                // it, once its messages have gone round. If that heir is
                // still joining it cannot know them, and its join fails
                // (gm.erl's Lemma 2); so would ours, spliced behind it, once
                // it inherits the same dead member: with every member a
                // joiner (the ring's founder died as the others joined) no
                // join would ever settle. Wait until no alive member
                // inherits a dead one (once all have failed, the ring starts
                // afresh), for a few seconds at most.
                // (The wait reads this node's own copy of the view: a
                // restarted node joins all its rings at once.)
                let unsettled = |v: &View| v.alive().any(|m| !v.inherited_by(m).is_empty());
                if settling < SETTLE_WAIT_MAX && unsettled(&view) {
                    while settling < SETTLE_WAIT_MAX {
                        settling += SETTLE_RETRY;
                        tokio::time::sleep(SETTLE_RETRY).await;
                        if authority
                            .current_local(&ring)
                            .await
                            .is_ok_and(|v| !unsettled(&v))
                        {
                            break;
                        }
                    }
                    continue;
                }
                let blocked = {
                    let suspects = suspects
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    view.alive()
                        .filter_map(|m| view.entry(m))
                        .find(|e| suspects.contains(&e.node))
                        .map(|e| e.node.clone())
                };
                if let Some(suspect) = blocked {
                    if !waited {
                        tracing::info!(node = %node, %ring, %suspect, "joining once a suspected node's member is out of the ring");
                        waited = true;
                    }
                    tokio::time::sleep(JOIN_RETRY).await;
                    continue;
                }
                let change = ViewChange::Join {
                    member: id,
                    after: view.alive().last(),
                    node: node.clone(),
                };
                if update_view(&*authority, &in_tx, &ring, &view, change).await {
                    return;
                }
            }
        });
    }

    /// Proposes the change `make` builds from the current view, retrying on
    /// conflicts; `then` runs once the proposal is settled or given up.
    fn propose<F>(&self, ring: String, make: F, then: impl Future<Output = ()> + Send + 'static)
    where
        F: Fn(&View) -> Option<ViewChange> + Send + 'static,
    {
        let authority = self.authority.clone();
        let in_tx = self.in_tx.clone();
        self.spawn(async move {
            for _ in 0..100 {
                let Ok(view) = authority.current(&ring).await else {
                    break;
                };
                let Some(change) = make(&view) else {
                    break;
                };
                if update_view(&*authority, &in_tx, &ring, &view, change).await {
                    break;
                }
            }
            then.await;
        });
    }

    /// Reads the ring's view from the authority (fresh) and installs it if
    /// newer.
    fn fetch(&mut self, ring: &str) {
        self.fetch_view(ring, true);
    }

    /// Reads the ring's view, `fresh` ([`ViewAuthority::current`]) or as
    /// this node last learned it ([`ViewAuthority::current_local`], for the
    /// safety-net poll), and installs it if newer.
    fn fetch_view(&mut self, ring: &str, fresh: bool) {
        // A poll is not worth it while a fetch, which reads newer, is out.
        let busy = if fresh {
            !self.fetching.insert(ring.to_owned())
        } else {
            self.fetching.contains(ring)
        };
        if busy {
            return;
        }
        let authority = self.authority.clone();
        let in_tx = self.in_tx.clone();
        let ring = ring.to_owned();
        self.spawn(async move {
            let view = if fresh {
                authority.current(&ring).await
            } else {
                authority.current_local(&ring).await
            };
            if let Ok(view) = view {
                let _ = in_tx
                    .send(Inbound::View {
                        ring,
                        view,
                        announce: false,
                        polled: !fresh,
                    })
                    .await;
            }
        });
    }

    /// Tells every other node of the view that it changed.
    fn announce(&mut self, ring: &str, view: &View) {
        let msg = RingMsg::ViewChanged {
            version: view.version,
        };
        let Some(bytes) = self.ring_frame(ring, &msg) else {
            return;
        };
        let nodes: BTreeSet<NodeName> = view
            .entries
            .iter()
            .map(|e| e.node.clone())
            .filter(|n| n != &self.cfg.node)
            .collect();
        for n in nodes {
            self.push_to(&n, bytes.clone());
        }
    }

    fn install(&mut self, ring: &str, view: &View) {
        let ids: Vec<MemberId> = self
            .rings
            .get(ring)
            .map(|r| r.keys().copied().collect())
            .unwrap_or_default();
        // A member of this node alive in the view but not held here left
        // before its join was committed (its removal found nothing to
        // remove), or is from an earlier run of this node. Nobody would
        // forward the ring's traffic past it: remove it.
        let orphans: Vec<MemberId> = view
            .entries
            .iter()
            .filter(|e| e.alive && e.node == self.cfg.node && !ids.contains(&e.id))
            .map(|e| e.id)
            .filter(|id| !self.removing.contains(&(ring.to_owned(), *id)))
            .collect();
        for orphan in orphans {
            tracing::info!(node = %self.cfg.node, %ring, member = %orphan, view = view.version, "removing a member this node no longer holds");
            self.remove(ring.to_owned(), orphan, None);
        }
        for id in ids {
            if let Some(local) = self.rings.get_mut(ring).and_then(|r| r.get_mut(&id)) {
                local.member.handle_view(view.clone());
            }
            self.dirty.insert((ring.to_owned(), id));
            self.drive(ring, id);
        }
        self.run_loopback();
        self.report_suspected_neighbours(ring);
    }

    /// Reports the members of `ring` next to a local member that live on a
    /// node still suspected dead. A suspicion is reported when it starts
    /// ([`Self::report_neighbours_on`]); a view installed later (a member
    /// joined, or this node's own new member) can put such a member next to
    /// one of ours again, and the ring would stall on it until the node is
    /// heard from.
    fn report_suspected_neighbours(&mut self, ring: &str) {
        let suspects = self
            .suspects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if !suspects.is_empty() {
            self.report_neighbours(ring, |node| suspects.contains(node));
        }
    }

    fn ring_frame(&self, ring: &str, msg: &RingMsg) -> Option<Outgoing> {
        let bytes = encode_ring_frame(ring, msg).ok()?;
        Some((lane(ring), Bytes::from(bytes)))
    }

    fn push_to(&mut self, node: &NodeName, frame: Outgoing) {
        if let Some(outbox) = self.peers.get(node).and_then(|p| p.outbox.as_ref()) {
            outbox.extend([frame]);
            self.woken.insert(node.clone());
        }
    }

    /// Runs one member's actions.
    fn drive(&mut self, ring: &str, id: MemberId) {
        let Some(local) = self.rings.get_mut(ring).and_then(|r| r.get_mut(&id)) else {
            return;
        };
        if !local.member.has_actions() {
            return;
        }
        let mut events = Vec::new();
        let mut sends = Vec::new();
        let mut proposals = Vec::new();
        let mut need_view = false;
        for action in local.member.drain_actions() {
            match action {
                Action::Send { to, frame } => sends.push((to, frame)),
                Action::Deliver {
                    publisher,
                    seq,
                    payload,
                } => events.push(RingEvent::Deliver {
                    publisher,
                    seq,
                    payload,
                }),
                Action::Confirm { up_to } => events.push(RingEvent::Confirm { up_to }),
                Action::ViewInstalled { version } => events.push(RingEvent::View { version }),
                Action::NeedView { .. } => need_view = true,
                Action::Erase { dead } => proposals.push(ViewChange::Erase(dead)),
                Action::JoinFailed => {
                    events.push(RingEvent::Removed);
                    proposals.push(ViewChange::Remove(id));
                }
                Action::Removed => events.push(RingEvent::Removed),
            }
        }
        if !events.is_empty() {
            local.events.extend(events);
            local.events.wake();
        }
        let view = local.member.view();
        let sends: Vec<(MemberId, NodeName, Frame)> = sends
            .into_iter()
            .filter_map(|(to, frame)| view.entry(to).map(|e| (to, e.node.clone(), frame)))
            .collect();
        for (to, node, frame) in sends {
            if node == self.cfg.node {
                self.loopback.push_back((ring.to_owned(), to, frame));
            } else if let Some(bytes) = self.ring_frame(ring, &RingMsg::Frame { to, frame }) {
                self.push_to(&node, bytes);
            }
        }
        for change in proposals {
            match change {
                ViewChange::Remove(m) => self.remove(ring.to_owned(), m, None),
                ViewChange::Erase(dead) => self.propose(
                    ring.to_owned(),
                    move |v| {
                        v.entry(dead)
                            .is_some_and(|e| !e.alive)
                            .then_some(ViewChange::Erase(dead))
                    },
                    async {},
                ),
                ViewChange::Join { .. } => {}
            }
        }
        if need_view {
            self.fetch(ring);
        }
    }

    /// Frames between members on this node never touch the network.
    fn run_loopback(&mut self) {
        while let Some((ring, to, frame)) = self.loopback.pop_front() {
            if let Some(local) = self.rings.get_mut(&ring).and_then(|r| r.get_mut(&to)) {
                local.member.handle_frame(frame);
                self.dirty.insert((ring.clone(), to));
                self.drive(&ring, to);
            }
        }
    }

    /// Flushes the members that took input this turn: one batch per neighbour per turn.
    fn flush_all(&mut self) {
        while !self.dirty.is_empty() {
            let dirty = std::mem::take(&mut self.dirty).into_iter().collect();
            self.each_member(dirty, Member::flush);
        }
        for node in std::mem::take(&mut self.woken) {
            if let Some(outbox) = self.peers.get(&node).and_then(|p| p.outbox.as_ref()) {
                outbox.wake();
            }
        }
    }
}

/// Writes batches from the outbox until the connection fails or a newer one
/// replaces it. A frame in pieces (a long one: a large message) goes a piece
/// at a time, and what reaches the outbox meanwhile goes between its pieces
/// but for its own ring's frames, which follow it: one large message holds
/// back neither the other rings nor the heartbeats that keep the connection
/// from counting as silent.
async fn write_loop(mut sender: Box<dyn FrameSender>, outbox: Arc<Handoff<Outgoing>>) {
    let mut batch = Vec::new();
    loop {
        let open = if sender.buffered() > 0 {
            outbox.try_take(&mut batch)
        } else {
            outbox.take(&mut batch).await
        };
        if !open {
            return;
        }
        for (lane, frame) in batch.drain(..) {
            if sender.feed_lane(lane, frame).is_err() {
                return;
            }
        }
        if sender.flush_some().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{FrameKind, Pub, StreamBatch};

    #[test]
    fn in_place_decoding_matches_the_wire_format() {
        let frame = Frame {
            view: 3,
            from: MemberId(1),
            kind: FrameKind::Activity,
            streams: vec![StreamBatch {
                publisher: MemberId(1),
                pubs: vec![Pub {
                    seq: 9,
                    view: 2,
                    payload: Bytes::from_static(b"payload"),
                }],
                ack: 8,
            }],
        };
        let body = encode_message(&RingMsg::Frame {
            to: MemberId(2),
            frame: frame.clone(),
        })
        .unwrap();
        let peer = PeerFrame::Ring {
            ring: "q".into(),
            body: Bytes::from(body),
        };
        let bytes = Bytes::from(encode_message(&peer).unwrap());
        let Ok(PeerFrameRef::Ring { ring, body }) = decode_borrowed::<PeerFrameRef<'_>>(&bytes)
        else {
            panic!("not a ring frame");
        };
        assert_eq!(ring, "q");
        let Ok(RingMsgRef::Frame { to, frame: got }) = decode_borrowed::<RingMsgRef<'_>>(body)
        else {
            panic!("not a member frame");
        };
        assert_eq!(to, MemberId(2));
        assert_eq!(got.into_frame(&bytes), frame);
        let body = encode_message(&RingMsg::Message {
            to: MemberId(2),
            from: MemberId(1),
            payload: Bytes::from_static(b"hello"),
        })
        .unwrap();
        let Ok(RingMsgRef::Message { to, from, payload }) =
            decode_borrowed::<RingMsgRef<'_>>(&body)
        else {
            panic!("not a point-to-point message");
        };
        assert_eq!(
            (to, from, payload),
            (MemberId(2), MemberId(1), &b"hello"[..])
        );
        let hb = encode_message(&PeerFrame::Heartbeat { seq: 5 }).unwrap();
        assert!(matches!(
            decode_borrowed::<PeerFrameRef<'_>>(&hb),
            Ok(PeerFrameRef::Heartbeat { .. })
        ));
        let md = encode_message(&PeerFrame::Metadata { body: Bytes::new() }).unwrap();
        assert!(decode_borrowed::<PeerFrameRef<'_>>(&md).is_err());
    }
}
