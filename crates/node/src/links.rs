//! The shell of forwarding between brokers: carries [`LinkMsg`]s over the
//! peer transport (any of TCP, QUIC), one connection per direction and
//! node pair, and tells the broker when a node goes down.
//!
//! Outgoing messages are taken from the broker in batches
//! ([`Broker::take_link_out`]), encoded with postcard, fed to the node's
//! connection and flushed once per batch. Incoming batches go to
//! [`Broker::link_input`] under one lock. A node the cluster's failure
//! detector reports down, or whose connection fails, is reported with
//! [`Broker::link_down`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use tokio::sync::Notify;
use warren_broker::LinkMsg;
use warren_cluster::{Cluster, NodeEvent};
use warren_transport::{FrameSender, PeerAddr, Transport};

use crate::{Shared, lock, now_ms};

/// This process's incarnation: differs between two starts of a node.
fn incarnation() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ (u64::from(std::process::id()) << 32)
}

/// Starts the forwarding listener on the node's peer port (the links' view
/// of it, `transport`), the sender and the failure watcher.
pub(crate) async fn start(
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
) -> anyhow::Result<()> {
    // Before the listener: a link accepted at once feeds the broker work
    // whose output must wake the sender.
    let notify = Arc::new(Notify::new());
    {
        let n = notify.clone();
        lock(&broker).set_link_waker(Arc::new(move || n.notify_one()));
    }
    let mut listener = transport
        .listen(cluster.peer_addr())
        .await
        .context("listening for forwarded queue work")?;
    let addr = listener.local_addr();
    let me = Me {
        incarnation: incarnation(),
        heard: Arc::new(Mutex::new(HashMap::new())),
        sent: Arc::new(Mutex::new(HashMap::new())),
        reached: Arc::new(Mutex::new(HashMap::new())),
        given_up: Arc::new(Mutex::new(HashMap::new())),
        gave_up_heard: Arc::new(Mutex::new(HashMap::new())),
        accepted: Arc::new(Mutex::new(HashMap::new())),
    };
    {
        let (broker, me) = (broker.clone(), me.clone());
        tokio::spawn(async move {
            while let Ok(conn) = listener.accept().await {
                let peer = conn.peer_node().to_string();
                // Before its welcome: from now on the node's older link
                // connections carry only what it has given up.
                let generation = me.accept(&peer);
                let (mut tx, rx) = conn.split();
                let welcome = LinkMsg::Welcome {
                    incarnation: me.incarnation,
                };
                let (broker, me) = (broker.clone(), me.clone());
                tokio::spawn(async move {
                    if let Ok(v) = postcard::to_allocvec(&welcome)
                        && tx.feed(Bytes::from(v)).is_ok()
                    {
                        let _ = tokio::time::timeout(WELCOME_WAIT, tx.flush()).await;
                    }
                    receive(peer, generation, rx, broker, me).await;
                    // Held while the link lasts: on some transports (QUIC)
                    // dropping it ends the stream, which the dialer takes
                    // for the end of the link.
                    drop(tx);
                });
            }
        });
    }
    let (reset_tx, reset_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(send(
        cluster.clone(),
        transport,
        broker.clone(),
        notify.clone(),
        reset_rx,
        me.clone(),
    ));
    tokio::spawn(announce_alarms(cluster.clone(), broker.clone()));
    tokio::spawn(watch_down(cluster, broker, reset_tx, notify, me));
    tracing::info!(%addr, "forwarding listener up");
    Ok(())
}

/// Tells the other nodes this node's resource alarms: at once when they
/// change, and every few seconds while one is set (the others forget an
/// alarm that is not repeated).
async fn announce_alarms(cluster: Cluster, broker: Shared) {
    const REPEAT: std::time::Duration = std::time::Duration::from_secs(3);
    let mut iv = tokio::time::interval(std::time::Duration::from_millis(250));
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent = warren_broker::AlarmSet::default();
    let mut last = tokio::time::Instant::now();
    loop {
        iv.tick().await;
        let now = lock(&broker).local_alarms();
        if now == sent && !(now.any() && last.elapsed() >= REPEAT) {
            continue;
        }
        let me = cluster.node().as_str().to_owned();
        let others: Vec<String> = cluster
            .local()
            .nodes
            .keys()
            .filter(|n| **n != me)
            .cloned()
            .collect();
        lock(&broker).announce_alarms(&others);
        sent = now;
        last = tokio::time::Instant::now();
    }
}

/// Per node: a link session, (its sender's incarnation, session number).
type Sessions = Arc<Mutex<HashMap<String, (u64, u64)>>>;

/// This node's side of the link sessions, shared by its senders and
/// receivers.
#[derive(Clone)]
struct Me {
    /// This process's incarnation.
    incarnation: u64,
    /// The last session heard from each node (its link into this node).
    heard: Sessions,
    /// This node's current session to each node.
    sent: Sessions,
    /// The incarnation of each node that this node's current session to it
    /// reaches (its `Welcome`), if it answered.
    reached: Arc<Mutex<HashMap<String, u64>>>,
    /// How often this node gave up its link state with each node (the
    /// cluster reported the node down, or what this node sent it was lost:
    /// see [`Me::give_up`]). A link connection from a node accepted before
    /// carries what one side has given up (deliveries the node requeued,
    /// once a partition heals and TCP retransmits them; publishes whose
    /// confirms this node dropped), and is closed unread: its end tells
    /// the node to give up its side too.
    given_up: Arc<Mutex<HashMap<String, u64>>>,
    /// The session heard from each node when this node last gave up its
    /// link state with it (`(0, 0)`: none yet), said in each `Hello`: the
    /// node's work sent on a later session of its own came after the give-up
    /// and stands.
    gave_up_heard: Sessions,
    /// How many link connections from each node were accepted: a node
    /// dials a new one only after giving up the old (its forwarded work
    /// failed, its consumers asked for again), so what an older one still
    /// carries is stale, as after a down report.
    accepted: Arc<Mutex<HashMap<String, u64>>>,
}

impl Me {
    /// Counts a link connection accepted from `node`; returns its number.
    fn accept(&self, node: &str) -> u64 {
        let mut a = self
            .accepted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = a.entry(node.to_owned()).or_default();
        *n += 1;
        *n
    }

    fn accepted(&self, node: &str) -> u64 {
        Self::count(&self.accepted, node)
    }

    fn given_up(&self, node: &str) -> u64 {
        Self::count(&self.given_up, node)
    }

    /// Gives up this node's link state with `node` (its work here and
    /// this node's work there: [`Broker::link_down`](warren_broker::Broker::link_down)),
    /// and closes the link connections from `node` accepted so far, so
    /// that `node` gives up its side as well: otherwise it would wait for
    /// ever for confirms and deliveries that this node dropped.
    fn give_up(&self, b: &mut warren_broker::Broker, node: &str) {
        *self
            .given_up
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(node.to_owned())
            .or_default() += 1;
        // Under the broker's lock, as link input is fed: whatever came on a
        // session heard after this was fed after this give-up.
        let heard = Self::get(&self.heard, node).unwrap_or((0, 0));
        self.gave_up_heard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(node.to_owned(), heard);
        b.link_down(node, now_ms());
    }

    fn count(map: &Mutex<HashMap<String, u64>>, node: &str) -> u64 {
        map.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(node)
            .copied()
            .unwrap_or(0)
    }

    fn get(map: &Sessions, node: &str) -> Option<(u64, u64)> {
        map.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(node)
            .copied()
    }
}

/// How often a quiet link connection looks whether this node gave up its
/// state with the node since it was accepted (then it ends: see
/// `Me::given_up`).
const STALE_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// Forwarded publishes (and gets) held back at most, per link, while this
/// node's mirrored queues catch up; beyond it the link is not read. The
/// sender keeps fewer of its publishes in flight than this
/// ([`warren_broker::LINK_PUBLISHES_MAX`]), so that the acks behind them
/// keep coming.
const HELD_MAX: usize = 4096;

/// Whether `m` must wait behind held publishes: publishes wait for flow
/// control, and a get or a count must see the publishes sent before it.
pub(crate) fn held_back(m: &LinkMsg) -> bool {
    matches!(
        m,
        LinkMsg::Publish { .. } | LinkMsg::Get { .. } | LinkMsg::Count { .. }
    )
}

/// Whether `m`, from node `from`, publishes into a queue whose ring or
/// consumers fall behind, or the link back to `from` is (it waits, as this
/// node's own publishers into that queue do).
fn waits(b: &warren_broker::Broker, from: &str, m: &LinkMsg) -> bool {
    matches!(m, LinkMsg::Publish { vhost, queue, .. } if b.publish_waits(from, vhost, queue))
}

async fn receive(
    peer: String,
    generation: u64,
    mut rx: Box<dyn warren_transport::FrameReceiver>,
    broker: Shared,
    me: Me,
) {
    let mut frames = Vec::new();
    let mut greeted = false;
    let given_up = me.given_up(&peer);
    // Asked with the broker's lock held before link input, as a give-up
    // is counted; and every `STALE_CHECK` while nothing comes.
    let stale = || {
        if me.given_up(&peer) != given_up {
            tracing::warn!(%peer, "closing a link connection from before this node last gave up its link state with the node (the node gives up its side when it ends)");
            return true;
        }
        if me.accepted(&peer) != generation {
            tracing::info!(%peer, "closing a link connection the node replaced (what it still carries, the node has given up)");
            return true;
        }
        false
    };
    // Flow control: a forwarded publish into a queue whose ring or
    // consumers are behind waits, and every later publish of this link
    // behind it, in order (the sender's own publishers then wait too, once
    // this link stops being read). Acks, consumes and cancels are not held back:
    // consumers on the other node keep moving while publishers wait.
    let mut held: std::collections::VecDeque<LinkMsg> = std::collections::VecDeque::new();
    // One timer for the connection's life, not one per batch read.
    let mut stale_check = tokio::time::interval(STALE_CHECK);
    stale_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if !held.is_empty() {
            let mut b = lock(&broker);
            let mut msgs = Vec::new();
            while let Some(m) = held.front() {
                if waits(&b, &peer, m) {
                    break;
                }
                msgs.extend(held.pop_front());
            }
            if !msgs.is_empty() {
                if stale() {
                    return;
                }
                if held.is_empty() {
                    tracing::debug!(%peer, "forwarded publishes no longer held back");
                }
                b.link_input(&peer, msgs, now_ms());
            }
        }
        frames.clear();
        // Frame receivers are cancel-safe: a frame is either whole in
        // `frames` or still in the receiver's buffer.
        let got = tokio::select! {
            r = rx.recv_batch(&mut frames, 1024), if held.len() < HELD_MAX => r,
            () = tokio::time::sleep(std::time::Duration::from_millis(2)), if !held.is_empty() => {
                continue;
            }
            _ = stale_check.tick() => {
                if stale() {
                    return;
                }
                continue;
            }
        };
        match got {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut msgs = Vec::with_capacity(frames.len());
        for f in &frames {
            match postcard::from_bytes::<LinkMsg>(f) {
                Ok(LinkMsg::Hello {
                    incarnation,
                    session,
                    seen,
                    gave_up,
                }) if !greeted => {
                    greeted = true;
                    let before = me
                        .heard
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(peer.clone(), (incarnation, session));
                    if before.is_some_and(|b| b != (incarnation, session)) {
                        // A restarted node that got this node's current
                        // session has whatever was forwarded to it on it
                        // (what went to its previous run failed with the
                        // session that carried it); else all of it is lost.
                        let restarted = before.is_some_and(|b| b.0 != incarnation);
                        let ours = Me::get(&me.sent, &peer).map(|(_, s)| (me.incarnation, s));
                        // Or this node's current session was answered by
                        // the new run: its hello just came first.
                        let reaches_new_run = me
                            .reached
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .get(&peer)
                            == Some(&incarnation);
                        // Or it gave up before it heard this node's current
                        // session: what went on that session reached it after.
                        let gave_up_before_ours = gave_up
                            .zip(ours)
                            .is_some_and(|(g, (inc, s))| g.0 != inc || g.1 < s);
                        let mut b = lock(&broker);
                        if restarted && ((seen.is_some() && seen == ours) || reaches_new_run) {
                            tracing::info!(%peer, "node restarted: dropping its previous run's link state");
                            b.link_peer_restarted(&peer);
                        } else if !restarted && gave_up_before_ours {
                            tracing::info!(%peer, "node reconnected: dropping its link state from before this node's current session");
                            b.link_peer_gave_up(&peer);
                        } else {
                            tracing::info!(%peer, "node reconnected: dropping the old link's state");
                            b.link_replaced(&peer, now_ms());
                        }
                        // It dropped its side too: this node's consumers of
                        // its queues ask again.
                        b.resubscribe(&peer);
                    } else if before.is_none() {
                        // The first session since this node started: the
                        // peer may have dropped consumers this node sent it
                        // before then (it had failed to dial this node back
                        // while it still thought it down). Asking again is
                        // harmless: a master takes a known consumer once.
                        lock(&broker).resubscribe(&peer);
                    }
                }
                Ok(m) if greeted => msgs.push(m),
                Ok(_) => {
                    tracing::warn!(%peer, "a link connection did not start with a hello; closing it");
                    return;
                }
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "dropping a malformed link message; closing the link");
                    return;
                }
            }
        }
        let mut b = lock(&broker);
        let was_holding = !held.is_empty();
        let now: Vec<LinkMsg> = msgs
            .into_iter()
            .filter_map(|m| {
                if held_back(&m) && (!held.is_empty() || waits(&b, &peer, &m)) {
                    held.push_back(m);
                    None
                } else {
                    Some(m)
                }
            })
            .collect();
        if !was_holding && let Some(LinkMsg::Publish { queue, .. }) = held.front() {
            tracing::debug!(%peer, %queue, "forwarded publishes held back: their queue's ring or consumers, or the link back, are behind");
        }
        if !now.is_empty() {
            if stale() {
                return;
            }
            b.link_input(&peer, now, now_ms());
        }
    }
}

