//! Deterministic simulation of one mirrored queue: replicas over real GM
//! `Member` state machines, an in-memory view authority and queue record,
//! frames delivered one at a time in a seeded random order, and faults on a
//! seeded schedule (master crash mid-stream, mirror crash, join during
//! traffic, sync under load). A checker proves that every confirmed message
//! survives while a synchronised replica survives, and that no message is
//! delivered twice without the redelivered flag.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_backing_queue::{BackingQueue, MemStorage, NewMessage, QueueConfig, StoreConfig};
use warren_gm::{Action, Config, Frame, InMemoryAuthority, Member, MemberId, ViewChange};
use warren_mirror::{
    MirrorError, Output, PublishId, RecordView, Replica, Role, Settings, SyncStart,
};
use warren_policy::{PromoteOn, SyncMode};
use warren_wire::NodeName;

const RING: &str = "q";

fn factory() -> warren_mirror::QueueFactory {
    Box::new(|cfg| Ok(BackingQueue::in_memory(cfg)))
}

/// Durable backing queues of node `node` under `root`, each made empty (as
/// a node's factory deletes what an earlier replica left).
fn disk_factory(root: &Path, node: &str) -> warren_mirror::QueueFactory {
    let dir = root.join(node);
    Box::new(move |cfg| {
        let _ = std::fs::remove_dir_all(&dir);
        BackingQueue::open(&dir, cfg, StoreConfig::default()).map(|(bq, _)| bq)
    })
}

/// Durable backing queues of a node in `storage` (whose faults a test
/// switches), each in a fresh directory.
fn mem_factory(storage: MemStorage, node: &str) -> warren_mirror::QueueFactory {
    let dir = std::path::PathBuf::from(node);
    let mut n = 0;
    Box::new(move |cfg| {
        n += 1;
        let shared: std::sync::Arc<dyn warren_backing_queue::Storage> =
            std::sync::Arc::new(storage.clone());
        BackingQueue::open_in(
            shared,
            &dir.join(n.to_string()),
            cfg,
            StoreConfig::default(),
        )
        .map(|(bq, _)| bq)
    })
}

struct Node {
    name: String,
    member: Member,
    replica: Replica,
    alive: bool,
}

/// A consumer's delivery, valid only under the master (epoch, member) that gave it.
#[derive(Debug, Clone, Copy)]
struct Held {
    master: MemberId,
    epoch: u64,
    tag: u64,
}

#[derive(Default, Debug)]
struct Checker {
    /// Publishes confirmed to the publisher.
    confirmed: BTreeSet<u64>,
    /// Publishes nacked (the publisher would resend).
    nacked: BTreeSet<u64>,
    /// Publishes sent, not yet confirmed or nacked.
    pending: BTreeSet<u64>,
    /// Deliveries per message id.
    delivered: BTreeMap<u64, u32>,
    /// Deliveries not yet acked by the consumer.
    unacked: Vec<Held>,
    violations: Vec<String>,
    promotions: u32,
    syncs_completed: u32,
}

struct Sim {
    rng: StdRng,
    seed: u64,
    auth: InMemoryAuthority,
    record: RecordView,
    nodes: Vec<Node>,
    links: BTreeMap<(MemberId, MemberId), VecDeque<Frame>>,
    /// Point-to-point messages in flight `(from, to, payload)`, delivered in
    /// a random order (they may overtake one another and ring frames).
    messages: Vec<(MemberId, MemberId, Bytes)>,
    proposals: VecDeque<(usize, u64, RecordView)>,
    now_ms: u64,
    next_member: u64,
    next_msg: u64,
    settings: Settings,
    /// Members learn views late, and replicas get the authority's newest
    /// view (as the driver gives them), possibly ahead of their member's.
    lazy_views: bool,
    /// The consumer takes its deliveries without acks: each is acked as it
    /// is handed out, as the broker does for a no-ack get or consumer.
    auto_ack: bool,
    /// The master the publisher publishes to.
    publish_target: Option<MemberId>,
    /// Durable queues and persistent messages in this directory: confirms
    /// then also wait for every synchronised replica's fsync, run at random
    /// steps ([`Sim::sync_disk`]). `None`: in-memory queues.
    disk: Option<tempfile::TempDir>,
    /// Nodes whose durable queues live in a `MemStorage` instead (a test
    /// makes their writes fail).
    mem: BTreeMap<String, MemStorage>,
    /// Bytes added to every published body (large messages).
    padding: usize,
    /// The largest payload a replica broadcast.
    largest_broadcast: usize,
    /// The bytes replicas broadcast.
    broadcast_bytes: usize,
    check: Checker,
}

impl Sim {
    fn new(seed: u64, settings: Settings) -> Self {
        Self::with_disk(seed, settings, false)
    }

    /// A simulation whose queues are durable (`disk`) or in memory.
    fn with_disk(seed: u64, settings: Settings, disk: bool) -> Self {
        let mut sim = Self::without_nodes(seed, settings, disk);
        sim.add_node(true);
        sim
    }

    /// [`with_disk`](Self::with_disk) before its master starts.
    fn without_nodes(seed: u64, settings: Settings, disk: bool) -> Self {
        Sim {
            rng: StdRng::seed_from_u64(seed),
            seed,
            auth: InMemoryAuthority::new(),
            record: RecordView {
                version: 1,
                master: "n0".into(),
                ..RecordView::default()
            },
            nodes: Vec::new(),
            links: BTreeMap::new(),
            messages: Vec::new(),
            proposals: VecDeque::new(),
            now_ms: 1_000,
            next_member: 100,
            next_msg: 1,
            settings,
            lazy_views: false,
            auto_ack: false,
            publish_target: None,
            disk: disk.then(|| tempfile::tempdir().expect("a temporary directory")),
            mem: BTreeMap::new(),
            padding: 0,
            largest_broadcast: 0,
            broadcast_bytes: 0,
            check: Checker::default(),
        }
    }

    fn fresh_member(&mut self, name: &str, after: Option<MemberId>) -> MemberId {
        self.next_member += 1;
        let id = MemberId(self.next_member);
        let after = after.or_else(|| self.auth.current_now(RING).alive().last());
        self.auth
            .propose_now(
                RING,
                &ViewChange::Join {
                    member: id,
                    after,
                    node: NodeName::new(name).unwrap(),
                },
            )
            .unwrap();
        id
    }

    /// Starts a replica on a new node (or restarts node `name`).
    fn start_on(&mut self, name: String, master: bool) -> usize {
        self.start_after(name, master, None)
    }

    /// Starts a replica whose ring member is spliced in right after `after`
    /// (by default after the last alive member).
    fn start_after(&mut self, name: String, master: bool, after: Option<MemberId>) -> usize {
        let id = self.fresh_member(&name, after);
        let member = Member::new(id, Config::default());
        let replica = if master {
            // The record names this node master at a new version: the epoch.
            self.record.version += 1;
            self.record.master = name.clone();
            let mut factory = self.factory(&name);
            let bq = factory(QueueConfig {
                record_ops: true,
                ..QueueConfig::default()
            })
            .expect("a backing queue");
            Replica::new_master(
                RING,
                name.clone(),
                id,
                self.settings,
                factory,
                bq,
                warren_mirror::HeldPublishes::new(),
                self.record.clone(),
            )
        } else {
            // A mirror records itself as an unsynchronised mirror first.
            self.record.synchronised.retain(|n| *n != name);
            if !self.record.mirrors.contains(&name) && self.record.master != name {
                self.record.mirrors.push(name.clone());
            }
            self.record.version += 1;
            Replica::new_mirror(
                RING,
                name.clone(),
                id,
                self.settings,
                self.factory(&name),
                self.record.clone(),
            )
        };
        let idx = match self.nodes.iter().position(|n| n.name == name) {
            Some(i) => {
                self.nodes[i] = Node {
                    name,
                    member,
                    replica,
                    alive: true,
                };
                i
            }
            None => {
                self.nodes.push(Node {
                    name,
                    member,
                    replica,
                    alive: true,
                });
                self.nodes.len() - 1
            }
        };
        self.install_views();
        let view = self.auth.current_now(RING);
        self.nodes[idx].member.handle_view(view);
        self.drive(idx);
        self.notify_record();
        self.drive(idx);
        idx
    }

