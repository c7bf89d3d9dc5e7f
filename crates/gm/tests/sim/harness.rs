//! A deterministic simulator for GM rings: N members, one thread, virtual
//! time, a seeded RNG, a network of per-link FIFO queues with delays, cuts
//! and crashes, an in-process view authority, and a checker that records the
//! history and checks the crate's guarantees during and after every run.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_gm::{
    Action, Config, Frame, InMemoryAuthority, Member, MemberId, Phase, Seq, View, ViewChange,
    ViewVersion,
};

const RING: &str = "sim";

/// Virtual time in microseconds.
type Time = u64;

/// Knobs of one simulated run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Members at the start.
    pub initial_members: usize,
    /// How long the chaos phase (traffic and faults) lasts.
    pub chaos_time: Time,
    /// Mean gap between two operations (bursts of broadcasts) in the chaos phase.
    pub op_gap: Time,
    /// Faults to inject at random times of the chaos phase.
    pub faults: Vec<Fault>,
    /// The member's batch size.
    pub batch_bytes_max: usize,
}

/// A fault the simulator injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A member broadcasts a burst and crashes before flushing it.
    CrashSenderMidBroadcast,
    /// Two neighbours crash at once.
    CrashNeighbours,
    /// A member joins and crashes shortly after.
    CrashJoiner,
    /// One or two members join (during traffic).
    Join,
    /// A link is cut and heals later (maybe after the failure detector fired).
    Partition,
    /// Any member crashes.
    Crash,
}

impl SimConfig {
    /// A random configuration drawn from `rng`.
    pub fn random(rng: &mut StdRng) -> Self {
        let kinds = [
            Fault::CrashSenderMidBroadcast,
            Fault::CrashNeighbours,
            Fault::CrashJoiner,
            Fault::Join,
            Fault::Partition,
            Fault::Crash,
        ];
        let n = rng.random_range(0..=4);
        Self {
            initial_members: rng.random_range(2..=6),
            chaos_time: 30_000,
            op_gap: rng.random_range(40..=200),
            faults: (0..n)
                .map(|_| kinds[rng.random_range(0..kinds.len())])
                .collect(),
            batch_bytes_max: [256, 2048, 64 * 1024][rng.random_range(0..3)],
        }
    }
}

#[derive(Debug)]
enum Event {
    Frame {
        from: MemberId,
        to: MemberId,
        epoch: u64,
        frame: Frame,
    },
    View(MemberId),
    Tick(MemberId),
    Op,
    Fault(Fault),
    Crash(MemberId),
    Detect(MemberId),
    Erase(MemberId),
    Heal(MemberId, MemberId),
    Join,
}

struct Node {
    member: Member,
    crashed: bool,
    /// Frames this member sent that are still delivered after its crash: those due by then.
    crash_cutoff: Time,
    tick_scheduled: bool,
}

#[derive(Default)]
struct Link {
    last_due: Time,
    epoch: u64,
}

/// The recorded history and what the checker knows.
#[derive(Default)]
struct History {
    /// Per publisher: the broadcast view of each message, by `seq - 1`.
    broadcasts: BTreeMap<MemberId, Vec<ViewVersion>>,
    /// Last delivered seq, per (member, publisher).
    delivered: BTreeMap<(MemberId, MemberId), Seq>,
    joined_at: BTreeMap<MemberId, ViewVersion>,
    confirms_checked: BTreeMap<MemberId, Seq>,
    join_failures: usize,
    false_removals: usize,
    erasures: usize,
    deliveries: u64,
    trace_hash: u64,
    violations: Vec<String>,
}

impl History {
    fn hash(&mut self, words: &[u64]) {
        for &w in words {
            // FNV-1a over the words.
            self.trace_hash ^= w;
            self.trace_hash = self.trace_hash.wrapping_mul(0x100_0000_01b3);
        }
    }

    fn first_eligible(&self, publisher: MemberId, joined_at: ViewVersion) -> Option<Seq> {
        self.broadcasts
            .get(&publisher)?
            .iter()
            .position(|&v| v >= joined_at)
            .map(|i| i as Seq + 1)
    }
}