/// Hands each node's batches to that node's sender task, so that a slow or
/// dead node (a QUIC connect waits for its timeout) holds up no other.
async fn send(
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
    notify: Arc<Notify>,
    mut resets: tokio::sync::mpsc::UnboundedReceiver<String>,
    me: Me,
) {
    let sessions = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut nodes: HashMap<String, tokio::sync::mpsc::UnboundedSender<Option<Vec<LinkMsg>>>> =
        HashMap::new();
    loop {
        notify.notified().await;
        let mut batches: Vec<(String, Option<Vec<LinkMsg>>)> = Vec::new();
        while let Ok(node) = resets.try_recv() {
            batches.push((node, None));
        }
        batches.extend(
            lock(&broker)
                .take_link_out()
                .into_iter()
                .map(|(n, m)| (n, Some(m))),
        );
        for (node, batch) in batches {
            let tx = nodes.entry(node.clone()).or_insert_with(|| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let link = NodeLink {
                    node: node.clone(),
                    cluster: cluster.clone(),
                    transport: transport.clone(),
                    broker: broker.clone(),
                    me: me.clone(),
                    sessions: sessions.clone(),
                };
                tokio::spawn(link.run(rx));
                tx
            });
            let _ = tx.send(batch);
        }
    }
}

/// How soon a lost link is dialed again when no work waits for it.
const REDIAL: std::time::Duration = std::time::Duration::from_secs(1);