    /// Backing queues for a replica on node `name`.
    fn factory(&mut self, name: &str) -> warren_mirror::QueueFactory {
        if let Some(storage) = self.mem.get(name) {
            return mem_factory(storage.clone(), name);
        }
        match &self.disk {
            Some(root) => disk_factory(root.path(), name),
            None => factory(),
        }
    }

    /// Runs node `i`'s fsync, if it has anything to sync.
    fn sync_disk(&mut self, i: usize) {
        if self.nodes[i].alive && self.nodes[i].replica.needs_storage_sync() {
            let synced = self.nodes[i].replica.sync_storage();
            // A node on a failing MemStorage may fail its fsync.
            if let Err(e) = synced {
                assert!(self.mem.contains_key(&self.nodes[i].name), "fsync: {e}");
            }
            self.drive(i);
        }
    }

    fn add_node(&mut self, master: bool) -> usize {
        let name = format!("n{}", self.nodes.len());
        self.start_on(name, master)
    }

    fn notify_record(&mut self) {
        let rec = self.record.clone();
        for i in 0..self.nodes.len() {
            if self.nodes[i].alive {
                self.nodes[i].replica.handle_record(rec.clone());
                self.drive(i);
            }
        }
    }

    /// A view change reached the authority: members learn it now, or (lazy
    /// views) one at a time at random later steps, as over a network.
    fn install_views(&mut self) {
        if !self.lazy_views {
            self.install_all();
        }
    }

