//! The in-memory transport: a whole cluster's network inside one process.
//!
//! A [`MemNetwork`] is the switch. Each node gets a [`MemTransport`] from it
//! (with the node's own [`TransportConfig`]); listeners register an address
//! on the network and dialers reach them through it. Connections run the same
//! handshake as TCP and QUIC, so wrong secrets and versions are refused here too.
//!
//! Faults, all between node names and all reversible with [`MemNetwork::heal`]:
//! [`cut`](MemNetwork::cut) one link, [`partition`](MemNetwork::partition)
//! the nodes into groups, [`delay`](MemNetwork::delay) a link (with seeded
//! jitter), [`blackhole`](MemNetwork::blackhole) one direction of a link,
//! [`disconnect`](MemNetwork::disconnect) a node's live connections;
//! [`heal_link`](MemNetwork::heal_link) lifts the faults of one link alone.
//! A cut connection fails at once on both ends, and frames in flight on it are
//! lost, as on a real network. With tokio's paused clock on a current-thread
//! runtime, a run is a pure function of the network's seed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use warren_wire::{NodeName, Role, WireError};

use crate::{
    ChannelListener, Connection, FrameReceiver, FrameSender, Listener, PeerAddr, Transport,
    TransportConfig, TransportError, run_handshake,
};

/// Batches in flight per direction of a link before `flush` waits.
const LINK_CAPACITY: usize = 256;

/// The in-process network that [`MemTransport`]s connect through.
#[derive(Clone)]
pub struct MemNetwork {
    state: Arc<Mutex<NetState>>,
}

struct NetState {
    listeners: BTreeMap<PeerAddr, Registration>,
    next_registration: u64,
    cuts: BTreeSet<(NodeName, NodeName)>,
    groups: Option<Vec<BTreeSet<NodeName>>>,
    delays: BTreeMap<(NodeName, NodeName), (Duration, Duration)>,
    /// (from, to): frames vanish on the way.
    silent: BTreeSet<(NodeName, NodeName)>,
    links: Vec<Weak<LinkShared>>,
    rng: StdRng,
}

struct Registration {
    id: u64,
    node: NodeName,
    max_frame_len: usize,
    incoming: mpsc::Sender<RawEnd>,
}

/// Shared by both ends of one link: who they are and whether it is cut.
struct LinkShared {
    a: NodeName,
    b: NodeName,
    cut: watch::Sender<bool>,
    /// A blackhole swallowed frames of this link: once it lifts, the link is
    /// cut rather than carrying on past the hole (a byte stream never skips).
    holed: std::sync::atomic::AtomicBool,
}

struct Batch {
    /// When the receiver may take it (the sender's clock); `None` at once.
    /// Only a delayed link sets it: the two ends may run on runtimes whose
    /// clocks differ (a simulation pauses one clock per node).
    deliver_at: Option<Instant>,
    frames: Vec<Bytes>,
}

/// One end of a link before its handshake.
struct RawEnd {
    sender: MemSender,
    receiver: MemReceiver,
}

fn pair(a: &NodeName, b: &NodeName) -> (NodeName, NodeName) {
    if a <= b {
        (a.clone(), b.clone())
    } else {
        (b.clone(), a.clone())
    }
}