/// What a finished run reports.
#[derive(Debug)]
pub struct Outcome {
    /// A hash of the whole history (for determinism checks).
    pub trace_hash: u64,
    /// Broadcasts made.
    pub broadcasts: u64,
    /// Deliveries made.
    pub deliveries: u64,
    /// Members that ever existed.
    pub members: usize,
    /// Members that crashed or were removed.
    pub casualties: usize,
    /// The final view version.
    pub final_version: ViewVersion,
    /// Joiners that lost their left neighbour before getting their state.
    pub join_failures: usize,
    /// Members removed from the view while alive (a partition outlasted the detector).
    pub false_removals: usize,
    /// Dead aliases erased.
    pub erasures: usize,
}

/// One simulated run.
pub struct Sim {
    seed: u64,
    cfg: SimConfig,
    rng: StdRng,
    now: Time,
    next_event: u64,
    queue: BinaryHeap<Reverse<(Time, u64)>>,
    events: BTreeMap<u64, Event>,
    auth: InMemoryAuthority,
    nodes: BTreeMap<MemberId, Node>,
    links: BTreeMap<(MemberId, MemberId), Link>,
    cuts: BTreeSet<(MemberId, MemberId)>,
    next_id: u64,
    chaos: bool,
    hist: History,
    /// With `GM_TRACE=<file>`, every event is written there (for debugging a seed).
    trace: Option<String>,
}