    fn install_one(&mut self) {
        let alive: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].alive)
            .collect();
        if alive.is_empty() {
            return;
        }
        let i = alive[self.rng.random_range(0..alive.len())];
        let view = self.auth.current_now(RING);
        self.nodes[i].member.handle_view(view);
        self.drive(i);
    }

    fn install_all(&mut self) {
        let view = self.auth.current_now(RING);
        for i in 0..self.nodes.len() {
            if self.nodes[i].alive {
                self.nodes[i].member.handle_view(view.clone());
                self.drive(i);
            }
        }
    }

    fn crash(&mut self, i: usize) {
        if !self.nodes[i].alive {
            return;
        }
        self.nodes[i].alive = false;
        let id = self.nodes[i].member.id();
        self.links.retain(|(a, b), _| *a != id && *b != id);
        self.messages.retain(|(a, b, _)| *a != id && *b != id);
        let _ = self.auth.propose_now(RING, &ViewChange::Remove(id));
        self.install_views();
    }

    fn master(&self) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.alive && n.replica.role() == Role::Master)
    }

    /// Runs a member's actions and the replica's outputs until both are quiet.
    fn drive(&mut self, i: usize) {
        loop {
            if !self.nodes[i].alive {
                return;
            }
            let mut busy = false;
            let actions: Vec<Action> = self.nodes[i].member.drain_actions().collect();
            for a in actions {
                busy = true;
                self.on_action(i, a);
            }
            let outputs: Vec<Output> = self.nodes[i].replica.drain_outputs().collect();
            for o in outputs {
                busy = true;
                self.on_output(i, o);
            }
            if !busy {
                return;
            }
        }
    }

    fn on_action(&mut self, i: usize, a: Action) {
        let from = self.nodes[i].member.id();
        match a {
            Action::Send { to, frame } => {
                let alive = self.nodes.iter().any(|n| n.alive && n.member.id() == to);
                if alive {
                    self.links.entry((from, to)).or_default().push_back(frame);
                }
            }
            Action::Deliver {
                publisher, payload, ..
            } => self.nodes[i].replica.handle_deliver(publisher, &payload),
            Action::Confirm { up_to } => self.nodes[i].replica.handle_confirm(up_to),
            Action::ViewInstalled { .. } => {
                let view = if self.lazy_views {
                    self.auth.current_now(RING)
                } else {
                    self.nodes[i].member.view().clone()
                };
                self.nodes[i].replica.handle_view(view);
            }
            Action::NeedView { .. } => {
                let view = self.auth.current_now(RING);
                self.nodes[i].member.handle_view(view);
            }
            Action::Erase { dead } => {
                let v = self.auth.current_now(RING);
                if v.entry(dead).is_some_and(|e| !e.alive)
                    && self
                        .auth
                        .propose_now(RING, &ViewChange::Erase(dead))
                        .is_ok()
                {
                    self.install_views();
                }
            }
            Action::JoinFailed => {
                let _ = self.auth.propose_now(RING, &ViewChange::Remove(from));
                self.nodes[i].replica.handle_removed();
                self.nodes[i].alive = false;
                self.install_views();
            }
            Action::Removed => self.nodes[i].replica.handle_removed(),
        }
    }

    fn on_output(&mut self, i: usize, o: Output) {
        match o {
            Output::Broadcast(b) => {
                self.largest_broadcast = self.largest_broadcast.max(b.len());
                self.broadcast_bytes += b.len();
                self.nodes[i]
                    .member
                    .broadcast(b)
                    .expect("replica broadcasts only once joined");
            }
            Output::Send { to, payload } => {
                let from = self.nodes[i].member.id();
                self.messages.push((from, to, payload));
            }
            Output::ProposeRecord {
                expected_version,
                view,
            } => {
                // A mirror the master newly counts synchronised knows it
                // already (the ring carried the master's announcement): a
                // master that hands over on this record leaves a mirror
                // that can take over.
                // (Its members that the master counts: a node restarted
                // since runs a new member, which the master does not.)
                let counted = self.nodes[i].replica.status().synced_members;
                for n in view
                    .synchronised
                    .iter()
                    .filter(|n| !self.record.synchronised.contains(*n))
                {
                    let knows = self
                        .nodes
                        .iter()
                        .filter(|x| x.alive && x.name == *n)
                        .filter(|x| counted.contains(&x.member.id()))
                        .all(|x| x.replica.status().synchronised);
                    if self.nodes[i].replica.role() == Role::Master && !knows {
                        self.check.violations.push(format!(
                            "{} proposed {n} synchronised before {n} knew it",
                            self.nodes[i].name
                        ));
                    }
                }
                self.proposals.push_back((i, expected_version, view));
            }
            Output::Confirmed(ids) => {
                for id in ids {
                    self.check.pending.remove(&id.seq);
                    self.check.confirmed.insert(id.seq);
                }
            }
            Output::Nacked(ids) => {
                for id in ids {
                    if self.check.pending.remove(&id.seq) {
                        self.check.nacked.insert(id.seq);
                    }
                }
            }
            Output::Fetched { delivery, .. } => {
                if let Some(d) = delivery {
                    let n = self.check.delivered.entry(d.id).or_insert(0);
                    *n += 1;
                    if *n > 1 && !d.redelivered {
                        self.check.violations.push(format!(
                            "message {} delivered {} times, last without redelivered",
                            d.id, n
                        ));
                    }
                    if self.auto_ack {
                        self.nodes[i]
                            .replica
                            .ack(d.tag)
                            .expect("a delivery acked as it is handed out");
                        return;
                    }
                    let r = &self.nodes[i].replica;
                    self.check.unacked.push(Held {
                        master: r.member(),
                        epoch: r.epoch(),
                        tag: d.tag,
                    });
                }
            }
            Output::Promoted { .. } => {
                self.check.promotions += 1;
                self.resend_pending(i);
            }
            Output::SyncComplete => self.check.syncs_completed += 1,
            Output::FetchFailed { .. } | Output::Deposed { .. } | Output::Dropped(_) => {}
        }
    }

    fn settle_proposal(&mut self) {
        let Some((i, expected, view)) = self.proposals.pop_front() else {
            return;
        };
        if self.record.version == expected {
            self.record = RecordView {
                version: expected + 1,
                ..view
            };
            let rec = self.record.clone();
            if self.nodes[i].alive {
                self.nodes[i].replica.record_settled(rec);
                self.drive(i);
            }
            self.notify_record();
        } else if self.nodes[i].alive {
            let rec = self.record.clone();
            self.nodes[i].replica.record_settled(rec);
            self.drive(i);
        }
    }

    /// Delivers the next frame from node `a`'s member to node `b`'s.
    fn deliver_between(&mut self, a: usize, b: usize) -> bool {
        let k = (self.nodes[a].member.id(), self.nodes[b].member.id());
        let Some(frame) = self.links.get_mut(&k).and_then(VecDeque::pop_front) else {
            return false;
        };
        self.nodes[b].member.handle_frame(frame);
        self.drive(b);
        true
    }

    /// Delivers one ring frame or point-to-point message, picked at random.
    fn deliver_frame(&mut self) -> bool {
        let keys: Vec<(MemberId, MemberId)> = self
            .links
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if keys.is_empty() && self.messages.is_empty() {
            return false;
        }
        let pick = self.rng.random_range(0..keys.len() + self.messages.len());
        if pick >= keys.len() {
            let (from, to, payload) = self.messages.swap_remove(pick - keys.len());
            if let Some(i) = self
                .nodes
                .iter()
                .position(|n| n.alive && n.member.id() == to)
            {
                self.nodes[i].replica.handle_message(from, &payload);
                self.drive(i);
            }
            return true;
        }
        let k = keys[pick];
        let frame = self.links.get_mut(&k).and_then(VecDeque::pop_front);
        let Some(frame) = frame else { return false };
        if let Some(i) = self
            .nodes
            .iter()
            .position(|n| n.alive && n.member.id() == k.1)
        {
            self.nodes[i].member.handle_frame(frame);
            self.drive(i);
        }
        true
    }

    fn flush_all(&mut self) {
        for i in 0..self.nodes.len() {
            if self.nodes[i].alive {
                self.nodes[i].replica.flush();
                self.drive(i);
                self.nodes[i].member.flush();
                self.drive(i);
            }
        }
    }

    fn publish(&mut self) {
        let Some(m) = self.master() else { return };
        // A publisher sends what the old master did not confirm again, in
        // order, before it publishes anything new to the next master.
        self.resend_pending(m);
        let seq = self.next_msg;
        self.next_msg += 1;
        if self.send(m, seq) {
            self.check.pending.insert(seq);
        }
        self.drive(m);
    }

    /// Publishes message `seq` (publisher 1's `seq`) to node `m`'s replica;
    /// whether it took it.
    fn send(&mut self, m: usize, seq: u64) -> bool {
        let id = PublishId { publisher: 1, seq };
        let persistent = self.disk.is_some();
        let mut body = format!("m{seq}").into_bytes();
        body.resize(body.len() + self.padding, b'.');
        let msg = NewMessage::new(seq, body, persistent);
        let now = self.now_ms;
        self.nodes[m].replica.publish(now, id, msg).is_ok()
    }

    /// If node `m`'s master is new to the publisher, sends it every publish
    /// not yet confirmed or nacked, as Warren's brokers send a forwarded
    /// publish again when the master's node goes down: the new master
    /// confirms those it holds and enqueues the others (lost with the old
    /// master), so none is nacked and none held twice.
    fn resend_pending(&mut self, m: usize) {
        let target = self.nodes[m].member.id();
        if self.publish_target == Some(target) {
            return;
        }
        self.publish_target = Some(target);
        let pending: Vec<u64> = self.check.pending.iter().copied().collect();
        for seq in pending {
            if !self.send(m, seq) {
                self.check.pending.remove(&seq);
                self.check.nacked.insert(seq);
            }
        }
    }

    fn fetch(&mut self) {
        let Some(m) = self.master() else { return };
        let now = self.now_ms;
        let _ = self.nodes[m].replica.fetch(now);
        self.drive(m);
    }

    /// Acks (or requeues) one of the consumer's deliveries of the current master.
    fn settle_delivery(&mut self, requeue: bool) {
        let Some(m) = self.master() else { return };
        let (member, epoch) = (
            self.nodes[m].replica.member(),
            self.nodes[m].replica.epoch(),
        );
        // Deliveries from an older master are void: their messages were requeued.
        self.check
            .unacked
            .retain(|h| h.master == member && h.epoch == epoch);
        if self.check.unacked.is_empty() {
            return;
        }
        let k = self.rng.random_range(0..self.check.unacked.len());
        let h = self.check.unacked.swap_remove(k);
        let r = &mut self.nodes[m].replica;
        let res = if requeue {
            r.requeue(h.tag)
        } else {
            r.ack(h.tag)
        };
        res.expect("a delivery of the current master can be settled");
        self.drive(m);
    }

    fn step(&mut self, traffic: bool) {
        let roll = self.rng.random_range(0..100);
        match roll {
            0..=54 => {
                self.deliver_frame();
            }
            55..=64 => self.flush_all(),
            65..=67 => self.settle_proposal(),
            68..=69 => {
                if self.lazy_views {
                    self.install_one();
                } else {
                    self.settle_proposal();
                }
            }
            70..=79 if traffic => self.publish(),
            80..=86 if traffic => self.fetch(),
            87..=91 if traffic => self.settle_delivery(false),
            92..=93 if traffic => self.settle_delivery(true),
            94 if self.disk.is_some() => {
                let i = self.rng.random_range(0..self.nodes.len());
                self.sync_disk(i);
            }
            94..=95 => self.tick_all(7),
            _ => {
                self.deliver_frame();
            }
        }
    }

    /// Moves the clock on by `ms` and ticks every live replica.
    fn tick_all(&mut self, ms: u64) {
        self.now_ms += ms;
        let now = self.now_ms;
        for i in 0..self.nodes.len() {
            if self.nodes[i].alive {
                self.nodes[i].replica.tick(now);
                self.drive(i);
            }
        }
    }

    /// A queue of `messages` messages with one unsynchronised mirror (n1),
    /// in manual mode.
    fn unsynchronised_mirror(seed: u64, messages: usize) -> Self {
        let mut sim = Sim::new(seed, settings(SyncMode::Manual, 2));
        for _ in 0..messages {
            sim.publish();
        }
        sim.quiesce();
        sim.add_node(false);
        sim.quiesce();
        assert!(!sim.nodes[1].replica.status().synchronised);
        sim
    }

    /// Runs until no frame, proposal or output is left (faults and traffic over).
    fn quiesce(&mut self) {
        for _ in 0..200_000 {
            self.install_all();
            self.flush_all();
            for i in 0..self.nodes.len() {
                self.sync_disk(i);
            }
            let mut busy = false;
            while self.deliver_frame() {
                busy = true;
            }
            if !self.proposals.is_empty() {
                busy = true;
                self.settle_proposal();
            }
            if !busy {
                self.flush_all();
                let current = self.auth.current_now(RING).version;
                let views_in = self
                    .nodes
                    .iter()
                    .all(|n| !n.alive || n.member.view().version >= current);
                if views_in
                    && self.links.values().all(VecDeque::is_empty)
                    && self.messages.is_empty()
                    && self.proposals.is_empty()
                {
                    return;
                }
            }
        }
        panic!("seed {}: the simulation never went quiet", self.seed);
    }

    /// Flushes and delivers everything in flight, many times over, without
    /// fsyncs, proposals or view changes.
    fn ring_rounds(&mut self) {
        for _ in 0..100 {
            self.flush_all();
            while self.deliver_frame() {}
        }
    }

    /// Adds `n` mirrors and runs until they are synchronised.
    fn add_synchronised_mirrors(&mut self, n: usize) {
        for _ in 0..n {
            self.add_node(false);
        }
        self.quiesce();
        assert_eq!(self.synced_alive_mirrors().len(), n);
    }

    fn synced_alive_mirrors(&self) -> Vec<usize> {
        let Some(m) = self.master() else {
            return Vec::new();
        };
        let synced = self.nodes[m].replica.status().synced_members;
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].alive && synced.contains(&self.nodes[i].member.id()))
            .collect()
    }

    /// The checks once the simulation is quiet.
    fn check_end(&mut self) {
        assert!(
            self.check.violations.is_empty(),
            "seed {}: {:?}",
            self.seed,
            self.check.violations
        );
        let Some(m) = self.master() else {
            let nodes: Vec<String> = self
                .nodes
                .iter()
                .map(|n| {
                    format!(
                        "{} {} alive={} {:?} {:?}",
                        n.name,
                        n.member.id(),
                        n.alive,
                        n.member.phase(),
                        n.replica.status()
                    )
                })
                .collect();
            panic!(
                "seed {}: no master at the end\nnodes: {nodes:#?}\nview: {:?}\nrecord: {:?}",
                self.seed,
                self.auth.current_now(RING),
                self.record
            );
        };
        // The backlog's byte count follows its publishes.
        let r = &self.nodes[m].replica;
        if r.backlog() == 0 {
            assert_eq!(
                r.backlog_bytes(),
                0,
                "seed {}: bytes of no backlog",
                self.seed
            );
        }
        // Synchronised mirrors hold exactly the master's state.
        let master_seqs = self.nodes[m].replica.ready_seqs();
        let master_stats = self.nodes[m].replica.stats();
        for i in self.synced_alive_mirrors() {
            assert_eq!(
                self.nodes[i].replica.ready_seqs(),
                master_seqs,
                "seed {}: synchronised mirror {} differs from the master",
                self.seed,
                self.nodes[i].name
            );
            // Disk use differs: a synchronised mirror's log began at its sync.
            let counts = |s: Option<warren_backing_queue::Stats>| {
                s.map(|s| (s.ready, s.unacked, s.ready_bytes, s.unacked_bytes))
            };
            assert_eq!(counts(self.nodes[i].replica.stats()), counts(master_stats));
        }
        // Drain the queue: everything confirmed must come out (or have come out).
        for h in std::mem::take(&mut self.check.unacked) {
            if h.master == self.nodes[m].replica.member()
                && h.epoch == self.nodes[m].replica.epoch()
            {
                let _ = self.nodes[m].replica.requeue(h.tag);
            }
        }
        loop {
            let before: u32 = self.check.delivered.values().sum();
            let now = self.now_ms;
            for _ in 0..64 {
                let _ = self.nodes[m].replica.fetch(now);
            }
            self.drive(m);
            self.quiesce();
            let after: u32 = self.check.delivered.values().sum();
            if after == before {
                break;
            }
        }
        let lost: Vec<u64> = self
            .check
            .confirmed
            .iter()
            .filter(|id| !self.check.delivered.contains_key(id))
            .copied()
            .collect();
        assert!(
            lost.is_empty(),
            "seed {}: confirmed messages lost: {:?}",
            self.seed,
            lost
        );
        assert!(
            self.check.violations.is_empty(),
            "seed {}: {:?}",
            self.seed,
            self.check.violations
        );
    }
}