impl NetState {
    fn blocked(&self, a: &NodeName, b: &NodeName) -> Option<&'static str> {
        if a == b {
            return None;
        }
        if self.cuts.contains(&pair(a, b)) {
            return Some("the link between them is cut");
        }
        if let Some(groups) = &self.groups {
            let group_of = |n: &NodeName| groups.iter().position(|g| g.contains(n));
            if group_of(a) != group_of(b) || group_of(a).is_none() {
                return Some("they are in different partitions");
            }
        }
        None
    }

    /// Cuts the live links that lost frames to a blackhole no longer there.
    fn cut_holed(&mut self) {
        self.links.retain(|weak| weak.strong_count() > 0);
        for link in self.links.iter().filter_map(Weak::upgrade) {
            let (a, b) = (&link.a, &link.b);
            if link.holed.load(std::sync::atomic::Ordering::SeqCst)
                && !self.silent.contains(&(a.clone(), b.clone()))
                && !self.silent.contains(&(b.clone(), a.clone()))
            {
                link.cut.send_replace(true);
            }
        }
    }

    /// Cuts every live link that the current faults forbid.
    fn enforce(&mut self) {
        self.links.retain(|weak| weak.strong_count() > 0);
        let links: Vec<Arc<LinkShared>> = self.links.iter().filter_map(Weak::upgrade).collect();
        for link in links {
            if self.blocked(&link.a, &link.b).is_some() {
                link.cut.send_replace(true);
            }
        }
    }

    /// When a batch sent now from `from` to `to` arrives, if the link is
    /// delayed.
    fn deliver_at(&mut self, from: &NodeName, to: &NodeName) -> Option<Instant> {
        let &(delay, jitter) = self.delays.get(&(from.clone(), to.clone()))?;
        let extra = if jitter.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(self.rng.random_range(0..=jitter.as_nanos() as u64))
        };
        Some(Instant::now() + delay + extra)
    }
}

