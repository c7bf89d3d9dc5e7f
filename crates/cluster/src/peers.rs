//! One connection per pair of nodes, carrying request/response RPCs
//! (multiplexed by id) and failure-detector heartbeats.
//!
//! Either node may dial. If both dial at once, both ends keep the connection
//! dialed by the node with the smaller name and close the other, so a pair
//! converges on one connection. Every call is bounded by a timeout; a
//! connection that breaks fails its calls in flight at once.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use warren_transport::{Connection, FrameReceiver, FrameSender, Listener, PeerAddr, Transport};
use warren_wire::{NodeName, PeerFrame, decode_message, encode_message};

use crate::rpc::{Request, Response};

/// Frames queued per connection before senders wait.
const LINK_QUEUE: usize = 1024;

/// The metadata store's frames inside [`PeerFrame::Metadata`].
#[derive(Debug, Serialize, Deserialize)]
enum RpcFrame {
    Request { id: u64, body: Request },
    Response { id: u64, body: Response },
}

/// Why a call to a peer failed (the request may or may not have been handled).
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum CallError {
    /// The request was not sent.
    #[error("cannot reach {peer}: {reason}")]
    Unreachable { peer: String, reason: String },
    /// The request was sent but the connection broke before the answer.
    #[error("lost the connection to {peer} before its answer")]
    Lost { peer: String },
    #[error("no answer from {peer} within {after:?}")]
    Timeout { peer: String, after: Duration },
}

/// Handles requests from peers.
pub(crate) type Handler =
    Arc<dyn Fn(NodeName, Request) -> Pin<Box<dyn Future<Output = Response> + Send>> + Send + Sync>;

/// The shortest silence after which a link is replaced (see [`Peers::stale`]).
const STALE_LINK_MIN: Duration = Duration::from_secs(5);

/// What a peer last said in a [`PeerFrame::Heard`].
#[derive(Debug, Clone, Copy)]
struct Echo {
    /// When it said it.
    at: Instant,
    /// How long it had not heard from this node then.
    silent_ms: Option<u64>,
    /// It had a live Raft leader (or led): it would refuse this node a vote.
    leader_live: bool,
    /// The latest of this node's asks it answered (0: none).
    answered: u64,
}

struct Link {
    serial: u64,
    /// When it was adopted.
    born: Instant,
    peer: NodeName,
    dialer: NodeName,
    tx: mpsc::Sender<Bytes>,
    pending: Mutex<BTreeMap<u64, oneshot::Sender<Response>>>,
    closed: AtomicBool,
    close_tx: watch::Sender<bool>,
}

impl Link {
    fn pending(&self) -> MutexGuard<'_, BTreeMap<u64, oneshot::Sender<Response>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.close_tx.send_replace(true);
        self.pending().clear();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

struct Inner {
    me: NodeName,
    transport: Arc<dyn Transport>,
    /// A link to a peer that nothing came from for this long is taken for
    /// dead when the peer dials again (see [`Peers::adopt`]).
    silent_after: Duration,
    links: Mutex<BTreeMap<NodeName, Arc<Link>>>,
    last_seen: Mutex<BTreeMap<NodeName, Instant>>,
    /// What each peer last said ([`PeerFrame::Heard`]).
    echo: Mutex<BTreeMap<NodeName, Echo>>,
    /// What this node's heartbeats say of its Raft leader (`leader_live`).
    leader_live: AtomicBool,
    /// The last `ask` this node put in a heartbeat (they count up).
    asks: AtomicU64,
    /// Peers whose address refused a connection since they were last heard.
    refused: Mutex<BTreeSet<NodeName>>,
    /// Peers that said they are stopping cleanly ([`PeerFrame::Leaving`]),
    /// until a new connection with them opens.
    leaving: Mutex<BTreeSet<NodeName>>,
    /// This node said it is stopping cleanly ([`Peers::say_leaving`]): a
    /// link opened after that says it first, so a peer that takes the new
    /// link (and forgets the old link's `Leaving`) still reads the stop as
    /// clean.
    stopping: AtomicBool,
    /// Peers whose link ended from their side (end of stream or an error)
    /// since the failure detector last asked: it probes them at once.
    lost: Mutex<BTreeSet<NodeName>>,
    /// Notified when a link closes or a dial is refused: the failure
    /// detector looks again at once.
    changed: Arc<tokio::sync::Notify>,
    handler: Mutex<Option<Handler>>,
    dialing: Mutex<BTreeMap<PeerAddr, Arc<tokio::sync::Mutex<()>>>>,
    next: AtomicU64,
    stopped: watch::Sender<bool>,
    serving: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// The node's connections to its peers; cheap to clone.
#[derive(Clone)]
pub(crate) struct Peers {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("me", &self.inner.me)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Peers {
    /// The connections of node `me` over `transport`; a link silent for
    /// `silent_after` gives way to a new connection from the same peer.
    pub(crate) fn new(me: NodeName, transport: Arc<dyn Transport>, silent_after: Duration) -> Self {
        let (stopped, _) = watch::channel(false);
        Self {
            inner: Arc::new(Inner {
                me,
                transport,
                silent_after,
                links: Mutex::new(BTreeMap::new()),
                last_seen: Mutex::new(BTreeMap::new()),
                echo: Mutex::new(BTreeMap::new()),
                leader_live: AtomicBool::new(false),
                asks: AtomicU64::new(0),
                refused: Mutex::new(BTreeSet::new()),
                leaving: Mutex::new(BTreeSet::new()),
                stopping: AtomicBool::new(false),
                lost: Mutex::new(BTreeSet::new()),
                changed: Arc::new(tokio::sync::Notify::new()),
                handler: Mutex::new(None),
                dialing: Mutex::new(BTreeMap::new()),
                next: AtomicU64::new(1),
                stopped,
                serving: Mutex::new(None),
            }),
        }
    }