fn settings(mode: SyncMode, batch: u64) -> Settings {
    Settings {
        sync_mode: mode,
        sync_batch_size: batch,
        ..Settings::default()
    }
}

/// One seeded run: 3 replicas, traffic, and a random fault schedule.
fn run_seed(seed: u64) -> Checker {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9);
    let batch = [1, 3, 64][rng.random_range(0..3)];
    // Every third seed: durable queues, persistent messages, random fsyncs.
    let mut sim = Sim::with_disk(
        seed,
        settings(SyncMode::Automatic, batch),
        seed.is_multiple_of(3),
    );
    sim.lazy_views = seed % 2 == 1;
    sim.add_node(false);
    sim.add_node(false);
    let steps = 3_000;
    // Fault times.
    let mut faults: Vec<(usize, u8)> = (0..rng.random_range(1..5))
        .map(|_| (rng.random_range(200..steps), rng.random_range(0..4)))
        .collect();
    faults.sort();
    let mut next_fault = 0;
    for step in 0..steps {
        while next_fault < faults.len() && faults[next_fault].0 == step {
            let kind = faults[next_fault].1;
            next_fault += 1;
            match kind {
                // Crash the master mid-stream, if a mirror that knows it is
                // synchronised survives it (the master may count a mirror
                // before the mirrors hear of it: then the queue would wait
                // for its master, which never comes back here).
                0 => {
                    let knows = (0..sim.nodes.len()).any(|i| {
                        sim.nodes[i].alive
                            && sim.nodes[i].replica.role() == Role::Mirror
                            && sim.nodes[i].replica.status().synchronised
                    });
                    if let Some(m) = sim.master()
                        && knows
                    {
                        // Mid-stream: its last batch is part-way round the ring.
                        for _ in 0..sim.rng.random_range(1..6) {
                            sim.publish();
                        }
                        sim.flush_all();
                        for _ in 0..sim.rng.random_range(0..4) {
                            sim.deliver_frame();
                        }
                        sim.crash(m);
                        // Sometimes the record store answers before the ring settles.
                        if sim.rng.random_bool(0.5) {
                            while !sim.proposals.is_empty() {
                                sim.settle_proposal();
                            }
                        }
                    }
                }
                // Crash a mirror, keeping a master and one other replica.
                1 => {
                    let m = sim.master();
                    let mirrors: Vec<usize> = (0..sim.nodes.len())
                        .filter(|&i| sim.nodes[i].alive && Some(i) != m)
                        .collect();
                    if mirrors.len() >= 2 {
                        let k = mirrors[sim.rng.random_range(0..mirrors.len())];
                        sim.crash(k);
                    }
                }
                // A node joins (or a dead one restarts) during traffic.
                2 => {
                    let dead = sim.nodes.iter().position(|n| !n.alive);
                    match dead {
                        Some(d) => {
                            let name = sim.nodes[d].name.clone();
                            sim.start_on(name, false);
                        }
                        None if sim.nodes.len() < 5 => {
                            sim.add_node(false);
                        }
                        None => {}
                    }
                }
                // An explicit sync under load.
                _ => {
                    if let Some(m) = sim.master() {
                        let _ = sim.nodes[m].replica.sync();
                        sim.drive(m);
                    }
                }
            }
        }
        sim.step(true);
    }
    sim.quiesce();
    sim.check_end();
    sim.check
}