impl MemNetwork {
    /// A new, fault-free network whose jitter is drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: Arc::new(Mutex::new(NetState {
                listeners: BTreeMap::new(),
                next_registration: 0,
                cuts: BTreeSet::new(),
                groups: None,
                delays: BTreeMap::new(),
                silent: BTreeSet::new(),
                links: Vec::new(),
                rng: StdRng::seed_from_u64(seed),
            })),
        }
    }

    /// A transport for one node of this network.
    pub fn transport(&self, config: TransportConfig) -> MemTransport {
        MemTransport {
            net: self.clone(),
            config,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, NetState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Cuts the link between `a` and `b`: live connections fail, new ones are refused.
    pub fn cut(&self, a: &NodeName, b: &NodeName) {
        let mut st = self.lock();
        st.cuts.insert(pair(a, b));
        st.enforce();
    }

    /// Splits the nodes into groups that cannot reach each other. Nodes named in
    /// no group can reach nobody.
    pub fn partition(&self, groups: &[&[NodeName]]) {
        let mut st = self.lock();
        st.groups = Some(groups.iter().map(|g| g.iter().cloned().collect()).collect());
        st.enforce();
    }

    /// Delays frames between `a` and `b` (both directions) by `delay` plus a
    /// seeded random jitter up to `jitter`. Order within a link is kept.
    pub fn delay(&self, a: &NodeName, b: &NodeName, delay: Duration, jitter: Duration) {
        let mut st = self.lock();
        st.delays.insert((a.clone(), b.clone()), (delay, jitter));
        st.delays.insert((b.clone(), a.clone()), (delay, jitter));
    }

    /// Breaks every live connection of `node` (as if it crashed), without
    /// refusing new ones.
    pub fn disconnect(&self, node: &NodeName) {
        let mut st = self.lock();
        st.links.retain(|weak| weak.strong_count() > 0);
        for link in st.links.iter().filter_map(Weak::upgrade) {
            if &link.a == node || &link.b == node {
                link.cut.send_replace(true);
            }
        }
    }

    /// Frames from `from` to `to` vanish without a trace, as packets that a
    /// firewall drops: live connections stay up (nothing tells either end),
    /// and a new connection between the two times out (after the dialer's
    /// connect timeout), whichever end dials. One-way; call it twice for both.
    /// Once it is lifted ([`heal`](Self::heal), [`heal_link`](Self::heal_link)),
    /// a connection that lost frames to it breaks: a stream cannot skip them.
    pub fn blackhole(&self, from: &NodeName, to: &NodeName) {
        self.lock().silent.insert((from.clone(), to.clone()));
    }

    /// Removes the faults between `a` and `b` alone: their cut, the delays
    /// and blackholes of both directions (a partition stays). Connections
    /// already cut stay down, and so do those that lost frames to a
    /// blackhole (cut now); new ones succeed.
    pub fn heal_link(&self, a: &NodeName, b: &NodeName) {
        let mut st = self.lock();
        st.cuts.remove(&pair(a, b));
        for dir in [(a.clone(), b.clone()), (b.clone(), a.clone())] {
            st.delays.remove(&dir);
            st.silent.remove(&dir);
        }
        st.cut_holed();
    }

    /// Removes every cut, partition, delay and blackhole. Connections
    /// already cut stay down, and so do those that lost frames to a
    /// blackhole (cut now); new ones succeed.
    pub fn heal(&self) {
        let mut st = self.lock();
        st.cuts.clear();
        st.groups = None;
        st.delays.clear();
        st.silent.clear();
        st.cut_holed();
    }

    /// Whether frames sent now from `from` reach `to`: no cut, partition or
    /// blackhole stands between them in that direction (for shells a test
    /// carries itself, such as a simulation's forwarding links).
    pub fn reaches(&self, from: &NodeName, to: &NodeName) -> bool {
        let st = self.lock();
        st.blocked(from, to).is_none() && !st.silent.contains(&(from.clone(), to.clone()))
    }

    /// Whether the dial from `from` to `addr` goes into a blackhole.
    fn dial_vanishes(&self, from: &NodeName, addr: &PeerAddr) -> bool {
        let st = self.lock();
        st.listeners.get(addr).is_some_and(|r| {
            st.silent.contains(&(from.clone(), r.node.clone()))
                || st.silent.contains(&(r.node.clone(), from.clone()))
        })
    }

    fn open_link(
        &self,
        from: &NodeName,
        addr: &PeerAddr,
        max: usize,
    ) -> Result<RawEnd, TransportError> {
        let mut st = self.lock();
        let refused = |why: String| TransportError::Connect {
            addr: addr.clone(),
            source: Arc::new(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                why,
            )),
        };
        let Some(reg) = st.listeners.get(addr) else {
            return Err(refused("nothing listens at this in-memory address".into()));
        };
        let (to, incoming, accept_max) =
            (reg.node.clone(), reg.incoming.clone(), reg.max_frame_len);
        if let Some(why) = st.blocked(from, &to) {
            return Err(refused(format!("{from} cannot reach {to}: {why}")));
        }
        let (cut, _) = watch::channel(false);
        let link = Arc::new(LinkShared {
            a: from.clone(),
            b: to.clone(),
            cut,
            holed: std::sync::atomic::AtomicBool::new(false),
        });
        st.links.push(Arc::downgrade(&link));
        let (tx_ab, rx_ab) = mpsc::channel(LINK_CAPACITY);
        let (tx_ba, rx_ba) = mpsc::channel(LINK_CAPACITY);
        let dial_end = RawEnd {
            sender: MemSender::new(self.clone(), &link, from, &to, tx_ab, max),
            receiver: MemReceiver::new(&link, &to, rx_ba, max),
        };
        let accept_end = RawEnd {
            sender: MemSender::new(self.clone(), &link, &to, from, tx_ba, accept_max),
            receiver: MemReceiver::new(&link, from, rx_ab, accept_max),
        };
        drop(st);
        incoming
            .try_send(accept_end)
            .map_err(|_| refused("the listener's backlog is full or it is closed".into()))?;
        Ok(dial_end)
    }
}

impl fmt::Debug for MemNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("MemNetwork")
            .field("listeners", &st.listeners.keys().collect::<Vec<_>>())
            .field("cuts", &st.cuts)
            .field("groups", &st.groups)
            .finish_non_exhaustive()
    }
}

/// One node's view of a [`MemNetwork`].
#[derive(Debug, Clone)]
pub struct MemTransport {
    net: MemNetwork,
    config: TransportConfig,
}