/// The sending side of the link to one node.
struct NodeLink {
    node: String,
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
    me: Me,
    sessions: Arc<std::sync::atomic::AtomicU64>,
}

impl NodeLink {
    /// Sends each batch in order (`None`: drop the connection, the node went
    /// down); a batch that cannot be sent fails the node's forwarded work.
    async fn run(self, mut rx: tokio::sync::mpsc::UnboundedReceiver<Option<Vec<LinkMsg>>>) {
        let node = &self.node;
        let mut conn: Option<LinkConn> = None;
        // The cluster's reports about this node: down since a Down report
        // and until an Up one (a node never reported down is dialed).
        let mut events = self.cluster.subscribe();
        let mut down = false;
        // Whether the last attempt failed: an outage is logged once, at
        // its start and at its end, not once per batch.
        let mut failing = false;
        // Whether a connection was made or failed before: after losing it
        // (or failing to make it), the link is dialed again without waiting
        // for work, and this node's consumers of the node's queues are
        // asked for again on the new connection (the other node dropped
        // them with the old one, or never got them).
        let mut dialed = false;
        loop {
            let redial = conn.is_none() && dialed;
            let batch = tokio::select! {
                b = rx.recv() => match b {
                    Some(b) => b,
                    None => return,
                },
                () = broken(&mut conn) => {
                    // Given up by the transport (data unacknowledged too
                    // long: a lossy or cut network) or closed by the node
                    // (it is stopping): what it carried is lost. A new
                    // connection is dialed after `REDIAL`, unless the node
                    // is reported down meanwhile.
                    tracing::info!(%node, "forwarding link ended");
                    conn = None;
                    self.me.give_up(&mut lock(&self.broker), node);
                    continue;
                }
                () = tokio::time::sleep(REDIAL), if redial && !down => Some(Vec::new()),
                e = events.recv(), if redial && down => {
                    match e {
                        Ok(NodeEvent::Up(n)) if n.as_str() == node => down = false,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                        _ => {}
                    }
                    continue;
                }
            };
            down = latest_report(&mut events, node).unwrap_or(down);
            let Some(msgs) = batch else {
                conn = None;
                continue;
            };
            let addr = self
                .cluster
                .local()
                .nodes
                .get(node)
                .and_then(|n| n.link_addr.clone());
            // The node restarted elsewhere: its old link is gone.
            if conn
                .as_ref()
                .is_some_and(|c| Some(&c.addr) != addr.as_ref())
            {
                conn = None;
            }
            if conn.is_none() {
                // A dial is abandoned when the cluster reports the node
                // down (a QUIC dial to a dead node waits for its handshake
                // timeout, holding forwarded work all along).
                // A node reported down is not dialed, and a dial is
                // abandoned when it is (a QUIC dial to a dead node waits
                // for its handshake timeout, holding forwarded work).
                let target = addr.clone().map(PeerAddr::new);
                let c = match &target {
                    Some(a) if !down => tokio::select! {
                        c = self.transport.connect(a) => c.ok(),
                        () = reported_down(&mut events, node) => {
                            down = true;
                            None
                        }
                    },
                    _ => None,
                };
                match c {
                    Some(c) => {
                        let (mut tx, mut rx) = c.split();
                        let reached = welcome(rx.as_mut()).await;
                        {
                            let mut r = self
                                .me
                                .reached
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner);
                            match reached {
                                Some(inc) => r.insert(node.clone(), inc),
                                None => r.remove(node),
                            };
                        }
                        let session = self
                            .sessions
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                            + 1;
                        self.me
                            .sent
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .insert(node.clone(), (self.me.incarnation, session));
                        let hello = LinkMsg::Hello {
                            incarnation: self.me.incarnation,
                            session,
                            seen: Me::get(&self.me.heard, node),
                            gave_up: Me::get(&self.me.gave_up_heard, node),
                        };
                        if let Ok(v) = postcard::to_allocvec(&hello) {
                            let _ = tx.feed(Bytes::from(v));
                        }
                        conn = Some(LinkConn {
                            addr: addr.clone().unwrap_or_default(),
                            tx,
                            rx,
                        });
                        if std::mem::take(&mut failing) {
                            tracing::info!(%node, "forwarding link to node restored");
                        }
                        // The node drops this node's link state on the new
                        // session: ask again for this node's consumers.
                        if std::mem::replace(&mut dialed, true) {
                            lock(&self.broker).resubscribe(node);
                        }
                    }
                    None => {
                        if failing {
                            tracing::debug!(%node, "cannot reach node for forwarded queue work");
                        } else {
                            tracing::warn!(%node, "cannot reach node for forwarded queue work; failing it until the link is back");
                            failing = true;
                        }
                        // This node's consumers of the node's queues were
                        // asked for in what is lost: once the link is back
                        // (dialed again without waiting for work), they are
                        // asked for again, as after a lost connection.
                        dialed = true;
                        // What queued meanwhile is lost with this attempt.
                        let mut lost = msgs.len();
                        while let Ok(b) = rx.try_recv() {
                            lost += b.map_or(0, |b| b.len());
                        }
                        let mut b = lock(&self.broker);
                        b.link_sent(node, lost);
                        self.me.give_up(&mut b, node);
                        continue;
                    }
                }
            }
            let Some(LinkConn { tx, .. }) = conn.as_mut() else {
                lock(&self.broker).link_sent(node, msgs.len());
                continue;
            };
            let mut ok = true;
            for m in &msgs {
                match postcard::to_allocvec(m) {
                    Ok(v) => {
                        if tx.feed(Bytes::from(v)).is_err() {
                            ok = false;
                            break;
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "encoding a link message failed"),
                }
            }
            let flushed = ok
                && tokio::select! {
                    r = tx.flush() => r.is_ok(),
                    () = reported_down(&mut events, node) => {
                        down = true;
                        false
                    }
                };
            let mut b = lock(&self.broker);
            b.link_sent(node, msgs.len());
            if !flushed {
                tracing::warn!(%node, "forwarding link broke");
                conn = None;
                self.me.give_up(&mut b, node);
            }
        }
    }
}