#[test]
fn seeded_fault_schedules_lose_no_confirmed_message() {
    // WARREN_SIM_SEED=N replays one seed (with RUST_LOG for its log).
    if let Some(seed) = std::env::var("WARREN_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        run_seed(seed);
        return;
    }
    // WARREN_SIM_SEEDS=N sweeps seeds 0..N instead of the default 300.
    let seeds: u64 = std::env::var("WARREN_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let mut promotions = 0;
    let mut confirmed = 0;
    for seed in 0..seeds {
        let c = run_seed(seed);
        promotions += c.promotions;
        confirmed += c.confirmed.len();
    }
    // The schedules must actually exercise failover and confirms.
    assert!(promotions > 30, "only {promotions} promotions");
    assert!(confirmed > 30_000, "only {confirmed} confirms");
}

#[test]
fn confirms_wait_for_every_member_and_survive_a_mirror_crash() {
    let mut sim = Sim::new(1, settings(SyncMode::Automatic, 16));
    sim.add_synchronised_mirrors(2);
    for _ in 0..10 {
        sim.publish();
    }
    // Not confirmed before the ring has gone round.
    assert!(sim.check.confirmed.is_empty());
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 10);
    // A mirror dies with publishes in flight: the survivors confirm them.
    for _ in 0..10 {
        sim.publish();
    }
    sim.flush_all();
    sim.crash(2);
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 20);
    assert_eq!(sim.record.mirrors, vec!["n1".to_owned()]);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.check_end();
}

#[test]
fn persistent_confirms_wait_for_every_synchronised_mirrors_fsync() {
    let mut sim = Sim::with_disk(3, settings(SyncMode::Automatic, 16), true);
    sim.add_synchronised_mirrors(2);
    for _ in 0..5 {
        sim.publish();
    }
    // Round the ring, with no fsync anywhere.
    sim.ring_rounds();
    assert!(sim.check.confirmed.is_empty(), "nothing is on disk yet");
    let m = sim.master().unwrap();
    sim.sync_disk(m);
    sim.ring_rounds();
    assert!(
        sim.check.confirmed.is_empty(),
        "on the master's disk only, not on the mirrors'"
    );
    let mirrors = sim.synced_alive_mirrors();
    sim.sync_disk(mirrors[0]);
    sim.ring_rounds();
    assert!(
        sim.check.confirmed.is_empty(),
        "one synchronised mirror has not synced its disk"
    );
    sim.sync_disk(mirrors[1]);
    sim.ring_rounds();
    assert_eq!(sim.check.confirmed.len(), 5);
    // A mirror that dies before its fsync no longer holds confirms back.
    for _ in 0..5 {
        sim.publish();
    }
    sim.ring_rounds();
    sim.sync_disk(m);
    sim.sync_disk(mirrors[0]);
    sim.ring_rounds();
    assert_eq!(sim.check.confirmed.len(), 5);
    sim.crash(mirrors[1]);
    sim.ring_rounds();
    assert_eq!(sim.check.confirmed.len(), 10);
    sim.quiesce();
    sim.check_end();
}

/// A mirror's disk report travels to the master alone, not round the ring:
/// one lost with a broken link is sent again when the link is replaced.
#[test]
fn a_disk_report_lost_with_its_link_is_sent_again_on_the_new_link() {
    let mut sim = Sim::with_disk(4, settings(SyncMode::Automatic, 16), true);
    sim.add_synchronised_mirrors(1);
    for _ in 0..3 {
        sim.publish();
    }
    sim.ring_rounds();
    let m = sim.master().unwrap();
    let mirror = sim.synced_alive_mirrors()[0];
    sim.sync_disk(m);
    sim.sync_disk(mirror);
    assert_eq!(sim.messages.len(), 1, "the mirror's report to the master");
    // The link breaks: the report is lost, and nothing confirms.
    sim.messages.clear();
    sim.ring_rounds();
    assert!(sim.check.confirmed.is_empty());
    sim.sync_disk(mirror);
    sim.ring_rounds();
    assert!(
        sim.check.confirmed.is_empty(),
        "no new fsync, no new report"
    );
    // The new link: the mirror reports again and the master confirms.
    sim.nodes[mirror]
        .replica
        .handle_ring_event(warren_gm::RingEvent::LinkReset);
    sim.drive(mirror);
    sim.ring_rounds();
    assert_eq!(sim.check.confirmed.len(), 3);
    sim.quiesce();
    sim.check_end();
}

#[test]
fn min_sync_replicas_holds_confirms_until_a_mirror_is_synchronised() {
    let mut s = settings(SyncMode::Manual, 4);
    s.min_sync_replicas = 2;
    let mut sim = Sim::new(2, s);
    for _ in 0..5 {
        sim.publish();
    }
    sim.quiesce();
    assert!(sim.check.confirmed.is_empty(), "one copy is not enough");
    sim.add_node(false);
    sim.quiesce();
    // Manual mode and a non-empty queue: the mirror waits, and so do confirms.
    assert!(sim.check.confirmed.is_empty());
    let m = sim.master().unwrap();
    assert!(!sim.nodes[1].replica.status().synchronised);
    assert_eq!(
        sim.nodes[m].replica.sync().unwrap(),
        SyncStart::Started { targets: 1 }
    );
    sim.drive(m);
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.check.confirmed.len(), 5);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    assert_eq!(
        sim.nodes[m].replica.sync().unwrap(),
        SyncStart::AlreadySynced
    );
    sim.check_end();
}

#[test]
fn promotion_requeues_unacked_and_reports_held_publishes() {
    let mut sim = Sim::new(3, settings(SyncMode::Automatic, 8));
    sim.add_node(false);
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..6 {
        sim.publish();
    }
    sim.quiesce();
    sim.fetch();
    sim.fetch();
    sim.quiesce();
    assert_eq!(sim.check.delivered.len(), 2);
    // Two more publishes reach the mirrors, but the master dies before any confirm.
    sim.publish();
    sim.publish();
    sim.nodes[0].replica.flush();
    sim.drive(0);
    sim.nodes[0].member.flush();
    sim.drive(0);
    // The frame reaches n1 (and n1 passes it on) before the master dies.
    while sim.deliver_frame() {
        if sim.check.confirmed.len() >= 6 {
            break;
        }
    }
    sim.crash(0);
    sim.quiesce();
    let m = sim.master().expect("a mirror was promoted");
    assert_eq!(sim.nodes[m].name, "n1", "the oldest synchronised mirror");
    assert_eq!(sim.record.master, "n1");
    assert_eq!(sim.check.promotions, 1);
    assert!(sim.check.pending.is_empty(), "every publish is settled");
    assert!(
        sim.check.nacked.is_empty(),
        "sent again to the new master, not nacked"
    );
    let stats = sim.nodes[m].replica.stats().unwrap();
    assert_eq!(stats.unacked, 0, "unacked messages were requeued");
    // The two delivered ones come back first, redelivered.
    sim.check.unacked.clear();
    sim.fetch();
    sim.fetch();
    sim.quiesce();
    assert_eq!(sim.check.delivered.values().filter(|n| **n == 2).count(), 2);
    assert!(sim.check.violations.is_empty());
    sim.check_end();
}