#[async_trait]
impl Transport for MemTransport {
    fn kind(&self) -> &'static str {
        "mem"
    }

    async fn listen(&self, addr: &PeerAddr) -> Result<Box<dyn Listener>, TransportError> {
        let (tx, mut rx) = mpsc::channel::<RawEnd>(64);
        let id = {
            let mut st = self.net.lock();
            if st.listeners.contains_key(addr) {
                return Err(TransportError::Listen {
                    addr: addr.clone(),
                    source: Arc::new(std::io::Error::new(
                        std::io::ErrorKind::AddrInUse,
                        "another in-memory listener has this address",
                    )),
                });
            }
            st.next_registration += 1;
            let id = st.next_registration;
            st.listeners.insert(
                addr.clone(),
                Registration {
                    id,
                    node: self.config.node.clone(),
                    max_frame_len: self.config.max_frame_len,
                    incoming: tx,
                },
            );
            id
        };
        let (accepted_tx, accepted_rx) = mpsc::channel(64);
        let config = self.config.clone();
        let listen_addr = addr.clone();
        let task = tokio::spawn(async move {
            while let Some(mut end) = rx.recv().await {
                let config = config.clone();
                let accepted_tx = accepted_tx.clone();
                let addr = listen_addr.clone();
                tokio::spawn(async move {
                    if let Ok(peer) = run_handshake(
                        &mut end.sender,
                        &mut end.receiver,
                        &config,
                        Role::Acceptor,
                        &addr,
                    )
                    .await
                    {
                        let conn =
                            Connection::new(peer, Box::new(end.sender), Box::new(end.receiver));
                        let _ = accepted_tx.send(conn).await;
                    }
                });
            }
        });
        let net = self.net.clone();
        let registered = addr.clone();
        let listener = ChannelListener::new(addr.clone(), accepted_rx, task).on_drop(move || {
            let mut st = net.lock();
            if st.listeners.get(&registered).is_some_and(|r| r.id == id) {
                st.listeners.remove(&registered);
            }
        });
        Ok(Box::new(listener))
    }

    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError> {
        if self.net.dial_vanishes(&self.config.node, addr) {
            tokio::time::sleep(self.config.connect_timeout).await;
            return Err(TransportError::Connect {
                addr: addr.clone(),
                source: Arc::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer (the in-memory network drops this pair's frames)",
                )),
            });
        }
        let mut end = self
            .net
            .open_link(&self.config.node, addr, self.config.max_frame_len)?;
        let peer = run_handshake(
            &mut end.sender,
            &mut end.receiver,
            &self.config,
            Role::Dialer,
            addr,
        )
        .await?;
        Ok(Connection::new(
            peer,
            Box::new(end.sender),
            Box::new(end.receiver),
        ))
    }
}

struct MemSender {
    net: MemNetwork,
    /// Keeps the link registered (and cuttable) while this end exists.
    _link: Arc<LinkShared>,
    cut: watch::Receiver<bool>,
    from: NodeName,
    to: NodeName,
    tx: Option<mpsc::Sender<Batch>>,
    buf: Vec<Bytes>,
    buffered: usize,
    last_deliver_at: Instant,
    max: usize,
}

impl MemSender {
    fn new(
        net: MemNetwork,
        link: &Arc<LinkShared>,
        from: &NodeName,
        to: &NodeName,
        tx: mpsc::Sender<Batch>,
        max: usize,
    ) -> Self {
        Self {
            net,
            cut: link.cut.subscribe(),
            _link: link.clone(),
            from: from.clone(),
            to: to.clone(),
            tx: Some(tx),
            buf: Vec::new(),
            buffered: 0,
            last_deliver_at: Instant::now(),
            max,
        }
    }

    fn lost(&self, reason: &str) -> TransportError {
        TransportError::ConnectionLost {
            peer: self.to.to_string(),
            reason: reason.into(),
        }
    }
}