fn payload(publisher: MemberId, seq: Seq, pad: usize) -> Bytes {
    let mut v = Vec::with_capacity(16 + pad);
    v.extend_from_slice(&publisher.0.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.resize(16 + pad, 0xab);
    Bytes::from(v)
}

impl Sim {
    /// A run from `seed` with a configuration drawn from the same seed.
    pub fn from_seed(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let cfg = SimConfig::random(&mut rng);
        Self::new(seed, cfg)
    }

    /// A run from `seed` with the given configuration.
    pub fn new(seed: u64, cfg: SimConfig) -> Self {
        Self {
            seed,
            rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            cfg,
            now: 0,
            next_event: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            auth: InMemoryAuthority::new(),
            nodes: BTreeMap::new(),
            links: BTreeMap::new(),
            cuts: BTreeSet::new(),
            next_id: 1,
            chaos: true,
            trace: std::env::var_os("GM_TRACE").map(|_| String::new()),
            hist: History {
                trace_hash: 0xcbf2_9ce4_8422_2325,
                ..History::default()
            },
        }
    }

    fn log(&mut self, what: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            let line = what();
            let _ = writeln!(t, "{:>8} {line}", self.now);
        }
    }

    fn schedule(&mut self, at: Time, event: Event) {
        let id = self.next_event;
        self.next_event += 1;
        self.queue.push(Reverse((at, id)));
        self.events.insert(id, event);
    }

    fn violation(&mut self, what: String) {
        if self.hist.violations.len() < 20 {
            self.hist
                .violations
                .push(format!("t={}us: {what}", self.now));
        }
    }

    fn view(&self) -> View {
        self.auth.current_now(RING)
    }

    fn live(&self, id: MemberId) -> bool {
        self.nodes
            .get(&id)
            .is_some_and(|n| !n.crashed && n.member.phase() != Phase::Removed)
    }

    /// Members alive in the authority's view and not crashed.
    fn live_in_view(&self) -> Vec<MemberId> {
        self.view().alive().filter(|&m| self.live(m)).collect()
    }

    fn ready_live(&self) -> Vec<MemberId> {
        self.live_in_view()
            .into_iter()
            .filter(|m| self.nodes[m].member.phase() == Phase::Ready)
            .collect()
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            None
        } else {
            Some(items[self.rng.random_range(0..items.len())])
        }
    }

    fn commit(&mut self, change: ViewChange) -> bool {
        match self.auth.propose_now(RING, &change) {
            Ok(view) => {
                self.hist.hash(&[0xee, view.version]);
                self.log(|| {
                    let entries: Vec<String> = view
                        .entries
                        .iter()
                        .map(|e| format!("{}{}", e.id, if e.alive { "" } else { "(dead)" }))
                        .collect();
                    format!("commit v{} {change:?}: {}", view.version, entries.join(" "))
                });
                if let ViewChange::Join { member, .. } = change {
                    self.hist.joined_at.insert(member, view.version);
                }
                let targets: Vec<MemberId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| !n.crashed)
                    .map(|(&id, _)| id)
                    .collect();
                for id in targets {
                    let delay = self.rng.random_range(0..=2_000);
                    self.schedule(self.now + delay, Event::View(id));
                }
                true
            }
            Err(_) => false,
        }
    }

    fn join(&mut self) -> MemberId {
        let id = MemberId(self.next_id);
        self.next_id += 1;
        let config = Config {
            batch_bytes_max: self.cfg.batch_bytes_max,
            ..Config::default()
        };
        self.nodes.insert(
            id,
            Node {
                member: Member::new(id, config),
                crashed: false,
                crash_cutoff: 0,
                tick_scheduled: false,
            },
        );
        let alive = self.live_in_view();
        let after = self.pick(&alive);
        let after = after.or_else(|| self.view().alive().next());
        let node = warren_wire::NodeName::new(format!("n{}@sim", id.0)).expect("node name");
        self.commit(ViewChange::Join {
            member: id,
            after,
            node,
        });
        id
    }

    fn crash(&mut self, id: MemberId) {
        let now = self.now;
        let cutoff = now + self.rng.random_range(0..=300);
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if node.crashed {
            return;
        }
        node.crashed = true;
        node.crash_cutoff = cutoff;
        self.hist.hash(&[0xc0, id.0]);
        self.log(|| format!("crash {id} (frames due by {cutoff} still arrive)"));
        let delay = self.rng.random_range(2_000..=8_000);
        self.schedule(now + delay, Event::Detect(id));
    }

    /// May `n` more members crash and still leave the ring with someone holding state?
    fn can_lose(&self, n: usize) -> bool {
        self.ready_live().len() > n && self.live_in_view().len() > n + 1
    }

    fn broadcast_burst(&mut self, id: MemberId, count: usize) {
        for _ in 0..count {
            let node = self.nodes.get_mut(&id).expect("node");
            let seq = node.member.last_broadcast() + 1;
            let view = node.member.view().version;
            let pad = if self.rng.random_bool(0.05) {
                self.rng.random_range(0..2_000)
            } else {
                self.rng.random_range(0..16)
            };
            let node = self.nodes.get_mut(&id).expect("node");
            match node.member.broadcast(payload(id, seq, pad)) {
                Ok(s) => {
                    if s != seq {
                        self.violation(format!("{id} broadcast got seq {s}, expected {seq}"));
                    }
                    self.hist.broadcasts.entry(id).or_default().push(view);
                    self.hist.hash(&[0xb0, id.0, s]);
                }
                Err(_) => break,
            }
        }
    }

    fn take_actions(&mut self, id: MemberId) -> Vec<Action> {
        self.nodes
            .get_mut(&id)
            .map(|n| n.member.drain_actions().collect())
            .unwrap_or_default()
    }

    /// Runs the member's actions after an input.
    fn drain(&mut self, id: MemberId) {
        for action in self.take_actions(id) {
            match action {
                Action::Send { to, frame } => self.send(id, to, frame),
                Action::Deliver {
                    publisher,
                    seq,
                    payload,
                } => self.check_delivery(id, publisher, seq, &payload),
                Action::Confirm { up_to } => self.check_confirm(id, up_to),
                Action::ViewInstalled { version } => {
                    self.hist.hash(&[0xa1, id.0, version]);
                    self.log(|| format!("{id} installs v{version}"));
                }
                Action::NeedView { .. } => {
                    let delay = self.rng.random_range(10..=300);
                    self.schedule(self.now + delay, Event::View(id));
                }
                Action::Erase { dead } => {
                    let delay = self.rng.random_range(10..=1_000);
                    self.schedule(self.now + delay, Event::Erase(dead));
                }
                Action::JoinFailed => {
                    self.hist.join_failures += 1;
                    self.hist.hash(&[0xf0, id.0]);
                    self.commit(ViewChange::Remove(id));
                    if self.chaos {
                        let delay = self.rng.random_range(100..=2_000);
                        self.schedule(self.now + delay, Event::Join);
                    }
                }
                Action::Removed => {
                    self.hist.hash(&[0xf1, id.0]);
                    if !self.nodes[&id].crashed {
                        // Removed while alive: it restarts under a new id.
                        self.hist.false_removals += 1;
                        if self.chaos {
                            let delay = self.rng.random_range(100..=2_000);
                            self.schedule(self.now + delay, Event::Join);
                        }
                    }
                }
            }
        }
        // Flush now, or leave the batch for the next tick.
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if node.crashed || node.member.phase() == Phase::Removed {
            return;
        }
        if self.rng.random_bool(0.5) {
            node.member.flush();
            self.drain_sends_only(id);
        } else if !node.tick_scheduled {
            node.tick_scheduled = true;
            let delay = self.rng.random_range(50..=400);
            self.schedule(self.now + delay, Event::Tick(id));
        }
    }

    fn drain_sends_only(&mut self, id: MemberId) {
        for action in self.take_actions(id) {
            match action {
                Action::Send { to, frame } => self.send(id, to, frame),
                Action::Confirm { up_to } => self.check_confirm(id, up_to),
                Action::Erase { dead } => {
                    let delay = self.rng.random_range(10..=1_000);
                    self.schedule(self.now + delay, Event::Erase(dead));
                }
                other => self.violation(format!("{id}: unexpected {other:?} on flush")),
            }
        }
    }

    fn link_key(a: MemberId, b: MemberId) -> (MemberId, MemberId) {
        if a < b { (a, b) } else { (b, a) }
    }

    fn send(&mut self, from: MemberId, to: MemberId, frame: Frame) {
        if self.cuts.contains(&Self::link_key(from, to)) {
            return;
        }
        // Now and then through the real codec.
        let frame = if self.rng.random_bool(0.05) {
            let bytes = frame.encode().expect("encode");
            Frame::decode(&bytes).expect("decode")
        } else {
            frame
        };
        let delay = if self.rng.random_bool(0.02) {
            self.rng.random_range(1_000..=5_000)
        } else {
            self.rng.random_range(10..=400)
        };
        let link = self.links.entry((from, to)).or_default();
        let due = (self.now + delay).max(link.last_due);
        link.last_due = due;
        let epoch = link.epoch;
        self.schedule(
            due,
            Event::Frame {
                from,
                to,
                epoch,
                frame,
            },
        );
    }

    fn check_delivery(&mut self, m: MemberId, p: MemberId, seq: Seq, payload: &Bytes) {
        self.hist.deliveries += 1;
        self.log(|| format!("{m} delivers {p}#{seq}"));
        self.hist.hash(&[0xd0, m.0, p.0, seq]);
        let views = self.hist.broadcasts.get(&p);
        let Some(&view) = views.and_then(|v| v.get(seq as usize - 1)) else {
            self.violation(format!("{m} delivered {p}#{seq}, never broadcast"));
            return;
        };
        if payload.len() < 16
            || payload[..8] != p.0.to_le_bytes()
            || payload[8..16] != seq.to_le_bytes()
        {
            self.violation(format!("{m} delivered {p}#{seq} with a wrong payload"));
        }
        let joined = self.hist.joined_at.get(&m).copied().unwrap_or(0);
        if m != p && view < joined {
            self.violation(format!(
                "{m} (joined at v{joined}) delivered {p}#{seq} broadcast at v{view}, before its join"
            ));
        }
        let prev = self.hist.delivered.get(&(m, p)).copied().unwrap_or(0);
        let expected = if prev == 0 && m != p {
            self.hist.first_eligible(p, joined).unwrap_or(0)
        } else {
            prev + 1
        };
        if seq != expected {
            self.violation(format!(
                "{m} delivered {p}#{seq} after #{prev}; expected #{expected} (duplicate, gap or reorder)"
            ));
        }
        self.hist.delivered.insert((m, p), seq.max(prev));
    }

    fn check_confirm(&mut self, p: MemberId, up_to: Seq) {
        self.hist.hash(&[0xcc, p.0, up_to]);
        let from = self.hist.confirms_checked.get(&p).copied().unwrap_or(0);
        let broadcast = self.hist.broadcasts.get(&p).map_or(0, |v| v.len() as Seq);
        if up_to <= from || up_to > broadcast {
            self.violation(format!(
                "{p} confirmed up to #{up_to}: previous confirm #{from}, broadcast #{broadcast}"
            ));
            return;
        }
        self.hist.confirms_checked.insert(p, up_to);
        let view = self.nodes[&p].member.view().clone();
        let mut missing = Vec::new();
        for m in view.alive().filter(|&m| m != p) {
            let joined = self.hist.joined_at.get(&m).copied().unwrap_or(0);
            let Some(first) = self.hist.first_eligible(p, joined) else {
                continue;
            };
            let need = up_to;
            if first > need {
                continue;
            }
            let got = self.hist.delivered.get(&(m, p)).copied().unwrap_or(0);
            if got < need {
                missing.push(format!("{m} has #{got}"));
            }
        }
        if !missing.is_empty() {
            self.violation(format!(
                "{p} confirmed #{up_to} in v{} but {}",
                view.version,
                missing.join(", ")
            ));
        }
    }

    fn step(&mut self, event: Event) {
        match event {
            Event::Frame {
                from,
                to,
                epoch,
                frame,
            } => {
                let link_ok = self
                    .links
                    .get(&(from, to))
                    .is_some_and(|l| l.epoch == epoch)
                    && !self.cuts.contains(&Self::link_key(from, to));
                let sender_ok = self
                    .nodes
                    .get(&from)
                    .is_some_and(|n| !n.crashed || self.now <= n.crash_cutoff);
                let Some(node) = self.nodes.get_mut(&to) else {
                    return;
                };
                if node.crashed || !link_ok || !sender_ok {
                    self.log(|| format!("lost {from}->{to} v{} {:?}", frame.view, frame.kind));
                    return;
                }
                if self.trace.is_some() {
                    let streams: Vec<String> = frame
                        .streams
                        .iter()
                        .map(|b| {
                            let (lo, hi) = (
                                b.pubs.first().map_or(0, |p| p.seq),
                                b.pubs.last().map_or(0, |p| p.seq),
                            );
                            format!("{}[{lo}..{hi} ack {}]", b.publisher, b.ack)
                        })
                        .collect();
                    let line = format!(
                        "frame {from}->{to} v{} {:?} {}",
                        frame.view,
                        frame.kind,
                        streams.join(" ")
                    );
                    self.log(|| line);
                }
                let Some(node) = self.nodes.get_mut(&to) else {
                    return;
                };
                node.member.handle_frame(frame);
                self.drain(to);
            }
            Event::View(id) => {
                let view = self.view();
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                if node.crashed {
                    return;
                }
                node.member.handle_view(view);
                self.drain(id);
            }
            Event::Tick(id) => {
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                node.tick_scheduled = false;
                if node.crashed {
                    return;
                }
                node.member.handle_tick();
                self.drain_sends_only(id);
            }
            Event::Op => {
                if !self.chaos {
                    return;
                }
                let candidates: Vec<MemberId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| {
                        !n.crashed && matches!(n.member.phase(), Phase::Ready | Phase::Joining)
                    })
                    .map(|(&id, _)| id)
                    .collect();
                if let Some(id) = self.pick(&candidates) {
                    let count = self.rng.random_range(1..=12);
                    self.broadcast_burst(id, count);
                    self.drain(id);
                }
                let gap = self.rng.random_range(1..=2 * self.cfg.op_gap);
                if self.now + gap < self.cfg.chaos_time {
                    self.schedule(self.now + gap, Event::Op);
                }
            }
            Event::Fault(fault) => self.inject(fault),
            Event::Crash(id) => {
                if self.live(id) && self.can_lose(1) {
                    self.crash(id);
                }
            }
            Event::Detect(id) => {
                // A live member is suspected (a partition) only if the ring keeps state.
                let crashed = self.nodes.get(&id).is_some_and(|n| n.crashed);
                if self.view().is_alive(id) && (crashed || self.can_lose(1)) {
                    self.commit(ViewChange::Remove(id));
                }
            }
            Event::Erase(dead) => {
                let view = self.view();
                if view.entry(dead).is_some_and(|e| !e.alive) {
                    self.hist.erasures += 1;
                    self.commit(ViewChange::Erase(dead));
                }
            }
            Event::Heal(a, b) => {
                self.cuts.remove(&Self::link_key(a, b));
                for (x, y) in [(a, b), (b, a)] {
                    if self.live(x) {
                        self.nodes
                            .get_mut(&x)
                            .expect("node")
                            .member
                            .handle_link_reset(y);
                        self.drain(x);
                    }
                }
            }
            Event::Join => {
                if self.live_in_view().len() < 8 {
                    self.join();
                }
            }
        }
    }

    fn inject(&mut self, fault: Fault) {
        self.hist.hash(&[0xfa, fault as u64]);
        match fault {
            Fault::CrashSenderMidBroadcast => {
                let ready = self.ready_live();
                if let Some(id) = self.pick(&ready)
                    && self.can_lose(1)
                {
                    {
                        let count = self.rng.random_range(1..=20);
                        self.broadcast_burst(id, count);
                        // Deliveries to itself happen; the batch never leaves.
                        for a in self.take_actions(id) {
                            if let Action::Deliver {
                                publisher,
                                seq,
                                payload,
                            } = a
                            {
                                self.check_delivery(id, publisher, seq, &payload);
                            }
                        }
                        self.crash(id);
                    }
                }
            }
            Fault::CrashNeighbours => {
                let alive = self.live_in_view();
                if let Some(a) = self.pick(&alive) {
                    let b = self.view().right_of(a).filter(|&b| b != a && self.live(b));
                    if let Some(b) = b
                        && self.can_lose(2)
                    {
                        self.crash(a);
                        self.crash(b);
                    }
                }
            }
            Fault::CrashJoiner => {
                let id = self.join();
                let delay = self.rng.random_range(0..=3_000);
                self.schedule(self.now + delay, Event::Crash(id));
            }
            Fault::Join => {
                let n = self.rng.random_range(1..=2);
                for _ in 0..n {
                    self.join();
                }
            }
            Fault::Partition => {
                let alive = self.live_in_view();
                if let Some(a) = self.pick(&alive) {
                    let b = self.view().right_of(a).filter(|&b| b != a);
                    if let Some(b) = b {
                        self.cuts.insert(Self::link_key(a, b));
                        for key in [(a, b), (b, a)] {
                            self.links.entry(key).or_default().epoch += 1;
                        }
                        let heal = self.rng.random_range(500..=12_000);
                        self.schedule(self.now + heal, Event::Heal(a, b));
                        if heal > 6_000 {
                            // The failure detector fires first: one side is removed.
                            let victim = if self.rng.random_bool(0.5) { a } else { b };
                            if self.can_lose(1) {
                                self.schedule(self.now + 6_000, Event::Detect(victim));
                            }
                        }
                    }
                }
            }
            Fault::Crash => {
                let alive = self.live_in_view();
                if let Some(id) = self.pick(&alive)
                    && self.can_lose(1)
                {
                    self.crash(id);
                }
            }
        }
    }

    /// Runs the chaos phase and the quiet phase, then checks the guarantees.
    pub fn run(&mut self) -> Result<Outcome, String> {
        for _ in 0..self.cfg.initial_members {
            self.join();
        }
        self.schedule(100, Event::Op);
        let faults = self.cfg.faults.clone();
        for fault in faults {
            let at = self.rng.random_range(1_000..self.cfg.chaos_time);
            self.schedule(at, Event::Fault(fault));
        }
        let mut steps: u64 = 0;
        while let Some(Reverse((at, id))) = self.queue.pop() {
            self.now = at;
            if self.chaos && at >= self.cfg.chaos_time {
                self.chaos = false;
            }
            let event = self.events.remove(&id).expect("event");
            self.step(event);
            steps += 1;
            if steps > 5_000_000 {
                self.violation("no quiescence after 5M steps (livelock?)".into());
                break;
            }
        }
        self.check_end();
        if let (Some(trace), Some(path)) = (&self.trace, std::env::var_os("GM_TRACE")) {
            let _ = std::fs::write(path, trace);
        }
        if self.hist.violations.is_empty() {
            Ok(Outcome {
                trace_hash: self.hist.trace_hash,
                broadcasts: self.hist.broadcasts.values().map(|v| v.len() as u64).sum(),
                deliveries: self.hist.deliveries,
                members: self.nodes.len(),
                casualties: self
                    .nodes
                    .values()
                    .filter(|n| n.crashed || n.member.phase() == Phase::Removed)
                    .count(),
                final_version: self.view().version,
                join_failures: self.hist.join_failures,
                false_removals: self.hist.false_removals,
                erasures: self.hist.erasures,
            })
        } else {
            let mut msg = format!(
                "GM simulation seed {} failed ({:?}):\n",
                self.seed, self.cfg
            );
            for v in &self.hist.violations {
                let _ = writeln!(msg, "  - {v}");
            }
            let _ = write!(
                msg,
                "replay: GM_SEED={} cargo test -p warren-gm --test sim sim_replay -- --nocapture",
                self.seed
            );
            Err(msg)
        }
    }

    fn check_end(&mut self) {
        let view = self.view();
        let survivors: Vec<MemberId> = self
            .nodes
            .iter()
            .filter(|(_, n)| !n.crashed && n.member.phase() != Phase::Removed)
            .map(|(&id, _)| id)
            .collect();
        for &m in &survivors {
            let member = &self.nodes[&m].member;
            let (phase, version, pending) =
                (member.phase(), member.view().version, member.pending_len());
            let (confirmed, broadcast) = (member.last_confirmed(), member.last_broadcast());
            if phase != Phase::Ready {
                self.violation(format!("{m} ends in {phase:?}"));
            }
            if version != view.version {
                self.violation(format!(
                    "{m} ends at v{version}, authority at v{}",
                    view.version
                ));
            }
            if pending != 0 {
                self.violation(format!("{m} ends with {pending} pending messages (leak)"));
            }
            if confirmed != broadcast {
                self.violation(format!("{m} confirmed #{confirmed} of #{broadcast}"));
            }
        }
        let alive: BTreeSet<MemberId> = view.alive().collect();
        if alive != survivors.iter().copied().collect::<BTreeSet<_>>() {
            self.violation(format!("view alive {alive:?} but survivors {survivors:?}"));
        }
        // Aliases are erased by their owner: a ring where everyone died keeps them.
        if let Some(dead) = view.entries.iter().find(|e| !e.alive)
            && !alive.is_empty()
        {
            self.violation(format!("alias {} never erased", dead.id));
        }
        let publishers: Vec<MemberId> = self.hist.broadcasts.keys().copied().collect();
        for p in publishers {
            let total = self.hist.broadcasts[&p].len() as Seq;
            let p_survives = survivors.contains(&p);
            let max_delivered = survivors
                .iter()
                .filter(|&&m| m != p)
                .map(|&m| self.hist.delivered.get(&(m, p)).copied().unwrap_or(0))
                .max()
                .unwrap_or(0);
            let expected_top = if p_survives { total } else { max_delivered };
            for &m in &survivors {
                if m == p {
                    continue;
                }
                let joined = self.hist.joined_at.get(&m).copied().unwrap_or(0);
                let got = self.hist.delivered.get(&(m, p)).copied().unwrap_or(0);
                let want = match self.hist.first_eligible(p, joined) {
                    Some(first) if first <= expected_top => expected_top,
                    _ => 0,
                };
                if got != want {
                    self.violation(format!(
                        "{m} (joined v{joined}) delivered {p} up to #{got}, expected #{want} ({p} {})",
                        if p_survives { "survives" } else { "died" }
                    ));
                }
            }
        }
    }
}