#[test]
fn no_promotion_without_a_synchronised_mirror_unless_always() {
    for (policy, promoted) in [(PromoteOn::WhenSynced, false), (PromoteOn::Always, true)] {
        let mut s = settings(SyncMode::Manual, 8);
        s.promote_on_failure = policy;
        let mut sim = Sim::new(4, s);
        for _ in 0..3 {
            sim.publish();
        }
        sim.quiesce();
        sim.add_node(false);
        sim.quiesce();
        assert!(!sim.nodes[1].replica.status().synchronised);
        sim.crash(0);
        sim.quiesce();
        assert_eq!(sim.master().is_some(), promoted, "{policy:?}");
        if promoted {
            // An unsynchronised mirror held nothing: the queue is empty.
            assert_eq!(sim.nodes[1].replica.stats().unwrap().ready, 0);
        } else {
            assert_eq!(sim.record.master, "n0", "the queue waits for its master");
        }
    }
}

/// A mirror the ring still counts synchronised but the queue record no
/// longer lists (its master took it out, as when it went on without that
/// mirror, which then missed deliveries and confirms) is not promoted:
/// the next one the record lists is. Found by mirror-driver simulation seed
/// 164, where such a mirror was promoted and delivered messages again
/// without the redelivered flag.
#[test]
fn promotion_follows_the_records_synchronised_mirrors() {
    let mut sim = Sim::new(6, settings(SyncMode::Automatic, 8));
    sim.add_node(false);
    sim.add_node(false);
    sim.quiesce();
    assert_eq!(sim.record.synchronised, ["n1", "n2"]);
    sim.crash(0);
    sim.record.synchronised = vec!["n2".to_owned()];
    sim.record.version += 1;
    sim.notify_record();
    sim.quiesce();
    let m = sim.master().expect("a mirror was promoted");
    assert_eq!(sim.nodes[m].name, "n2", "the mirror the record lists");
    assert_eq!(sim.record.master, "n2");
}

/// A master holding 40 messages (`fetched` of them delivered), a new
/// mirror, and a manual sync (one message per batch) just started; returns
/// the master's index.
fn forty_and_a_manual_sync(seed: u64, fetched: usize) -> (Sim, usize) {
    let mut sim = Sim::new(seed, settings(SyncMode::Manual, 1));
    for _ in 0..40 {
        sim.publish();
    }
    sim.quiesce();
    for _ in 0..fetched {
        sim.fetch();
    }
    sim.quiesce();
    sim.add_node(false);
    sim.quiesce();
    let m = sim.master().unwrap();
    sim.nodes[m].replica.sync().unwrap();
    sim.drive(m);
    (sim, m)
}

#[test]
fn sync_under_load_with_progress_and_cancel() {
    let (mut sim, m) = forty_and_a_manual_sync(5, 5);
    // Cancel: the mirror drops what it got and stays unsynchronised.
    for _ in 0..3 {
        sim.flush_all();
    }
    let p = sim.nodes[m].replica.status().syncing.expect("syncing");
    assert_eq!(p.total, 40);
    assert!(p.synced > 0 && p.synced < 40);
    assert!(sim.nodes[m].replica.cancel_sync().unwrap());
    assert!(!sim.nodes[m].replica.cancel_sync().unwrap());
    sim.drive(m);
    sim.quiesce();
    assert!(!sim.nodes[1].replica.status().synchronised);
    assert!(sim.nodes[1].replica.stats().is_none());
    // Sync again, with traffic between every batch.
    sim.nodes[m].replica.sync().unwrap();
    sim.drive(m);
    let mut rounds = 0;
    while sim.nodes[m].replica.status().syncing.is_some() {
        sim.publish();
        sim.fetch();
        sim.settle_delivery(false);
        sim.flush_all();
        for _ in 0..20 {
            sim.deliver_frame();
        }
        rounds += 1;
    }
    assert!(rounds >= 30, "one message per batch: {rounds} rounds");
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.check_end();
}

/// A master sends a sync a few batches at a time: the next batch goes when
/// the ring has carried one round, so a sync of any backlog holds a few
/// batches in memory on the master and on the ring, not the queue.
#[test]
fn a_sync_keeps_at_most_two_batches_on_the_ring() {
    let (mut sim, m) = forty_and_a_manual_sync(12, 0);
    // Turns without the ring moving: no more batches go out.
    for _ in 0..10 {
        sim.flush_all();
    }
    let p = sim.nodes[m].replica.status().syncing.expect("syncing");
    assert_eq!(p.synced, 2, "batches sent before the ring carried any");
    // As the ring carries them, the rest follow.
    sim.quiesce();
    assert!(sim.nodes[m].replica.status().syncing.is_none());
    assert!(sim.nodes[1].replica.status().synchronised);
    sim.check_end();
}

/// A master counts the bytes of the publishes its ring and mirrors have not
/// confirmed (the broker holds publishers back past 16 MiB of them): large
/// messages count by their size.
#[test]
fn the_backlog_counts_the_bytes_waiting_for_the_ring() {
    const MSG: usize = 1 << 20;
    let mut sim = Sim::new(13, settings(SyncMode::Automatic, 4096));
    sim.padding = MSG;
    sim.add_node(false);
    sim.quiesce();
    let m = sim.master().unwrap();
    for _ in 0..3 {
        sim.publish();
    }
    assert_eq!(sim.nodes[m].replica.backlog(), 3);
    assert!(sim.nodes[m].replica.backlog_bytes() >= 3 * MSG);
    sim.quiesce();
    assert_eq!(sim.nodes[m].replica.backlog_bytes(), 0);
    sim.check_end();
}

/// Large messages published in one turn go round the ring in several
/// broadcasts, and a sync of them in several batches, each of a few MiB and
/// one message at most (so each fits a peer frame), and nothing is lost.
#[test]
fn large_messages_go_in_broadcasts_and_sync_batches_of_bounded_size() {
    const MSG: usize = 3 << 20;
    let bound = (4 << 20) + MSG + 4096;
    let mut sim = Sim::new(11, settings(SyncMode::Automatic, 4096));
    sim.padding = MSG;
    sim.add_node(false);
    sim.quiesce();
    // Six in one turn: no flush between them.
    for _ in 0..6 {
        sim.publish();
    }
    sim.quiesce();
    assert!(
        (MSG..=bound).contains(&sim.largest_broadcast),
        "a broadcast of {} bytes",
        sim.largest_broadcast
    );
    assert!(sim.check.pending.is_empty(), "every publish confirmed");
    // A new mirror gets the six in batches as small.
    sim.largest_broadcast = 0;
    let n = sim.add_node(false);
    sim.quiesce();
    assert!(sim.nodes[n].replica.status().synchronised);
    assert!(
        (MSG..=bound).contains(&sim.largest_broadcast),
        "a sync batch of {} bytes",
        sim.largest_broadcast
    );
    sim.check_end();
}

/// A new mirror asks for a sync when it joins, when it first hears its
/// master and every 2 s until a sync reaches it; the asks that cross the
/// sync started for it copy the queue no second time.
#[test]
fn a_new_mirror_gets_the_queue_copied_once() {
    const MSG: usize = 64 << 10;
    const COUNT: usize = 20;
    let mut sim = Sim::new(14, settings(SyncMode::Automatic, 4096));
    sim.padding = MSG;
    for _ in 0..COUNT {
        sim.publish();
    }
    sim.quiesce();
    sim.broadcast_bytes = 0;
    let n = sim.add_node(false);
    // Time passes while the ring carries the sync: the mirror asks again.
    for _ in 0..3 {
        sim.tick_all(2_100);
        sim.flush_all();
        sim.deliver_frame();
    }
    sim.quiesce();
    assert!(sim.nodes[n].replica.status().synchronised);
    let queue = COUNT * MSG;
    assert!(
        (queue..2 * queue).contains(&sim.broadcast_bytes),
        "{} bytes broadcast to copy a queue of {queue}",
        sim.broadcast_bytes
    );
    sim.check_end();
}