impl fmt::Debug for MemSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemSender")
            .field("from", &self.from)
            .field("to", &self.to)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl FrameSender for MemSender {
    fn feed(&mut self, frame: Bytes) -> Result<(), TransportError> {
        if frame.len() > self.max {
            return Err(TransportError::FrameTooLarge(WireError::FrameTooLarge {
                len: frame.len(),
                max: self.max,
            }));
        }
        if *self.cut.borrow() {
            return Err(self.lost("link cut"));
        }
        self.buffered += frame.len();
        self.buf.push(frame);
        Ok(())
    }

    fn buffered(&self) -> usize {
        self.buffered
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        if *self.cut.borrow() {
            return Err(self.lost("link cut"));
        }
        if self.buf.is_empty() {
            return Ok(());
        }
        let Some(tx) = self.tx.clone() else {
            return Err(TransportError::Closed);
        };
        let deliver_at = {
            let mut st = self.net.lock();
            if st.silent.contains(&(self.from.clone(), self.to.clone())) {
                self._link
                    .holed
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                self.buf.clear();
                self.buffered = 0;
                return Ok(());
            }
            st.deliver_at(&self.from, &self.to)
        };
        // A batch never overtakes an earlier, delayed one.
        let deliver_at = match deliver_at {
            Some(at) => Some(at.max(self.last_deliver_at)),
            None => Some(self.last_deliver_at).filter(|at| *at > Instant::now()),
        };
        if let Some(at) = deliver_at {
            self.last_deliver_at = at;
        }
        let batch = Batch {
            deliver_at,
            frames: std::mem::take(&mut self.buf),
        };
        self.buffered = 0;
        let mut cut = self.cut.clone();
        tokio::select! {
            sent = tx.send(batch) => sent.map_err(|_| self.lost("the peer closed the connection")),
            _ = cut.wait_for(|c| *c) => Err(self.lost("link cut")),
        }
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        let flushed = self.flush().await;
        self.tx = None;
        flushed
    }
}

struct MemReceiver {
    _link: Arc<LinkShared>,
    cut: watch::Receiver<bool>,
    peer: NodeName,
    rx: mpsc::Receiver<Batch>,
    ready: VecDeque<Bytes>,
    max: usize,
}

impl MemReceiver {
    fn new(link: &Arc<LinkShared>, peer: &NodeName, rx: mpsc::Receiver<Batch>, max: usize) -> Self {
        Self {
            _link: link.clone(),
            cut: link.cut.subscribe(),
            peer: peer.clone(),
            rx,
            ready: VecDeque::new(),
            max,
        }
    }

    fn lost(&self) -> TransportError {
        TransportError::ConnectionLost {
            peer: self.peer.to_string(),
            reason: "link cut".into(),
        }
    }

    /// Waits for the next batch; `Ok(false)` when the peer closed.
    async fn fill(&mut self) -> Result<bool, TransportError> {
        if *self.cut.borrow() {
            return Err(self.lost());
        }
        let mut cut = self.cut.clone();
        let batch = tokio::select! {
            batch = self.rx.recv() => batch,
            _ = cut.wait_for(|c| *c) => return Err(self.lost()),
        };
        let Some(batch) = batch else {
            return Ok(false);
        };
        if let Some(at) = batch.deliver_at.filter(|at| *at > Instant::now()) {
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                _ = cut.wait_for(|c| *c) => return Err(self.lost()),
            }
        }
        for frame in batch.frames {
            if frame.len() > self.max {
                let e = WireError::FrameTooLarge {
                    len: frame.len(),
                    max: self.max,
                };
                tracing::warn!(peer = %self.peer, error = %e, "refusing frame from peer; closing connection");
                return Err(TransportError::FrameTooLarge(e));
            }
            self.ready.push_back(frame);
        }
        Ok(true)
    }
}

impl fmt::Debug for MemReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemReceiver")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl FrameReceiver for MemReceiver {
    async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        loop {
            if *self.cut.borrow() {
                return Err(self.lost());
            }
            if let Some(frame) = self.ready.pop_front() {
                return Ok(Some(frame));
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }

    async fn recv_batch(
        &mut self,
        out: &mut Vec<Bytes>,
        max: usize,
    ) -> Result<usize, TransportError> {
        loop {
            if *self.cut.borrow() {
                return Err(self.lost());
            }
            if !self.ready.is_empty() || max == 0 {
                let n = self.ready.len().min(max);
                out.extend(self.ready.drain(..n));
                return Ok(n);
            }
            if !self.fill().await? {
                return Ok(0);
            }
        }
    }
}