/// A link connection this node dialed.
struct LinkConn {
    /// The address dialed.
    addr: String,
    tx: Box<dyn FrameSender>,
    /// Nothing comes after the `Welcome`: read only to see the end.
    rx: Box<dyn warren_transport::FrameReceiver>,
}

/// Resolves when the link connection in `conn` is down; never while there
/// is none.
async fn broken(conn: &mut Option<LinkConn>) {
    let Some(c) = conn else {
        return std::future::pending().await;
    };
    while let Ok(Some(_)) = c.rx.recv().await {}
}

/// How long a dialer waits for the acceptor's `Welcome` (and an acceptor
/// tries to send it).
const WELCOME_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The incarnation a new link connection's acceptor names in its
/// `Welcome`, if it comes within [`WELCOME_WAIT`].
async fn welcome(rx: &mut dyn warren_transport::FrameReceiver) -> Option<u64> {
    let frame = tokio::time::timeout(WELCOME_WAIT, rx.recv())
        .await
        .ok()?
        .ok()??;
    match postcard::from_bytes::<LinkMsg>(&frame) {
        Ok(LinkMsg::Welcome { incarnation }) => Some(incarnation),
        _ => None,
    }
}

/// The last Down (`Some(true)`) or Up (`Some(false)`) report about `node`
/// waiting in `events`, if any.
fn latest_report(
    events: &mut tokio::sync::broadcast::Receiver<NodeEvent>,
    node: &str,
) -> Option<bool> {
    let mut last = None;
    loop {
        match events.try_recv() {
            Ok(NodeEvent::Down(n)) if n.as_str() == node => last = Some(true),
            Ok(NodeEvent::Up(n)) if n.as_str() == node => last = Some(false),
            Ok(_) | Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {}
            Err(_) => return last,
        }
    }
}

/// Resolves when the cluster next reports `node` down (never if the
/// cluster stops).
async fn reported_down(events: &mut tokio::sync::broadcast::Receiver<NodeEvent>, node: &str) {
    loop {
        match events.recv().await {
            Ok(NodeEvent::Down(n)) if n.as_str() == node => return,
            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                std::future::pending::<()>().await;
            }
        }
    }
}

async fn watch_down(
    cluster: Cluster,
    broker: Shared,
    resets: tokio::sync::mpsc::UnboundedSender<String>,
    notify: Arc<Notify>,
    me: Me,
) {
    let mut events = cluster.subscribe();
    loop {
        match events.recv().await {
            Ok(NodeEvent::Down(n)) => {
                tracing::info!(node = %n, "node down: failing its forwarded work");
                me.give_up(&mut lock(&broker), n.as_str());
                let _ = resets.send(n.to_string());
                notify.notify_one();
            }
            Ok(NodeEvent::Up(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(_) => return,
        }
    }
}