#[test]
fn restarted_mirror_drops_its_content_and_resyncs() {
    let mut sim = Sim::new(6, settings(SyncMode::Automatic, 4));
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..10 {
        sim.publish();
    }
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.crash(1);
    sim.quiesce();
    assert!(sim.record.synchronised.is_empty());
    for _ in 0..5 {
        sim.publish();
    }
    sim.start_on("n1".into(), false);
    assert!(!sim.nodes[1].replica.status().synchronised);
    assert!(sim.nodes[1].replica.stats().is_none(), "starts empty");
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.nodes[1].replica.stats().unwrap().ready, 15);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.check_end();
}

#[test]
fn graceful_stop_promotes_per_promote_on_shutdown() {
    let mut sim = Sim::new(7, settings(SyncMode::Automatic, 4));
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..4 {
        sim.publish();
    }
    sim.quiesce();
    {
        let now = sim.now_ms;
        sim.nodes[0].replica.stop(now);
    }
    sim.drive(0);
    sim.flush_all();
    sim.quiesce();
    sim.crash(0);
    sim.quiesce();
    let m = sim.master().expect("promoted on shutdown");
    assert_eq!(sim.nodes[m].name, "n1");
    assert_eq!(sim.nodes[m].replica.stats().unwrap().ready, 4);
    sim.check_end();
}

/// A stopping master (a policy moved it, or its node stops) first
/// confirms what it took, as RabbitMQ's promoted mirror does for the
/// publishes its channels also sent it; it takes nothing new meanwhile.
#[test]
fn a_stopping_master_confirms_what_it_took_before_it_hands_over() {
    let mut sim = Sim::with_disk(31, settings(SyncMode::Automatic, 4), true);
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..5 {
        sim.publish();
    }
    assert_eq!(sim.check.pending.len(), 5);
    {
        let now = sim.now_ms;
        sim.nodes[0].replica.stop(now);
    }
    sim.drive(0);
    assert_eq!(sim.nodes[0].replica.role(), Role::Master, "draining");
    let id = PublishId {
        publisher: 1,
        seq: 1_000,
    };
    let msg = NewMessage::new(1_000, b"later".to_vec(), true);
    assert!(matches!(
        sim.nodes[0].replica.publish(0, id, msg),
        Err(MirrorError::Stopping)
    ));
    assert!(matches!(
        sim.nodes[0].replica.fetch(0),
        Err(MirrorError::Stopping)
    ));
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 5, "confirmed, not nacked");
    assert!(sim.check.nacked.is_empty());
    assert_eq!(sim.nodes[0].replica.role(), Role::Stopped);
    sim.crash(0);
    sim.quiesce();
    let m = sim.master().expect("promoted on shutdown");
    assert_eq!(sim.nodes[m].name, "n1");
    assert_eq!(sim.nodes[m].replica.stats().unwrap().ready, 5);
    sim.check_end();
}

/// A stopping master's last no-ack delivery, acked as it is handed out
/// (after the master has nothing left to confirm or hand out), reaches the
/// ring before the master stops: the promoted mirror does not deliver it
/// again. Before, the master stopped first and the ack stayed on its own
/// copy (a no-ack get repeated, flagged redelivered, after a policy moved
/// the master).
#[test]
fn a_stopping_masters_last_no_ack_delivery_is_not_delivered_again() {
    let mut sim = Sim::with_disk(33, settings(SyncMode::Automatic, 4), true);
    sim.auto_ack = true;
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..3 {
        sim.publish();
    }
    sim.quiesce();
    sim.fetch();
    {
        let now = sim.now_ms;
        sim.nodes[0].replica.stop(now);
    }
    sim.drive(0);
    sim.quiesce();
    assert_eq!(sim.nodes[0].replica.role(), Role::Stopped);
    sim.crash(0);
    sim.quiesce();
    let m = sim.master().expect("promoted on shutdown");
    assert_eq!(
        sim.nodes[m].replica.stats().unwrap().ready,
        2,
        "the delivered message is gone"
    );
    sim.check_end();
}

/// A stopping master whose ring does not confirm in time nacks the rest
/// and stops.
#[test]
fn a_stopping_master_that_cannot_drain_nacks_after_the_limit() {
    let mut sim = Sim::new(32, settings(SyncMode::Automatic, 4));
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..3 {
        sim.publish();
    }
    {
        let now = sim.now_ms;
        sim.nodes[0].replica.stop(now);
    }
    sim.drive(0);
    assert_eq!(sim.nodes[0].replica.role(), Role::Master, "draining");
    // Nothing reaches the ring; the drain runs out.
    let now = sim.now_ms;
    sim.nodes[0].replica.tick(now + 4_999);
    assert_eq!(sim.nodes[0].replica.role(), Role::Master);
    sim.nodes[0].replica.tick(now + 5_000);
    sim.drive(0);
    assert_eq!(sim.nodes[0].replica.role(), Role::Stopped);
    assert_eq!(sim.check.nacked.len(), 3);
}

#[test]
fn switching_to_automatic_syncs_an_unsynchronised_mirror() {
    let mut sim = Sim::unsynchronised_mirror(8, 7);
    assert!(sim.record.synchronised.is_empty());
    let m = sim.master().unwrap();
    sim.nodes[m]
        .replica
        .set_settings(settings(SyncMode::Automatic, 2));
    sim.drive(m);
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.check_end();
}

#[test]
fn a_mirror_of_an_empty_queue_is_synchronised_at_once_even_in_manual_mode() {
    let mut sim = Sim::new(9, settings(SyncMode::Manual, 2));
    sim.add_node(false);
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.mirrors, vec!["n1".to_owned()]);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.check_end();
}

/// RabbitMQ's "natural" synchronisation, as far as Warren has it: in
/// manual mode, a mirror that joined a queue holding messages is
/// synchronised once its consumers have drained the queue (delivered
/// messages acked), on the master's next tick.
#[test]
fn a_manual_mode_mirror_is_synchronised_once_the_queue_is_drained() {
    let mut sim = Sim::unsynchronised_mirror(11, 3);
    for _ in 0..3 {
        sim.fetch();
    }
    sim.quiesce();
    assert_eq!(sim.check.unacked.len(), 3);
    sim.tick_all(100);
    sim.quiesce();
    assert!(
        !sim.nodes[1].replica.status().synchronised,
        "delivered, not yet acked: the mirror lacks them"
    );
    while !sim.check.unacked.is_empty() {
        sim.settle_delivery(false);
    }
    sim.quiesce();
    sim.tick_all(100);
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    sim.check_end();
}