    /// Sets the request handler (before serving).
    pub(crate) fn set_handler(&self, handler: Handler) {
        *lock(&self.inner.handler) = Some(handler);
    }

    /// Accepts peers on `listener` until [`Peers::stop`].
    pub(crate) fn serve(&self, mut listener: Box<dyn Listener>) {
        let this = self.clone();
        let mut stopped = self.inner.stopped.subscribe();
        let task = tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    c = listener.accept() => c,
                    _ = stopped.wait_for(|s| *s) => break,
                };
                match conn {
                    Ok(conn) => {
                        let peer = conn.peer_node().clone();
                        this.adopt(conn, peer);
                    }
                    Err(e) => {
                        tracing::debug!(node = %this.inner.me, error = %e, "listener closed");
                        break;
                    }
                }
            }
            drop(listener);
        });
        *lock(&self.inner.serving) = Some(task);
    }

    /// Closes every connection and stops accepting; returns once the
    /// listener is closed (so the address can be listened on again).
    pub(crate) async fn stop(&self) {
        self.inner.stopped.send_replace(true);
        let serving = lock(&self.inner.serving).take();
        if let Some(task) = serving {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        let links: Vec<Arc<Link>> = lock(&self.inner.links).values().cloned().collect();
        for l in links {
            l.close();
        }
        lock(&self.inner.links).clear();
    }

    pub(crate) fn is_stopped(&self) -> bool {
        *self.inner.stopped.borrow()
    }

    /// Whether `peer` said, less than `after` ago, that it had not heard
    /// from this node for `after` or longer (a one-way cut: this node hears
    /// it, it does not hear this node). Only what it said counts: a peer
    /// that never heard this node, never said, or said it too long ago (a
    /// previous run of it) is not counted deaf.
    pub(crate) fn deaf(&self, peer: &NodeName, after: Duration) -> bool {
        lock(&self.inner.echo).get(peer).is_some_and(|e| {
            e.at.elapsed() < after
                && e.silent_ms
                    .is_some_and(|ms| Duration::from_millis(ms) >= after)
        })
    }

    /// Whether `peer` said, less than `within` ago, that it has no live
    /// Raft leader: it would grant this node a vote (Raft's pre-vote,
    /// asked through the heartbeats).
    pub(crate) fn would_vote(&self, peer: &NodeName, within: Duration) -> bool {
        lock(&self.inner.echo)
            .get(peer)
            .is_some_and(|e| e.at.elapsed() < within && !e.leader_live)
    }

    /// Sets what this node's heartbeats say of its Raft leader.
    pub(crate) fn set_leader_live(&self, live: bool) {
        self.inner.leader_live.store(live, Ordering::Relaxed);
    }

    /// A new ask for [`heartbeat`](Self::heartbeat): a peer's answer to it
    /// ([`would_vote_since`](Self::would_vote_since)) was sent after this
    /// call.
    pub(crate) fn new_ask(&self) -> u64 {
        self.inner.asks.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether `peer` answered `ask` (or a later one) and would grant this
    /// node a vote: it heard this node after the ask was made, this node
    /// heard its answer, and its latest word is that it has no live Raft
    /// leader (a pre-vote, granted).
    pub(crate) fn would_vote_since(&self, peer: &NodeName, ask: u64) -> bool {
        lock(&self.inner.echo)
            .get(peer)
            .is_some_and(|e| e.answered >= ask && !e.leader_live)
    }

    /// The [`PeerFrame::Heard`] this node sends `peer` now, asking for an
    /// answer with `ask` (0: none) and answering `echo` (0: none).
    fn heard_frame(&self, peer: &NodeName, ask: u64, echo: u64) -> Result<Bytes, CallError> {
        let silent_ms = self
            .last_seen(peer)
            .map(|t| u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX));
        encode_message(&PeerFrame::Heard {
            silent_ms,
            leader_live: self.inner.leader_live.load(Ordering::Relaxed),
            ask,
            echo,
        })
        .map(Bytes::from)
        .map_err(|e| CallError::Unreachable {
            peer: peer.to_string(),
            reason: e.to_string(),
        })
    }

    /// When a frame last arrived from `peer`.
    pub(crate) fn last_seen(&self, peer: &NodeName) -> Option<Instant> {
        lock(&self.inner.last_seen).get(peer).copied()
    }

    fn touch(&self, peer: &NodeName) {
        lock(&self.inner.last_seen).insert(peer.clone(), Instant::now());
        lock(&self.inner.refused).remove(peer);
    }

    /// Whether `peer` said it is stopping cleanly (and no new connection
    /// with it opened since).
    pub(crate) fn leaving(&self, peer: &NodeName) -> bool {
        lock(&self.inner.leaving).contains(peer)
    }

    /// Tells every connected peer that this node is stopping cleanly,
    /// waiting at most `timeout` for the frames to be queued.
    pub(crate) async fn say_leaving(&self, timeout: Duration) {
        let Ok(bytes) = encode_message(&PeerFrame::Leaving) else {
            return;
        };
        let bytes = Bytes::from(bytes);
        // Set under the links' lock: a link `adopt` registers from now on
        // says `Leaving` itself.
        let links: Vec<Arc<Link>> = {
            let links = lock(&self.inner.links);
            self.inner.stopping.store(true, Ordering::SeqCst);
            links.values().cloned().collect()
        };
        let _ = tokio::time::timeout(timeout, async {
            for link in links {
                let _ = link.tx.send(bytes.clone()).await;
            }
        })
        .await;
    }

    /// Whether `peer`'s address refused a connection since it was last
    /// heard from: its process is gone (a SIGKILL shows here at once, long
    /// before any heartbeat timeout).
    pub(crate) fn refused(&self, peer: &NodeName) -> bool {
        lock(&self.inner.refused).contains(peer)
    }

    /// Notified when a link closes or a dial is refused.
    pub(crate) fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.inner.changed.clone()
    }

    /// The peers whose link ended from their side since the last call.
    pub(crate) fn take_lost(&self) -> BTreeSet<NodeName> {
        std::mem::take(&mut *lock(&self.inner.lost))
    }

    /// The serial of the open link to `peer`, if any.
    fn link_serial(&self, peer: &NodeName) -> Option<u64> {
        lock(&self.inner.links)
            .get(peer)
            .filter(|l| !l.is_closed())
            .map(|l| l.serial)
    }

    /// Whether an open link to `peer` exists.
    pub(crate) fn has_link(&self, peer: &NodeName) -> bool {
        self.link_serial(peer).is_some()
    }

    /// Registers a new connection; returns the link the pair should use.
    ///
    /// Of two open links the one dialed by the smaller name wins (both ends
    /// agree after simultaneous dials), unless nothing came from the peer
    /// for `silent_after`: a link that survived a partition can be dead at
    /// the other end while this end cannot tell (its writes stuck behind a
    /// full socket), and keeping it would refuse the peer's new connection
    /// over and over.
    fn adopt(&self, conn: Connection, dialer: NodeName) -> Arc<Link> {
        let peer = conn.peer_node().clone();
        let (tx, rx) = mpsc::channel(LINK_QUEUE);
        let (close_tx, close_rx) = watch::channel(false);
        let link = Arc::new(Link {
            serial: self.inner.next.fetch_add(1, Ordering::Relaxed),
            born: Instant::now(),
            peer: peer.clone(),
            dialer,
            tx,
            pending: Mutex::new(BTreeMap::new()),
            closed: AtomicBool::new(false),
            close_tx,
        });
        let (sender, receiver) = conn.split();
        let silent = self
            .last_seen(&peer)
            .is_some_and(|t| t.elapsed() >= self.inner.silent_after);
        let winner = {
            let mut links = lock(&self.inner.links);
            let keep_new = match links.get(&peer) {
                None => true,
                Some(old) if old.is_closed() || silent => true,
                Some(old) => {
                    let preferred = std::cmp::min(&self.inner.me, &peer);
                    if old.dialer == link.dialer {
                        true
                    } else {
                        &link.dialer == preferred
                    }
                }
            };
            if keep_new {
                lock(&self.inner.leaving).remove(&peer);
                if self.inner.stopping.load(Ordering::SeqCst)
                    && let Ok(bytes) = encode_message(&PeerFrame::Leaving)
                {
                    // The link's queue is new and empty: this frame goes first.
                    let _ = link.tx.try_send(Bytes::from(bytes));
                }
                if let Some(old) = links.insert(peer.clone(), link.clone())
                    && !old.is_closed()
                {
                    tracing::debug!(node = %self.inner.me, peer = %peer, "replacing duplicate connection");
                    old.close();
                }
                link.clone()
            } else {
                links.get(&peer).cloned().unwrap_or_else(|| link.clone())
            }
        };
        if Arc::ptr_eq(&winner, &link) {
            // A connection refused in favour of a silent link is no sign of life.
            self.touch(&peer);
        } else {
            tracing::debug!(node = %self.inner.me, peer = %peer, "dropping duplicate connection");
            link.close();
        }
        tokio::spawn(write_loop(link.clone(), sender, rx, close_rx.clone()));
        tokio::spawn(self.clone().read_loop(link, receiver, close_rx));
        winner
    }

    async fn read_loop(
        self,
        link: Arc<Link>,
        mut receiver: Box<dyn FrameReceiver>,
        mut close_rx: watch::Receiver<bool>,
    ) {
        let mut batch = Vec::new();
        let mut lost = false;
        loop {
            batch.clear();
            let got = tokio::select! {
                r = receiver.recv_batch(&mut batch, 64) => r,
                _ = close_rx.wait_for(|c| *c) => break,
            };
            match got {
                Ok(0) => {
                    lost = true;
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(node = %self.inner.me, peer = %link.peer, error = %e, "connection lost");
                    lost = true;
                    break;
                }
            }
            self.touch(&link.peer);
            for frame in batch.drain(..) {
                self.on_frame(&link, &frame);
            }
        }
        link.close();
        let mut links = lock(&self.inner.links);
        if links
            .get(&link.peer)
            .is_some_and(|l| l.serial == link.serial)
        {
            links.remove(&link.peer);
            if lost {
                lock(&self.inner.lost).insert(link.peer.clone());
            }
            self.inner.changed.notify_one();
        }
    }

    fn on_frame(&self, link: &Arc<Link>, frame: &[u8]) {
        let body = match decode_message::<PeerFrame>(frame) {
            Ok(PeerFrame::Metadata { body }) => body,
            Ok(PeerFrame::Heard {
                silent_ms,
                leader_live,
                ask,
                echo,
            }) => {
                {
                    let mut echoes = lock(&self.inner.echo);
                    let answered = echoes.get(&link.peer).map_or(0, |e| e.answered).max(echo);
                    let e = Echo {
                        at: Instant::now(),
                        silent_ms,
                        leader_live,
                        answered,
                    };
                    echoes.insert(link.peer.clone(), e);
                }
                if ask != 0
                    && let Ok(bytes) = self.heard_frame(&link.peer, 0, ask)
                {
                    // A full queue means the link is busy: its frames say
                    // the same soon enough.
                    let _ = link.tx.try_send(bytes);
                }
                return;
            }
            Ok(PeerFrame::Leaving) => {
                lock(&self.inner.leaving).insert(link.peer.clone());
                return;
            }
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(node = %self.inner.me, peer = %link.peer, error = %e, "malformed peer frame");
                return;
            }
        };
        match decode_message::<RpcFrame>(&body) {
            Ok(RpcFrame::Response { id, body }) => {
                if let Some(tx) = link.pending().remove(&id) {
                    let _ = tx.send(body);
                }
            }
            Ok(RpcFrame::Request { id, body }) => {
                let handler = lock(&self.inner.handler).clone();
                let Some(handler) = handler else { return };
                let link = link.clone();
                let me = self.inner.me.clone();
                tokio::spawn(async move {
                    let resp = handler(link.peer.clone(), body).await;
                    match encode_frame(&RpcFrame::Response { id, body: resp }) {
                        Ok(bytes) => {
                            let _ = link.tx.send(bytes).await;
                        }
                        Err(e) => {
                            tracing::error!(node = %me, error = %e, "cannot encode a response")
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!(node = %self.inner.me, peer = %link.peer, error = %e, "malformed metadata frame");
            }
        }
    }

    /// The live link to `peer`, dialing `addr` if there is none.
    async fn link(&self, peer: Option<&NodeName>, addr: &PeerAddr) -> Result<Arc<Link>, CallError> {
        let unreachable = |reason: String| CallError::Unreachable {
            peer: peer.map_or_else(|| addr.to_string(), ToString::to_string),
            reason,
        };
        if self.is_stopped() {
            return Err(unreachable("this node is stopping".into()));
        }
        if let Some(p) = peer {
            let open = lock(&self.inner.links)
                .get(p)
                .filter(|l| !l.is_closed())
                .cloned();
            if let Some(l) = open {
                if !self.stale(&l) {
                    return Ok(l);
                }
                // Nothing came over it for long: after a cut, a TCP
                // connection can stay open but carry nothing for tens of
                // seconds of retransmission back-off, while a new one gets
                // through as soon as the network does. Dial afresh (the dial
                // fails fast while the cut lasts).
                tracing::debug!(node = %self.inner.me, peer = %p, "replacing a silent connection");
                self.drop_link_if(p, l.serial);
            }
        }
        // One dial at a time per address (a dead peer never holds up the others).
        let dial_lock = lock(&self.inner.dialing)
            .entry(addr.clone())
            .or_default()
            .clone();
        let _guard = dial_lock.lock().await;
        if let Some(p) = peer
            && let Some(l) = lock(&self.inner.links).get(p)
            && !l.is_closed()
        {
            return Ok(l.clone());
        }
        let heard_before = peer.and_then(|p| self.last_seen(p));
        let conn = match self.inner.transport.connect(addr).await {
            Ok(c) => c,
            Err(e) => {
                // A refusal counts unless the peer was heard while this
                // dial was out: a dial that began before a restarted peer
                // listened says nothing of the process that is talking now.
                if let Some(p) = peer
                    && e.is_refused()
                    && self.last_seen(p) == heard_before
                    && lock(&self.inner.refused).insert(p.clone())
                {
                    self.inner.changed.notify_one();
                }
                return Err(unreachable(e.to_string()));
            }
        };
        if let Some(p) = peer
            && conn.peer_node() != p
        {
            return Err(unreachable(format!(
                "{addr} is node {}, not {p}",
                conn.peer_node()
            )));
        }
        if self.is_stopped() {
            return Err(unreachable("this node is stopping".into()));
        }
        Ok(self.adopt(conn, self.inner.me.clone()))
    }

    /// Calls `peer` (dialing `addr` if needed) and waits at most `timeout`.
    /// With `peer: None` the node at `addr` answers, whoever it is.
    pub(crate) async fn call(
        &self,
        peer: Option<&NodeName>,
        addr: &PeerAddr,
        req: Request,
        timeout: Duration,
    ) -> Result<Response, CallError> {
        let who = peer.map_or_else(|| addr.to_string(), ToString::to_string);
        let attempt = async {
            let link = self.link(peer, addr).await?;
            let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            link.pending().insert(id, tx);
            let guard = PendingGuard {
                link: link.clone(),
                id,
            };
            let bytes = encode_frame(&RpcFrame::Request { id, body: req }).map_err(|e| {
                CallError::Unreachable {
                    peer: who.clone(),
                    reason: e.to_string(),
                }
            })?;
            if link.is_closed() || link.tx.send(bytes).await.is_err() {
                return Err(CallError::Unreachable {
                    peer: who.clone(),
                    reason: "connection closed".into(),
                });
            }
            let resp = rx.await.map_err(|_| CallError::Lost { peer: who.clone() });
            drop(guard);
            resp
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Timeout {
                peer: who.clone(),
                after: timeout,
            }),
        }
    }

    /// Asks the transport whether `peer`'s address refuses (its process is
    /// gone) and records it like a refused dial; true if it did.
    pub(crate) async fn probe(&self, peer: &NodeName, addr: &PeerAddr) -> bool {
        let before = self.link_serial(peer);
        if !self.inner.transport.refuses(addr).await {
            return false;
        }
        if self.link_serial(peer) != before {
            // A new connection came from the peer meanwhile: it is alive
            // (restarted, perhaps at another address than the one probed).
            return false;
        }
        if lock(&self.inner.refused).insert(peer.clone()) {
            // Calls waiting on the dead connection fail now, and new ones dial.
            self.drop_link(peer);
            self.inner.changed.notify_one();
        }
        true
    }

    /// Dials `peer` unless a link is open, waiting at most `timeout`; a
    /// refused dial is recorded (see [`refused`](Self::refused)). Returns
    /// whether a link is open.
    pub(crate) async fn reach(&self, peer: &NodeName, addr: &PeerAddr, timeout: Duration) -> bool {
        matches!(
            tokio::time::timeout(timeout, self.link(Some(peer), addr)).await,
            Ok(Ok(_))
        )
    }

    /// Sends a heartbeat to `peer` (dialing if needed, bounded by
    /// `timeout`): [`PeerFrame::Heard`], how long this node has not heard it
    /// and whether it has a live Raft leader; with a non-zero `ask`
    /// ([`new_ask`](Self::new_ask)), the peer answers with its own at once.
    pub(crate) async fn heartbeat(
        &self,
        peer: &NodeName,
        addr: &PeerAddr,
        timeout: Duration,
        ask: u64,
    ) -> Result<(), CallError> {
        let send = async {
            let link = self.link(Some(peer), addr).await?;
            let bytes = self.heard_frame(peer, ask, 0)?;
            link.tx
                .send(bytes)
                .await
                .map_err(|_| CallError::Unreachable {
                    peer: peer.to_string(),
                    reason: "connection closed".into(),
                })
        };
        tokio::time::timeout(timeout, send)
            .await
            .unwrap_or_else(|_| {
                Err(CallError::Timeout {
                    peer: peer.to_string(),
                    after: timeout,
                })
            })
    }

    /// Whether `link` has carried nothing from its peer for twice
    /// `silent_after`, 5 s at least (and is at least that old): long past a
    /// peer that is only slow or busy (its calls in flight fail with the
    /// link), while a link that lived through a cut is replaced at the first
    /// call after the heal.
    fn stale(&self, link: &Link) -> bool {
        let after = (2 * self.inner.silent_after).max(STALE_LINK_MIN);
        link.born.elapsed() >= after
            && self
                .last_seen(&link.peer)
                .is_none_or(|t| t.elapsed() >= after)
    }

    /// Closes the connection to `peer` if it is still the one numbered `serial`.
    fn drop_link_if(&self, peer: &NodeName, serial: u64) {
        let mut links = lock(&self.inner.links);
        if links.get(peer).is_some_and(|l| l.serial == serial)
            && let Some(l) = links.remove(peer)
        {
            l.close();
        }
    }

    /// Closes the connection to `peer`, if any.
    pub(crate) fn drop_link(&self, peer: &NodeName) {
        if let Some(l) = lock(&self.inner.links).remove(peer) {
            l.close();
        }
    }
}

struct PendingGuard {
    link: Arc<Link>,
    id: u64,
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.link.pending().remove(&self.id);
    }
}