/// The oldest synchronised mirror is not always the master's right
/// neighbour (the one that inherits its messages). It must not take over
/// before every message of the dead master that any survivor holds has
/// reached it, or the survivors would diverge.
#[test]
fn promotion_waits_for_the_dead_masters_messages() {
    let mut sim = Sim::new(10, settings(SyncMode::Automatic, 4));
    sim.add_node(false); // n1: the oldest mirror
    sim.quiesce();
    let master = sim.nodes[0].member.id();
    // n2 and n3 are spliced in right after the master: ring n0, n3, n2, n1.
    sim.start_after("n2".into(), false, Some(master));
    sim.quiesce();
    sim.start_after("n3".into(), false, Some(master));
    sim.quiesce();
    assert_eq!(sim.synced_alive_mirrors().len(), 3);
    let ring: Vec<MemberId> = sim.auth.current_now(RING).alive().collect();
    let ids: Vec<MemberId> = [0, 3, 2, 1]
        .iter()
        .map(|&i| sim.nodes[i].member.id())
        .collect();
    assert_eq!(ring, ids);
    for _ in 0..3 {
        sim.publish();
    }
    sim.nodes[0].replica.flush();
    sim.drive(0);
    sim.nodes[0].member.flush();
    sim.drive(0);
    // The batch reaches n3 and n2, not n1; then the master dies.
    assert!(sim.deliver_between(0, 3));
    sim.nodes[3].member.flush();
    sim.drive(3);
    assert!(sim.deliver_between(3, 2));
    sim.crash(0);
    while !sim.proposals.is_empty() {
        sim.settle_proposal();
    }
    sim.quiesce();
    let m = sim.master().expect("promoted");
    assert_eq!(sim.nodes[m].name, "n1", "the oldest synchronised mirror");
    assert_eq!(
        sim.check.confirmed.len(),
        3,
        "the new master holds them all"
    );
    sim.check_end();
}

#[test]
fn a_master_cut_off_from_the_majority_nacks_at_once_and_refuses_until_it_is_back() {
    let mut sim = Sim::new(7, settings(SyncMode::Automatic, 16));
    sim.add_synchronised_mirrors(2);
    for _ in 0..10 {
        sim.publish();
    }
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 10);
    // Publishes the ring has not confirmed yet when the node finds itself
    // in a minority are nacked at once, not left waiting for a heal.
    for _ in 0..5 {
        sim.publish();
    }
    assert_eq!(sim.check.pending.len(), 5);
    let m = sim.master().expect("a master");
    sim.nodes[m].replica.set_isolated(true);
    sim.drive(m);
    assert!(sim.check.pending.is_empty());
    assert_eq!(sim.check.nacked.len(), 5);
    // While cut off, new publishes are refused.
    let id = PublishId {
        publisher: 1,
        seq: 1_000,
    };
    let msg = NewMessage::new(1_000, b"refused".to_vec(), false);
    assert!(matches!(
        sim.nodes[m].replica.publish(0, id, msg),
        Err(MirrorError::Isolated)
    ));
    // The majority back: publishes are confirmed again.
    sim.nodes[m].replica.set_isolated(false);
    for _ in 0..5 {
        sim.publish();
    }
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 15);
    sim.check_end();
}

#[test]
fn a_master_whose_disk_fails_nacks_and_hands_over_to_a_synchronised_mirror() {
    let mut sim = Sim::without_nodes(22, settings(SyncMode::Automatic, 4), true);
    let disk = MemStorage::new();
    sim.mem.insert("n0".into(), disk.clone());
    sim.add_node(true);
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..4 {
        sim.publish();
    }
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 4);
    assert!(sim.nodes[1].replica.status().synchronised);
    // The master's disk fails: what it has not confirmed is nacked, and it
    // stops as on a shutdown instead of taking publishes it cannot confirm.
    disk.set_failing(true);
    for _ in 0..3 {
        sim.publish();
    }
    sim.sync_disk(0);
    sim.flush_all();
    assert!(sim.nodes[0].replica.storage_failed());
    assert_eq!(sim.nodes[0].replica.role(), Role::Stopped);
    assert_eq!(sim.check.nacked.len(), 3, "the unconfirmed publishes");
    // Its driver leaves the ring: the synchronised mirror takes over.
    sim.crash(0);
    sim.quiesce();
    let m = sim.master().expect("a new master");
    assert_eq!(sim.nodes[m].name, "n1");
    assert!(sim.nodes[m].replica.stats().unwrap().ready >= 4);
    sim.check_end();
}

#[test]
fn a_mirror_whose_writes_fail_leaves_the_synchronised_set_until_a_sync() {
    let mut sim = Sim::with_disk(21, settings(SyncMode::Manual, 4), true);
    let disk = MemStorage::new();
    sim.mem.insert("n1".into(), disk.clone());
    sim.add_node(false);
    sim.quiesce();
    for _ in 0..5 {
        sim.publish();
    }
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    // Its disk fails: it cannot hold what the master holds.
    disk.set_failing(true);
    for _ in 0..3 {
        sim.publish();
    }
    sim.quiesce();
    assert!(
        !sim.nodes[1].replica.status().synchronised,
        "a mirror that failed a write is not synchronised"
    );
    assert!(sim.record.synchronised.is_empty(), "nor in the record");
    assert!(
        sim.nodes[1].replica.stats().is_none(),
        "its state is dropped"
    );
    // The disk is back: sync_queue makes it a synchronised copy again.
    disk.set_failing(false);
    let m = sim.master().expect("a master");
    sim.nodes[m].replica.sync().expect("a sync starts");
    sim.drive(m);
    sim.quiesce();
    assert!(sim.nodes[1].replica.status().synchronised);
    assert_eq!(sim.record.synchronised, vec!["n1".to_owned()]);
    assert_eq!(sim.nodes[1].replica.digest(), sim.nodes[m].replica.digest());
    sim.check_end();
}

/// A mirror that joins a queue holding messages (a sync with a backlog)
/// holds later confirms back until its own fsync, as one that joined an
/// empty queue does.
#[test]
fn a_mirror_synchronised_from_a_backlog_holds_confirms_until_its_fsync() {
    let mut sim = Sim::with_disk(3, settings(SyncMode::Automatic, 16), true);
    for _ in 0..40 {
        sim.publish();
    }
    sim.quiesce();
    assert_eq!(sim.check.confirmed.len(), 40);
    sim.add_synchronised_mirrors(1);
    five_confirms_wait_for_the_mirrors_fsync(&mut sim);
}

/// Five publishes are confirmed once the one synchronised mirror has synced
/// its disk, not before (the master's disk alone is not enough).
fn five_confirms_wait_for_the_mirrors_fsync(sim: &mut Sim) {
    let confirmed = sim.check.confirmed.len();
    for _ in 0..5 {
        sim.publish();
    }
    sim.ring_rounds();
    let m = sim.master().unwrap();
    sim.sync_disk(m);
    sim.ring_rounds();
    assert_eq!(
        sim.check.confirmed.len(),
        confirmed,
        "on the master's disk only, not on the new mirror's"
    );
    let mirror = sim.synced_alive_mirrors()[0];
    sim.sync_disk(mirror);
    sim.ring_rounds();
    assert_eq!(sim.check.confirmed.len(), confirmed + 5);
    sim.quiesce();
    sim.check_end();
}

/// The same when publishes, deliveries and acks go on while the mirror
/// receives the backlog (ops buffered during the sync, applied after it).
#[test]
fn a_mirror_synchronised_under_traffic_holds_confirms_until_its_fsync() {
    let mut sim = Sim::with_disk(3, settings(SyncMode::Automatic, 4), true);
    for _ in 0..40 {
        sim.publish();
    }
    sim.quiesce();
    sim.add_node(false);
    for _ in 0..200 {
        sim.publish();
        sim.fetch();
        sim.settle_delivery(false);
        sim.flush_all();
        for _ in 0..20 {
            sim.deliver_frame();
        }
        for i in 0..sim.nodes.len() {
            sim.sync_disk(i);
        }
    }
    sim.quiesce();
    assert_eq!(sim.synced_alive_mirrors().len(), 1);
    five_confirms_wait_for_the_mirrors_fsync(&mut sim);
}