fn encode_frame(frame: &RpcFrame) -> Result<Bytes, warren_wire::WireError> {
    let body = encode_message(frame)?;
    encode_message(&PeerFrame::Metadata {
        body: Bytes::from(body),
    })
    .map(Bytes::from)
}

async fn write_loop(
    link: Arc<Link>,
    mut sender: Box<dyn FrameSender>,
    mut rx: mpsc::Receiver<Bytes>,
    mut close_rx: watch::Receiver<bool>,
) {
    // Frames queued before a close still go out first (`biased`): a
    // stopping node's `Leaving` is queued just before its links close. A
    // closed link takes no new frames, so the queue soon runs dry.
    loop {
        let first = tokio::select! {
            biased;
            f = rx.recv() => f,
            _ = close_rx.wait_for(|c| *c) => None,
        };
        let Some(first) = first else { break };
        let mut ok = sender.feed(first).is_ok();
        while ok {
            match rx.try_recv() {
                Ok(f) => ok = sender.feed(f).is_ok(),
                Err(_) => break,
            }
        }
        if !ok {
            break;
        }
        let flushed = tokio::select! {
            biased;
            r = sender.flush() => r.is_ok(),
            _ = close_rx.wait_for(|c| *c) => false,
        };
        if !flushed {
            break;
        }
    }
    link.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), sender.close()).await;
}
