//! A seeded simulation of the node's own mirror code: three in-process
//! nodes (`common`: a real broker each, the production `MirrorDriver`, the
//! forwarding links between the brokers), each on a current-thread runtime
//! with a paused clock that [`Net::step`] drives, over one `MemNetwork` and
//! one `MemMetadata`, the queues' logs in a `MemStorage` per node.
//!
//! Per seed, the queue `q` and its dead-letter queue `dlq` are mirrored on
//! every node (`ha-mode all`, automatic sync; `q`'s policy dead-letters to
//! `dlq`) and a seeded schedule mixes traffic with faults: persistent
//! publishes in confirm mode (every 25th carries a 6 MiB body, larger than
//! a ring broadcast batch, checked byte for byte when it comes back; a
//! quarter of the batches with a per-message TTL of 20–800 ms),
//! `basic.get`s from `q` and `dlq` and consumers of `q` whose deliveries
//! are acked, rejected with requeue or rejected without (dead-lettered),
//! through every node (a node that is not the master forwards to it). The
//! brokers run on the simulation's virtual clock, so expiries happen at
//! virtual times. Faults: node crashes and restarts
//! (the node's runtime shut down; half of them a power loss too: its
//! storage keeps only what was synced); storage faults (every write and
//! sync of a node fails for a while); network faults (a link cut both
//! ways, one direction blackholed, one link healed, all healed); and the
//! metadata's round trips slowed (0–80 ms a write or linearizable read, as
//! Raft's under load). Then everything heals, the cluster settles, and the
//! checker asks (of the same schedule with, besides, running nodes taken
//! for dead by the cluster too: their links to the others cut and the
//! others' failure detectors suspecting them, half of them still reaching
//! the metadata, half cut off from its majority as a partition cuts a Raft
//! node off (no majority, their view of it stale, their writes failing);
//! `seeded_faults_with_nodes_taken_for_dead_…`):
//!
//! - no confirmed message is lost: each was consumed (and acked) or is
//!   still in the queue (the schedule never kills a master while a disk
//!   fails or without a synchronised mirror up, and keeps at most one node
//!   down and one disk failing at a time);
//! - no message is delivered twice without `redelivered` (across a
//!   master's power loss too: its log then marks every message it recovers
//!   delivered, since the marks it had not synced are gone);
//! - what comes out of `dlq` died as its `x-death` says: `expired` only if
//!   it had a TTL, `rejected` only if a client rejected it (what expired
//!   or was rejected may be missing: dead-lettering from a classic queue is
//!   at most once, RabbitMQ's too);
//! - the broker never closes a client's channel;
//! - liveness: every publish settles, every get is answered, and a final
//!   publish and get through every node work, `dlq` drains; the replicas'
//!   digests of both queues agree.
//!
//! Storage faults: a mirror's disk fails at any time (but while a
//! promotion may be pending), a master's only while a synchronised mirror
//! is up. A master whose disk fails stops as on a clean shutdown (its
//! unconfirmed publishes nacked) and a synchronised mirror takes over; the
//! old master's node starts no replica until the record names the new
//! master, then rejoins as a mirror once its disk works. (With no
//! synchronised mirror the queue would wait for that node's restart,
//! which this schedule does not do.) No master is killed while a disk
//! fails.
//!
//! Seed 36 found a window: a restarted node's broker recovers its own copy
//! of the queue (a mirror's: stale) and served it to clients until the
//! reconciler's first pass pointed the queue at its master (a get handed
//! out a message consumed long before, without `redelivered`; a publish
//! could be confirmed into a store the replica then replaces). The driver
//! now points every queue at its master before it returns from
//! `MirrorDriver::start`, and the node opens its AMQP listener after that.
//!
//! Dead-lettering and expiry, added later, found two more: the broker
//! dead-lettered a message by looking up a copy it kept per message id, but
//! ids are only unique per node and a promoted master's messages carry the
//! old master's (seeds 13, 23 and 48: messages that were never rejected or
//! had no TTL came out of `dlq`, while still in `q`); the dropped message
//! now comes with its content from the queue itself. And a connection's
//! `basic.get` answered later (forwarded, or waiting for the ring) let its
//! next get, on another queue, be answered first (seed 1: a client took a
//! message of `dlq` for one of `q`); a client's input now waits for its
//! gets.
//!
//! CI runs [`CI_SEEDS`] and [`REGRESSION_SEEDS`], and [`CI_SEEDS`] with
//! nodes taken for dead. Replay one seed, with the nodes' logs (`info`, or
//! `RUST_LOG`), naming the test (a failure prints the command):
//!
//! ```text
//! WARREN_SIM_SEED=7 cargo nextest run -p warren-mirror-driver --test sim seeded_faults_lose --no-capture
//! ```
//!
//! `WARREN_SIM_SEEDS=1-200` runs a range instead (to hunt), naming every
//! seed that fails.
//!
//! Determinism: the schedule is a function of the seed, and virtual time
//! (the brokers' clock too) moves only with the steps, so a replay runs the
//! same actions at the same virtual times. It is not bit-for-bit: tokio's `select!` picks among
//! ready branches with a per-process random seed (fixing it needs
//! `tokio_unstable`), and the brokers keep some state in `HashMap`s, so a
//! replay may interleave some events differently and the schedule's
//! guards (which read the queue record) may then decide differently.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use common::{Client, DLQ, Got, Net, QUEUE, lock, name, queue_commands};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_cluster::Command;
use warren_mirror::Role;

/// The seeds every CI run simulates. Seed 9 among them fails with a bug
/// found here put back (a mirror whose log was poisoned kept counting as
/// synchronised), seed 1 with gets answered out of order.
const CI_SEEDS: &[u64] = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
/// Seeds that fail with a bug found here put back: 13, 23 and 48 (messages
/// dead-lettered by another message's id), 23 (a mirror whose sync
/// failed to install never asked again), 48 (a connection carried on past
/// frames a blackhole swallowed: confirmed messages lost), 66 (a mirror
/// learnt of a failed group commit only at its next one, and was promoted
/// meanwhile), 36 (a restarted mirror served the stale copy of the queue
/// its broker recovered until the reconciler's first pass), 13 and 34 (a
/// master whose disk failed stayed master and settled no publish), 250 (a
/// master whose disk failed, its synchronised mirror cut off and then
/// crashed, waited for ever for a restart of its node), 309 (a restarted
/// master served its recovered copy to another node's consumer before its
/// replica started, outside the ring; a mirror promoted later delivered
/// the same messages again without `redelivered`), 13 (a publish forwarded
/// to a master that stopped, then sent again by its origin to the next
/// master and passed on there by the old master's node too, was taken
/// twice: the old master's node now passes it on under the origin's
/// identity), 27 and 69 (the confirm of a publish a replica held already,
/// made while it was sent again, was lost: its origin waited for ever).
/// The hole a failed write left in a queue log is
/// `backing-queue`'s test `a_failed_sync_jobs_appends_are_written_by_the_next_one`.
/// (Seed numbers quoted by the commits of those fixes refer to earlier
/// versions of this schedule.)
const REGRESSION_SEEDS: &[u64] = &[13, 23, 27, 34, 36, 48, 66, 69, 250, 309];
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// Virtual time per step of the nodes.
const STEP: Duration = Duration::from_millis(2);
/// Schedule actions per seed.
const ACTIONS: usize = 150;

/// What the simulation checks, from the clients' side.
#[derive(Default)]
struct Checker {
    /// Seqs published (once each).
    published: u64,
    confirmed: BTreeSet<u64>,
    nacked: BTreeSet<u64>,
    /// Seqs delivered at least once.
    delivered: BTreeSet<u64>,
    /// Seqs acked by a consumer.
    consumed: BTreeSet<u64>,
    /// Per-message TTLs (ms) of the seqs published with one.
    ttl: BTreeMap<u64, u64>,
    /// Seqs rejected without requeue (dead-lettered).
    rejected: BTreeSet<u64>,
    /// Seqs taken from the dead-letter queue, with their `x-death` reason.
    dead: BTreeMap<u64, String>,
    violations: Vec<String>,
}

impl Checker {
    /// A delivery from `q`.
    fn delivered(&mut self, node: &str, g: &Got) {
        if !self.delivered.insert(g.seq) && !g.redelivered {
            self.violations.push(format!(
                "seq {} delivered again through {node} without the redelivered flag (x-death {:?})",
                g.seq, g.death
            ));
        }
    }

    /// A message taken from the dead-letter queue: it expired (it had a
    /// TTL) or was rejected, as its `x-death` says.
    fn dead_lettered(&mut self, node: &str, g: &Got) {
        let reason = g.death.clone().unwrap_or_default();
        let why = match reason.as_str() {
            "expired" => self.ttl.contains_key(&g.seq),
            "rejected" => self.rejected.contains(&g.seq),
            _ => false,
        };
        if !why {
            self.violations.push(format!(
                "seq {} dead-lettered through {node} with reason {reason:?} (ttl {:?}, rejected {})",
                g.seq,
                self.ttl.get(&g.seq),
                self.rejected.contains(&g.seq)
            ));
        }
        self.dead.insert(g.seq, reason);
    }
}

/// One client per node (on the node's broker; dropped when it dies).
struct SimClient {
    client: Client,
    /// `basic.get`s not answered yet, each from `q` (false) or the
    /// dead-letter queue (true).
    gets: std::collections::VecDeque<bool>,
    /// Whether it has a consumer.
    consuming: bool,
}

struct Sim {
    rng: StdRng,
    net: Net,
    clients: BTreeMap<String, SimClient>,
    next_seq: u64,
    check: Checker,
    /// The node down and when it restarts.
    dead: Option<(String, Duration)>,
    /// The node whose storage fails and when it recovers.
    failing: Option<(String, Duration)>,
    /// Network faults standing, and when they heal (all of them).
    net_faults: Option<Duration>,
    /// The running node the cluster takes for dead, when that ends, and
    /// whether it is cut off from the metadata's majority too.
    suspected: Option<(String, Duration, bool)>,
    /// Draws the suspicions, when the schedule has them: a stream of its
    /// own, so that a seed's other draws are those of the schedule without.
    suspicions: Option<StdRng>,
    /// What the schedule did, for the failure message.
    trace: Vec<String>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl Sim {
    fn new(seed: u64, suspicions: bool) -> Self {
        let mut net = Net::simulated(seed, 8);
        for n in NODES {
            net.start_now(n);
        }
        let mut sim = Self {
            rng: StdRng::seed_from_u64(seed),
            net,
            clients: BTreeMap::new(),
            next_seq: 1,
            check: Checker::default(),
            dead: None,
            failing: None,
            net_faults: None,
            suspected: None,
            suspicions: suspicions.then(|| StdRng::seed_from_u64(seed ^ 0x0053_5553_5045_4354)),
            trace: Vec::new(),
        };
        sim.net.step_until(
            "both mirrors synchronised",
            STEP,
            Duration::from_secs(30),
            |net| {
                [QUEUE, DLQ]
                    .into_iter()
                    .all(|queue| net.record_of(queue).synchronised.len() == 2)
            },
        );
        sim
    }

    fn note(&mut self, what: String) {
        let line = format!("[{} ms] {what}", ms(self.net.elapsed));
        tracing::info!("sim: {line}");
        self.trace.push(line);
    }

    fn up(&self) -> Vec<String> {
        self.net.nodes.keys().cloned().collect()
    }

    fn pick<T: Clone>(&mut self, from: &[T]) -> T {
        from[self.rng.random_range(0..from.len())].clone()
    }

    fn client(&mut self, node: &str) -> &mut SimClient {
        if !self.clients.contains_key(node) {
            let client = Client::connect(&self.net.nodes[node].broker);
            let c = SimClient {
                client,
                gets: Default::default(),
                consuming: false,
            };
            self.clients.insert(node.to_owned(), c);
        }
        self.clients.get_mut(node).unwrap()
    }

    /// Steps the nodes for `d`, handling what the clients receive.
    fn run(&mut self, d: Duration) {
        let until = self.net.elapsed + d;
        while self.net.elapsed < until {
            self.net.step(STEP);
            self.poll_clients();
            self.due_repairs();
        }
    }

    /// Reads every client's confirms, get answers and deliveries.
    fn poll_clients(&mut self) {
        let nodes: Vec<String> = self.clients.keys().cloned().collect();
        for n in nodes {
            loop {
                let c = self.clients.get_mut(&n).unwrap();
                let Some(answer) = c.client.take_get() else {
                    break;
                };
                let dead = c.gets.pop_front().unwrap_or_default();
                match answer {
                    Some(g) if dead => {
                        tracing::debug!(node = %n, seq = g.seq, tag = g.tag, "sim: dead letter");
                        self.check.dead_lettered(&n, &g);
                        self.clients.get_mut(&n).unwrap().client.ack(g.tag);
                    }
                    Some(g) => self.settle_delivery(&n, &g),
                    None => {}
                }
            }
            while let Some(g) = self.clients.get_mut(&n).unwrap().client.take_delivery() {
                self.settle_delivery(&n, &g);
            }
            let c = &self.clients[&n].client;
            self.check.confirmed.extend(c.acked.iter().copied());
            self.check.nacked.extend(c.nacked.iter().copied());
            if let Some(why) = c.closed() {
                let v = format!("the broker on {n} closed a client's channel: {why}");
                self.check.violations.push(v);
                self.clients.remove(&n);
            }
        }
    }

    /// A delivery through node `n` is acked (seven times in ten),
    /// rejected with requeue (two in ten) or rejected without (dead-lettered).
    fn settle_delivery(&mut self, n: &str, g: &Got) {
        self.check.delivered(n, g);
        let choice = self.rng.random_range(0..10);
        tracing::debug!(
            node = n,
            seq = g.seq,
            tag = g.tag,
            redelivered = g.redelivered,
            choice,
            "sim: delivery"
        );
        let c = &mut self.clients.get_mut(n).unwrap().client;
        match choice {
            0..7 => {
                c.ack(g.tag);
                self.check.consumed.insert(g.seq);
            }
            7..9 => c.requeue(g.tag),
            _ => {
                c.reject(g.tag);
                self.check.rejected.insert(g.seq);
            }
        }
    }

    /// Restarts the dead node, recovers the failing disk and heals the
    /// network when their time has come.
    fn due_repairs(&mut self) {
        let now = self.net.elapsed;
        if let Some((n, at)) = self.dead.clone()
            && at <= now
        {
            self.restart(&n);
        }
        if let Some((n, at)) = self.failing.clone()
            && at <= now
        {
            self.disk_recovers(&n);
        }
        if self.net_faults.is_some_and(|at| at <= now) {
            self.heal_network();
        }
        if self.suspected.as_ref().is_some_and(|(_, at, _)| *at <= now) {
            self.clear_suspicion();
        }
    }

    /// The cluster takes a running node for dead (a false suspicion, or a
    /// cut its failure detectors saw first): its links to the others are
    /// cut and the others' detectors suspect it; half the time it is cut
    /// off from the metadata's majority too (`Net::cut_off`), else it still
    /// reads and writes the metadata.
    fn suspect(&mut self) {
        let up = self.up();
        let Some(rng) = self.suspicions.as_mut() else {
            return;
        };
        let n = up[rng.random_range(0..up.len())].clone();
        let until = self.net.elapsed + Duration::from_millis(rng.random_range(200..2_000));
        let isolated = rng.random_bool(0.5);
        self.note(format!(
            "the cluster takes {n} for dead until {} ms{}",
            ms(until),
            if isolated {
                ", cut off from the metadata too"
            } else {
                ""
            }
        ));
        if isolated {
            self.net.cut_off(&n, true);
        }
        for other in NODES.iter().filter(|o| **o != n) {
            self.net.mem.cut(&name(&n), &name(other));
        }
        let mut running = self.net.meta.up_now();
        running.remove(&name(&n));
        self.net.meta.set_up(running);
        self.suspected = Some((n, until, isolated));
    }

    /// The suspicion ends: the node's links heal and, if it still runs,
    /// the cluster sees it up again.
    fn clear_suspicion(&mut self) {
        let Some((n, _, isolated)) = self.suspected.take() else {
            return;
        };
        if isolated {
            self.net.cut_off(&n, false);
        }
        self.note(format!("the cluster sees {n} again"));
        for other in NODES.iter().filter(|o| **o != n) {
            self.net.mem.heal_link(&name(&n), &name(other));
        }
        if self.net.nodes.contains_key(&n) {
            let mut running = self.net.meta.up_now();
            running.insert(name(&n));
            self.net.meta.set_up(running);
        }
    }

    fn restart(&mut self, n: &str) {
        self.dead = None;
        self.note(format!("restart {n}"));
        self.net.start_now(n);
    }

    fn disk_recovers(&mut self, n: &str) {
        self.failing = None;
        self.note(format!("the disk of {n} works again"));
        self.net.storage[n].set_failing(false);
    }

    fn heal_network(&mut self) {
        self.net_faults = None;
        self.note("heal the network".into());
        self.net.mem.heal();
    }

    /// One action of the schedule.
    fn act(&mut self) {
        // One node-level fault at a time: no suspicion while a node is
        // down or a disk fails, and no crash during one.
        if self.suspected.is_none()
            && self.dead.is_none()
            && self.failing.is_none()
            && self
                .suspicions
                .as_mut()
                .is_some_and(|r| r.random_bool(0.02))
        {
            self.suspect();
        }
        let up = self.up();
        match self.rng.random_range(0..100) {
            0..38 => {
                let n = self.pick(&up);
                let k = self.rng.random_range(1..=8);
                let first = self.next_seq;
                self.next_seq += k;
                self.check.published += k;
                // A quarter of the batches expire (dead-lettered to `dlq`).
                let ttl = self
                    .rng
                    .random_bool(0.25)
                    .then(|| self.rng.random_range(20..800));
                let what = ttl.map_or(String::new(), |t| format!(", ttl {t} ms"));
                self.note(format!(
                    "publish {first}..{} through {n}{what}",
                    first + k - 1
                ));
                if let Some(t) = ttl {
                    self.check
                        .ttl
                        .extend((first..first + k).map(|seq| (seq, t)));
                }
                let c = self.client(&n);
                for seq in first..first + k {
                    c.client.publish_expiring(seq, true, ttl);
                }
            }
            38..60 => {
                let n = self.pick(&up);
                let k = self.rng.random_range(1..=4);
                let dead = self.rng.random_bool(0.25);
                let queue = if dead { DLQ } else { QUEUE };
                self.note(format!("{k} gets from {queue} through {n}"));
                let c = self.client(&n);
                for _ in 0..k {
                    c.client.request_get_from(queue);
                    c.gets.push_back(dead);
                }
            }
            60..63 => {
                let n = self.pick(&up);
                let prefetch = self.rng.random_range(1..=5);
                let c = self.client(&n);
                if !c.consuming {
                    c.consuming = true;
                    c.client.consume(prefetch);
                    self.note(format!("consume through {n}, prefetch {prefetch}"));
                }
            }
            63..70 => self.crash(),
            70..76 => {
                // Only while no promotion may be pending: every node up,
                // each queue's replicas all in the same view, the record's
                // master acting as master; a master's only with a
                // synchronised mirror to take over (see the module's note).
                let disks: Vec<String> = up
                    .iter()
                    .filter(|n| self.masters_covered(n, &up))
                    .cloned()
                    .collect();
                let settled = [QUEUE, DLQ].into_iter().all(|queue| {
                    let master = self.net.record_of(queue).master;
                    let epochs: BTreeSet<Option<u64>> = self
                        .net
                        .nodes
                        .values()
                        .map(|node| node.status_of(queue).map(|s| s.epoch))
                        .collect();
                    epochs.len() == 1
                        && self
                            .net
                            .nodes
                            .get(&master)
                            .and_then(|n| n.status_of(queue))
                            .map(|s| s.role)
                            == Some(Role::Master)
                });
                if self.failing.is_some()
                    || self.dead.is_some()
                    || self.suspected.is_some()
                    || disks.is_empty()
                    || !settled
                {
                    return;
                }
                let n = self.pick(&disks);
                let back =
                    self.net.elapsed + Duration::from_millis(self.rng.random_range(100..1_500));
                self.note(format!("the disk of {n} fails until {} ms", ms(back)));
                self.net.storage[&n].set_failing(true);
                self.failing = Some((n, back));
            }
            76..87 => self.network_fault(),
            87..90 => {
                // Raft's round trips: slow (a loaded or far majority) or
                // at once; what the nodes read and write of the metadata
                // meanwhile races with what they do.
                let latency = match self.rng.random_range(0..3) {
                    0 => 0,
                    1 => self.rng.random_range(1..10),
                    _ => self.rng.random_range(10..80),
                };
                self.note(format!("metadata round trips take {latency} ms"));
                self.net.meta.set_latency(Duration::from_millis(latency));
            }
            _ => {
                let d = Duration::from_millis(self.rng.random_range(20..400));
                self.note(format!("wait {} ms", ms(d)));
                self.run(d);
            }
        }
    }

    /// Kills a node (at most one down at a time; the master only while a
    /// synchronised mirror runs on a working disk), half the time with a
    /// power loss; it restarts after a while.
    fn crash(&mut self) {
        if self.dead.is_some() || self.suspected.is_some() {
            return;
        }
        let up = self.up();
        let n = self.pick(&up);
        let rec = self.net.record();
        let failing = self.failing.as_ref().map(|(f, _)| f.clone());
        // (Nor while a disk fails: the mirror promoted could be that one.)
        let master = [QUEUE, DLQ]
            .into_iter()
            .any(|queue| self.net.record_of(queue).master == n);
        if master && (failing.is_some() || !self.masters_covered(&n, &up)) {
            return;
        }
        // Nor any node while a master's disk fails: the synchronised
        // mirror that takes over could be the one.
        let failing_master = failing.as_ref().is_some_and(|f| {
            [QUEUE, DLQ]
                .into_iter()
                .any(|queue| &self.net.record_of(queue).master == f)
        });
        if failing_master {
            return;
        }
        let power = self.rng.random_bool(0.5);
        let back = self.net.elapsed + Duration::from_millis(self.rng.random_range(200..2_000));
        self.note(format!(
            "crash {n}{} (master {}, synchronised {:?}), back at {} ms",
            if power { " with a power loss" } else { "" },
            rec.master,
            rec.synchronised,
            ms(back)
        ));
        // Its clients' connections die with it.
        self.clients.remove(&n);
        let broker = std::sync::Arc::downgrade(&self.net.nodes[&n].broker);
        self.net.kill(&n);
        let storage = &self.net.storage[&n];
        if failing.as_deref() == Some(n.as_str()) {
            self.failing = None;
            storage.set_failing(false);
        }
        if power {
            assert!(
                broker.upgrade().is_none(),
                "the killed node's broker is still held"
            );
            storage.crash();
        }
        self.dead = Some((n, back));
    }

    /// Whether every queue whose master is on `n` has a synchronised
    /// mirror on another node of `up` to take over.
    fn masters_covered(&self, n: &str, up: &[String]) -> bool {
        [QUEUE, DLQ].into_iter().all(|queue| {
            let rec = self.net.record_of(queue);
            rec.master != n || rec.synchronised.iter().any(|m| up.contains(m))
        })
    }

    /// Cuts a link both ways, blackholes one direction, or heals one link.
    fn network_fault(&mut self) {
        let a = self.pick(&NODES);
        let others: Vec<&str> = NODES.iter().copied().filter(|n| *n != a).collect();
        let b = self.pick(&others);
        let heal_at = self.net.elapsed + Duration::from_millis(self.rng.random_range(100..2_000));
        match self.rng.random_range(0..3) {
            0 => {
                self.note(format!("cut {a} <-> {b}"));
                self.net.mem.cut(&name(a), &name(b));
            }
            1 => {
                self.note(format!("blackhole {a} -> {b}"));
                self.net.mem.blackhole(&name(a), &name(b));
            }
            _ => {
                self.note(format!("heal {a} <-> {b}"));
                self.net.mem.heal_link(&name(a), &name(b));
                return;
            }
        }
        let at = self.net_faults.map_or(heal_at, |t| t.max(heal_at));
        self.net_faults = Some(at);
    }

    /// Everything heals; the cluster settles (every node up, both mirrors
    /// synchronised, every publish settled and every get answered).
    fn heal_and_settle(&mut self) {
        self.note("heal everything".into());
        self.net.mem.heal();
        self.clear_suspicion();
        self.net.meta.set_latency(Duration::ZERO);
        self.net_faults = None;
        if let Some((n, _)) = self.failing.clone() {
            self.disk_recovers(&n);
        }
        if let Some((n, _)) = self.dead.clone() {
            self.restart(&n);
        }
        let limit = self.net.elapsed + Duration::from_secs(60);
        loop {
            let rec = self.net.record();
            let settled = [QUEUE, DLQ].into_iter().all(|queue| {
                let rec = self.net.record_of(queue);
                rec.synchronised.len() == 2
                    && self.net.nodes.values().all(|node| {
                        node.status_of(queue)
                            .is_some_and(|s| s.role == Role::Master || s.synchronised)
                    })
                    && self.net.nodes[&rec.master].status_of(queue).map(|s| s.role)
                        == Some(Role::Master)
            }) && self
                .clients
                .values()
                .all(|c| c.gets.is_empty() && c.client.unsettled().is_empty());
            if settled {
                break;
            }
            if self.net.elapsed >= limit {
                let pending: Vec<(String, usize, Vec<u64>)> = self
                    .clients
                    .iter()
                    .map(|(n, c)| (n.clone(), c.gets.len(), c.client.unsettled()))
                    .collect();
                let roles: Vec<_> = self
                    .net
                    .nodes
                    .iter()
                    .map(|(n, node)| (n.clone(), node.status()))
                    .collect();
                panic!(
                    "the cluster did not settle in 60 s (virtual): record {rec:?}, \
                     replicas {roles:?}, clients (node, gets, unsettled) {pending:?}"
                );
            }
            self.run(Duration::from_millis(20));
        }
        self.note("settled".into());
    }

    /// Liveness: through every node, a publish is confirmed and a get
    /// finds it (the first node drains what is left). Returns what was
    /// drained.
    fn final_round(&mut self) -> BTreeSet<u64> {
        // The schedule's clients go (their consumers would take what the
        // final clients look for).
        for (_, c) in std::mem::take(&mut self.clients) {
            c.client.disconnect();
        }
        let mut drained = BTreeSet::new();
        for n in NODES {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.note(format!("final publish {seq} and drain through {n}"));
            let mut c = Client::connect(&self.net.nodes[n].broker);
            c.publish(seq, true);
            let limit = self.net.elapsed + Duration::from_secs(30);
            while c.unsettled().contains(&seq) {
                assert!(
                    self.net.elapsed < limit,
                    "the final publish through {n} never settled"
                );
                self.net.step(STEP);
                c.poll();
            }
            assert!(
                c.acked.contains(&seq),
                "the final publish through {n} was nacked"
            );
            self.check.confirmed.insert(seq);
            while let Some(g) = self.get_stepping(&mut c, QUEUE, n, limit) {
                self.check.delivered(n, &g);
                c.ack(g.tag);
                drained.insert(g.seq);
            }
            assert!(
                c.closed().is_none(),
                "the broker on {n} closed the final client: {:?}",
                c.closed()
            );
            assert!(
                drained.contains(&seq),
                "the final publish through {n} was not delivered"
            );
        }
        self.drain_dead_letters();
        // The master holds nothing: everything delivered was acked, or
        // requeued and drained (a delivery that no channel holds would sit
        // unacknowledged for ever, out of every consumer's reach).
        self.net.step_until(
            &format!("{QUEUE}'s master holds no message"),
            STEP,
            Duration::from_secs(30),
            |net| {
                net.nodes.values().any(|node| {
                    lock(&node.broker).queues(Some("/")).iter().any(|q| {
                        q.name == QUEUE
                            && q.served_here
                            && q.messages_ready + q.messages_unacknowledged == 0
                    })
                })
            },
        );
        // The replicas agree on what each queue holds (nothing).
        for queue in [QUEUE, DLQ] {
            self.net.step_until(
                &format!("every replica's digest of {queue} agrees"),
                STEP,
                Duration::from_secs(30),
                |net| {
                    let digests: BTreeSet<Option<u64>> = net
                        .nodes
                        .values()
                        .map(|node| lock(&node.broker).queue_digest("/", queue))
                        .collect();
                    digests.len() == 1 && !digests.contains(&None)
                },
            );
        }
        drained
    }

    /// A `basic.get` from `queue` by `c` (on node `n`), stepping the nodes
    /// until it is answered (by `limit` of virtual time at the latest).
    fn get_stepping(
        &mut self,
        c: &mut Client,
        queue: &str,
        n: &str,
        limit: Duration,
    ) -> Option<Got> {
        c.request_get_from(queue);
        loop {
            assert!(
                self.net.elapsed < limit,
                "a get from {queue} through {n} never answered"
            );
            if let Some(answer) = c.take_get() {
                return answer;
            }
            self.net.step(STEP);
        }
    }

    /// Takes what the dead-letter queue holds through the first node, until
    /// it stays empty for a while (what `q` dead-letters last is on its way).
    fn drain_dead_letters(&mut self) {
        let n = NODES[0];
        self.note(format!("drain {DLQ} through {n}"));
        let mut c = Client::connect(&self.net.nodes[n].broker);
        let limit = self.net.elapsed + Duration::from_secs(30);
        let mut empty_since = None;
        loop {
            match self.get_stepping(&mut c, DLQ, n, limit) {
                Some(g) => {
                    empty_since = None;
                    self.check.dead_lettered(n, &g);
                    c.ack(g.tag);
                }
                None => {
                    let since = *empty_since.get_or_insert(self.net.elapsed);
                    if self.net.elapsed >= since + Duration::from_millis(500) {
                        break;
                    }
                    self.net.step(Duration::from_millis(20));
                }
            }
        }
        assert!(
            c.closed().is_none(),
            "the broker on {n} closed the dead-letter client: {:?}",
            c.closed()
        );
    }

    fn run_schedule(&mut self) {
        for _ in 0..ACTIONS {
            self.act();
            let d = Duration::from_millis(self.rng.random_range(2..40));
            self.run(d);
        }
        self.heal_and_settle();
        let drained = self.final_round();
        let kept: BTreeSet<u64> = self.check.consumed.union(&drained).copied().collect();
        // What expired or was rejected may be gone: dead-lettering from a
        // classic queue is at most once (RabbitMQ's too), so a message on
        // its way to `dlq` when a node fails is not counted lost.
        let lost: Vec<u64> = self
            .check
            .confirmed
            .difference(&kept)
            .filter(|seq| !self.check.ttl.contains_key(seq) && !self.check.rejected.contains(seq))
            .copied()
            .collect();
        if !lost.is_empty() {
            self.check
                .violations
                .push(format!("confirmed messages lost: {lost:?}"));
        }
        self.note(format!(
            "published {}, confirmed {}, nacked {}, consumed {}, drained {}, \
             with a ttl {}, rejected {}, dead-lettered {}",
            self.check.published,
            self.check.confirmed.len(),
            self.check.nacked.len(),
            self.check.consumed.len(),
            drained.len(),
            self.check.ttl.len(),
            self.check.rejected.len(),
            self.check.dead.len()
        ));
        assert!(
            self.check.violations.is_empty(),
            "{}",
            self.check.violations.join("\n")
        );
    }
}

/// Runs one seed of test `test`'s schedule (with nodes taken for dead if
/// `suspicions`); a failure names the seed and its replay command.
fn simulate(test: &str, seed: u64, suspicions: bool) -> Result<(), String> {
    let mut trace = Vec::new();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut sim = Sim::new(seed, suspicions);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| sim.run_schedule()));
        trace = std::mem::take(&mut sim.trace);
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    }));
    result.map_err(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        let tail = trace[trace.len().saturating_sub(40)..].join("\n  ");
        format!(
            "simulation seed {seed} failed: {msg}\n\
             last actions:\n  {tail}\n\
             replay: WARREN_SIM_SEED={seed} cargo nextest run -p warren-mirror-driver --test sim {test} --no-capture"
        )
    })
}

/// The seeds to run: `WARREN_SIM_SEED=N` alone, `WARREN_SIM_SEEDS=A-B` a
/// range, else `default`.
fn seeds(default: &[u64]) -> Vec<u64> {
    if let Ok(s) = std::env::var("WARREN_SIM_SEED") {
        return vec![s.trim().parse().expect("WARREN_SIM_SEED: a number")];
    }
    if let Ok(s) = std::env::var("WARREN_SIM_SEEDS") {
        let (a, b) = s.split_once('-').expect("WARREN_SIM_SEEDS: A-B");
        return (a.trim().parse().unwrap()..=b.trim().parse().unwrap()).collect();
    }
    default.to_vec()
}

/// Runs test `test`'s seeds; fails naming every failing one.
fn simulate_seeds(test: &str, default: &[u64], suspicions: bool) {
    let mut failed = Vec::new();
    for seed in seeds(default) {
        if let Err(e) = simulate(test, seed, suspicions) {
            tracing::error!("{e}");
            failed.push((seed, e));
        }
    }
    if let Some((_, first)) = failed.first() {
        let seeds: Vec<u64> = failed.iter().map(|(s, _)| *s).collect();
        panic!("failing seeds {seeds:?}; the first:\n{first}");
    }
}

#[test]
fn seeded_faults_lose_no_confirmed_message_and_the_cluster_recovers() {
    let default: Vec<u64> = CI_SEEDS.iter().chain(REGRESSION_SEEDS).copied().collect();
    simulate_seeds(
        "seeded_faults_lose_no_confirmed_message_and_the_cluster_recovers",
        &default,
        false,
    );
}

/// The same schedules with running nodes taken for dead by the cluster
/// besides (see the module's note). Seeds 1–150 passed when they were
/// added. Seed 225 failed: after a ring's churn a mirror whose seqs ran
/// 42 behind its master's claimed the empty master's state (the digests
/// of two empty queues agree), reported its disk in its own numbering,
/// and the master's next persistent confirm waited for ever; a sync now
/// compares the next seq too (`sync_digest` in `warren-mirror`).
#[test]
fn seeded_faults_with_nodes_taken_for_dead_lose_no_confirmed_message() {
    let default: Vec<u64> = CI_SEEDS.iter().chain(&[225]).copied().collect();
    simulate_seeds(
        "seeded_faults_with_nodes_taken_for_dead_lose_no_confirmed_message",
        &default,
        true,
    );
}

/// A master whose disk failed, with no synchronised mirror to take over,
/// opens its queue's log again once the disk works and serves the queue
/// from it: every confirmed message comes back, marked redelivered (its
/// delivery marks went with the failed copy), and the ack of a delivery
/// made before the failure settles nothing of the new copy. Before, it
/// waited for a restart of its node that nothing asked for (seed 250 never
/// settled).
#[test]
fn a_master_whose_disk_failed_serves_its_log_again_once_the_disk_works() {
    let step = Duration::from_millis(2);
    let limit = Duration::from_secs(30);
    let mut net = Net::simulated(250, 16);
    net.start_now("n1");
    net.step_until("n1's replica is master", step, limit, |n| {
        n.nodes["n1"].role() == Some(Role::Master)
    });
    let mut c = Client::connect(&net.nodes["n1"].broker);
    net.publish_confirmed_now(&mut c, 10, step, limit);
    c.request_get();
    let mut first = None;
    net.step_until("a get", step, limit, |_| {
        first = c.take_get();
        first.is_some()
    });
    let first = first.flatten().expect("a message");
    assert_eq!((first.seq, first.redelivered), (1, false));

    net.storage["n1"].set_failing(true);
    c.publish(11, true);
    net.step_until("the publish during the failure nacked", step, limit, |_| {
        c.poll();
        c.nacked.contains(&11)
    });
    net.step_until("the master's replica stopped", step, limit, |n| {
        n.nodes["n1"].role().is_none()
    });
    net.step(Duration::from_secs(3));
    assert_eq!(
        net.nodes["n1"].role(),
        None,
        "not back while the disk fails"
    );

    net.storage["n1"].set_failing(false);
    net.step_until("n1's replica master again", step, limit, |n| {
        n.nodes["n1"].role() == Some(Role::Master)
    });
    let get = |net: &mut Net, c: &mut Client| {
        c.request_get();
        let mut answer = None;
        net.step_until("a get", step, limit, |_| {
            answer = c.take_get();
            answer.is_some()
        });
        answer.flatten()
    };
    let again = get(&mut net, &mut c).expect("message 1 again");
    assert_eq!((again.seq, again.redelivered), (1, true));
    // The first delivery's tag named message 1 of the failed copy: void
    // now, it must not settle the new copy's delivery of it.
    c.ack(first.tag);
    c.requeue(again.tag);
    let mut got = Vec::new();
    while let Some(g) = get(&mut net, &mut c) {
        c.ack(g.tag);
        got.push((g.seq, g.redelivered));
    }
    let want: Vec<(u64, bool)> = (1..=10).map(|seq| (seq, true)).collect();
    assert_eq!(got, want);
    assert_eq!(c.closed(), None);
}

/// The metadata's delete of queue `q`, as a client's delete commits it.
fn delete_in_metadata(net: &Net) {
    net.meta
        .apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: QUEUE.into(),
            expected_version: None,
        })
        .unwrap();
}

/// The metadata's declaration of queue `q` (master `n1`).
fn declare_command() -> Command {
    queue_commands(16)
        .into_iter()
        .find(|c| matches!(c, Command::DeclareQueue(q) if q.name == QUEUE))
        .unwrap()
}

/// Gets (and acks) every message the queue has through `c`, in order.
fn get_all(net: &mut Net, c: &mut Client) -> Vec<u64> {
    let mut got = Vec::new();
    loop {
        c.request_get();
        let mut answer = None;
        net.step_until(
            "a get",
            Duration::from_millis(1),
            Duration::from_secs(30),
            |_| {
                answer = c.take_get();
                answer.is_some()
            },
        );
        let Some(g) = answer.flatten() else {
            return got;
        };
        c.ack(g.tag);
        got.push(g.seq);
    }
}

/// A queue deleted and declared again on a node while that node's replica
/// of the first declaration is still starting (joining its ring): the
/// replica must not take the new declaration's queue for its own. It did
/// (conformance scenario `declared_again`, seen under CPU load): the stale
/// replica turned the new queue into the master of the old ring, was then
/// stopped as a replica of a deleted queue and dropped the new queue's
/// messages, a confirmed one among them, and nacked the publishes after it.
/// The delay before the delete sweeps the whole start.
#[test]
fn a_replica_of_a_deleted_declaration_never_takes_the_next_one() {
    let step = Duration::from_millis(1);
    let limit = Duration::from_secs(30);
    for delay in 0..30 {
        let mut net = Net::simulated(delay, 16);
        // Raft's round trips: a replica's start reads and writes the
        // metadata.
        net.meta.set_latency(Duration::from_millis(10));
        net.start_now("n1");
        net.step(Duration::from_millis(delay));
        let mut c = Client::connect(&net.nodes["n1"].broker);
        // As a client's delete and declare do on a node: the broker first,
        // the metadata once committed.
        c.delete(QUEUE);
        c.declare(QUEUE);
        delete_in_metadata(&net);
        let declare = declare_command();
        net.meta.apply(&declare).unwrap();
        c.publish(1, true);
        net.step_until("the publish settled", step, limit, |_| {
            c.poll();
            !c.acked.is_empty() || !c.nacked.is_empty()
        });
        assert!(c.acked.contains(&1), "delay {delay} ms: publish nacked");
        let ring = net.record().ring();
        net.step_until(
            "the new declaration's replica is master",
            step,
            limit,
            |n| {
                n.nodes["n1"].role() == Some(Role::Master)
                    && lock(&n.nodes["n1"].broker)
                        .replica_ring("/", QUEUE)
                        .as_deref()
                        == Some(ring.as_str())
            },
        );
        c.publish(2, true);
        net.step_until("the second publish settled", step, limit, |_| {
            c.poll();
            c.acked.len() + c.nacked.len() == 2
        });
        let got = get_all(&mut net, &mut c);
        assert_eq!(
            got,
            c.acked.iter().copied().collect::<Vec<_>>(),
            "delay {delay} ms: confirmed messages lost"
        );
        assert_eq!(c.acked.len(), 2, "delay {delay} ms: a publish nacked");
    }
}

/// A mirrored queue deleted and declared again, cycle after cycle, on three
/// nodes, each mirror node's broker following the metadata at its own pace
/// (as each node's replay does: after a seeded delay, sometimes both
/// changes at once): every declaration's confirmed messages are there to
/// get through its master, and every node ends with a synchronised replica
/// of the last declaration's ring.
#[test]
fn a_queue_declared_again_and_again_keeps_each_declarations_confirmed_messages() {
    for seed in [0, 2, 3, 4, 5] {
        declared_again_and_again(seed);
    }
}

/// Seed 1 of the test above, a livelock found 2026-12-04 and kept as its
/// own test: in its first cycle node `n3`'s reconciler starts the new
/// declaration's replica on the broker queue of the old one, before that
/// node's replay deletes and declares the queue again. That replica, the
/// new ring's founder, stops when its queue goes, its member dead in the
/// view while the other replicas are still joining behind it. A joiner
/// that inherits a dead member cannot know its state, so its join fails;
/// each failed joiner's node joined again behind another joiner, which
/// inherited the same dead founder in turn (1,260 `Action::JoinFailed` in
/// 30 virtual seconds, the mirrors never synchronised). A join now waits
/// until no alive member inherits a dead one (`NodeTask::propose_join`):
/// once every joiner has failed, the ring starts afresh.
#[test]
fn a_ring_whose_founder_died_while_the_others_joined_settles() {
    declared_again_and_again(1);
}

fn declared_again_and_again(seed: u64) {
    let step = Duration::from_millis(1);
    let limit = Duration::from_secs(30);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut net = Net::simulated(seed, 16);
    net.meta.set_latency(Duration::from_millis(5));
    for n in ["n1", "n2", "n3"] {
        net.start_now(n);
    }
    let declare = declare_command();
    let synchronised_everywhere = |n: &Net| {
        let ring = n.record().ring();
        n.record().synchronised.len() == 2
            && n.nodes.values().all(|node| {
                lock(&node.broker).replica_ring("/", QUEUE).as_deref() == Some(ring.as_str())
                    && node.status().is_some_and(|s| s.synchronised)
            })
    };
    net.step_until(
        "the first declaration mirrored",
        step,
        limit,
        synchronised_everywhere,
    );
    let mut c = Client::connect(&net.nodes["n1"].broker);
    let mut seq = 0;
    for cycle in 0..6 {
        // n1, where the client is, first; the metadata; the others later.
        c.delete(QUEUE);
        delete_in_metadata(&net);
        c.declare(QUEUE);
        net.meta.apply(&declare).unwrap();
        for n in ["n2", "n3"] {
            net.step(Duration::from_millis(rng.random_range(0..40)));
            let mut b = lock(&net.nodes[n].broker);
            // Half the time the replay sees both changes at once and keeps
            // the broker's queue (same settings).
            if rng.random_bool(0.5) {
                b.admin_delete_queue("/", QUEUE);
            }
            b.admin_declare_queue("/", QUEUE, true, false, Default::default())
                .unwrap();
            b.set_queue_master("/", QUEUE, Some("n1"));
        }
        let first = seq + 1;
        let k = rng.random_range(1..=6);
        for s in first..first + k {
            c.publish(s, true);
        }
        seq += k;
        let before = c.acked.len() + c.nacked.len();
        net.step_until(
            &format!("seed {seed}, cycle {cycle}: the publishes settled"),
            step,
            limit,
            |_| {
                c.poll();
                c.acked.len() + c.nacked.len() == before + k as usize
            },
        );
        assert!(
            c.nacked.is_empty(),
            "seed {seed}, cycle {cycle}: nacked {:?}",
            c.nacked
        );
        net.step_until(
            &format!("seed {seed}, cycle {cycle}: the declaration mirrored on every node"),
            step,
            limit,
            synchronised_everywhere,
        );
        let got = get_all(&mut net, &mut c);
        assert_eq!(
            got,
            (first..first + k).collect::<Vec<_>>(),
            "seed {seed}, cycle {cycle}: the declaration's confirmed messages"
        );
    }
}

/// The cluster takes a running master for dead (its ring links cut, the
/// others' failure detectors suspecting it) while its client keeps
/// publishing through it, the metadata's round trips slow: the others
/// remove it from the ring, and a mirror promotes itself once its claim
/// of the record commits. Between its removal and that claim, the old
/// master's node still read itself as the record's master. Had it served
/// its copy then (`ReplicaEnd::Serve`), a publish confirmed there would be
/// lost once it followed the new master; it holds the copy instead
/// (`ReplicaEnd::Hold`). Every confirmed message must be there after the
/// heal, for every seed of the network's delays.
#[test]
fn a_master_taken_for_dead_confirms_nothing_outside_its_ring() {
    let step = Duration::from_millis(2);
    let limit = Duration::from_secs(30);
    for seed in 0..8 {
        let mut net = Net::simulated(seed, 16);
        for n in ["n1", "n2", "n3"] {
            net.start_now(n);
        }
        net.step_until("both mirrors synchronised", step, limit, |n| {
            n.record().synchronised.len() == 2 && n.nodes["n1"].role() == Some(Role::Master)
        });
        net.meta.set_latency(Duration::from_millis(40));
        let mut c = Client::connect(&net.nodes["n1"].broker);
        let mut seq = 0;
        let mut publish = |c: &mut Client| {
            seq += 1;
            c.publish(seq, true);
        };
        net.mem.cut(&name("n1"), &name("n2"));
        net.mem.cut(&name("n1"), &name("n3"));
        let mut up = net.meta.up_now();
        up.remove(&name("n1"));
        net.meta.set_up(up.clone());
        net.step_until("a mirror promoted", step, limit, |n| {
            publish(&mut c);
            c.poll();
            n.record().master != "n1"
        });
        for _ in 0..100 {
            publish(&mut c);
            net.step(step);
            c.poll();
        }
        net.mem.heal();
        up.insert(name("n1"));
        net.meta.set_up(up);
        net.meta.set_latency(Duration::ZERO);
        net.step_until("every publish settled", step, limit, |_| {
            c.poll();
            c.unsettled().is_empty()
        });
        let master = net.record().master;
        let mut d = Client::connect(&net.nodes[&master].broker);
        let got: BTreeSet<u64> = get_all(&mut net, &mut d).into_iter().collect();
        let lost: Vec<u64> = c
            .acked
            .iter()
            .filter(|s| !got.contains(s))
            .copied()
            .collect();
        assert!(
            lost.is_empty(),
            "seed {seed}: confirmed messages lost: {lost:?} (confirmed {}, nacked {})",
            c.acked.len(),
            c.nacked.len()
        );
    }
}

/// Publishes forwarded to a master whose link went down before their
/// confirms came back are sent again to it once the link is back. A
/// replica started there meanwhile from the master's own copy (here the
/// queue stopped being mirrored, then was mirrored again) holds what that
/// copy held, so it takes none of them twice. Chaos seed 1 found it: a
/// master removed from its ring started again from its kept copy knowing
/// nothing of what that held, took 20 publishes sent again a second time,
/// and delivered them again without the redelivered flag.
#[test]
fn publishes_sent_again_to_a_master_started_from_its_own_copy_are_held_once() {
    let (step, limit) = (Duration::from_millis(2), Duration::from_secs(30));
    let (mut net, mut c) = held_by_n1_unconfirmed_at_n2(step, limit);
    let ha = queue_commands(16)
        .into_iter()
        .find(|c| matches!(c, Command::PutPolicy(p) if p.name == "ha"))
        .unwrap();
    net.meta
        .apply(&Command::DeletePolicy {
            vhost: "/".into(),
            name: "ha".into(),
        })
        .unwrap();
    net.step_until("the master's replica ended", step, limit, |n| {
        n.nodes["n1"].status().is_none()
    });
    net.meta.apply(&ha).unwrap();
    net.step_until("a master again on n1", step, limit, |n| {
        n.nodes["n1"].role() == Some(Role::Master)
    });
    lock(&net.nodes["n2"].broker).resubscribe("n1");
    net.step_until("every publish settled", step, limit, |_| {
        c.poll();
        c.unsettled().is_empty()
    });
    assert_eq!((c.acked.len(), c.nacked.len()), (20, 0), "all confirmed");
    let mut d = Client::connect(&net.nodes["n1"].broker);
    let got = get_all(&mut net, &mut d);
    assert_eq!(got, (1..=20).collect::<Vec<u64>>(), "each once, in order");
}

/// The same with the master's node restarted meanwhile: its replica starts
/// from the copy on its disk, which says nothing of what it holds, so the
/// publishes sent again are refused (nacked to the publisher, which may
/// resend), none taken twice.
#[test]
fn publishes_sent_again_to_a_master_recovered_from_disk_are_refused() {
    let (step, limit) = (Duration::from_millis(2), Duration::from_secs(30));
    let (mut net, mut c) = held_by_n1_unconfirmed_at_n2(step, limit);
    // On its disk by then (synced, confirmed to nobody).
    net.step(Duration::from_millis(300));
    // No mirror can take over: the record keeps naming n1.
    net.cut_off("n2", true);
    net.cut_off("n3", true);
    net.kill("n1");
    net.step(Duration::from_millis(50));
    net.start_now("n1");
    net.step_until("n1 master again", step, limit, |n| {
        n.nodes["n1"].role() == Some(Role::Master)
    });
    // Its link back, n2 sends them again; no mirror takes over meanwhile.
    net.step_until("every publish settled", step, limit, |_| {
        c.poll();
        c.unsettled().is_empty()
    });
    assert_eq!(net.nodes["n1"].counts(), (20, 0), "none taken twice");
    assert_eq!(c.nacked.len(), 20, "refused: {:?}", c.acked);
    net.cut_off("n2", false);
    net.cut_off("n3", false);
    net.step_until("the master's mirrors synchronised", step, limit, |n| {
        n.nodes["n1"]
            .status()
            .is_some_and(|s| s.synced_members.len() == 2)
    });
    let mut d = Client::connect(&net.nodes[&net.record().master].broker);
    let got = get_all(&mut net, &mut d);
    assert_eq!(got, (1..=20).collect::<Vec<u64>>(), "each once, in order");
}

/// A publish the master refused (`x-overflow: reject-publish`, the queue
/// full), whose nack was lost with its link, comes again after a later
/// publish of its publisher was held, to the mirror that took over from
/// that master: it is taken. Before, the new master took it for held (a
/// later seq of its publisher was) and confirmed it unheld: a confirmed
/// message lost. The mirrors learn the master's refusals with its
/// broadcasts (`Body::Ops { refused }`).
#[test]
fn a_refused_publish_sent_again_to_the_next_master_is_taken() {
    let (step, limit) = (Duration::from_millis(2), Duration::from_secs(30));
    let mut net = Net::simulated(1, 16);
    for n in ["n1", "n2", "n3"] {
        net.start_now(n);
    }
    net.step_until("both mirrors synchronised", step, limit, |n| {
        n.record().synchronised.len() == 2 && n.nodes["n1"].role() == Some(Role::Master)
    });
    // As each node's metadata replay hands its broker the policy.
    let full = r#"{"ha-mode":"all","ha-sync-mode":"automatic","max-length":1,"overflow":"reject-publish"}"#;
    let policy = warren_broker::meta::PolicyDef {
        vhost: "/".into(),
        name: "ha".into(),
        pattern: format!("^{QUEUE}$"),
        apply_to: "queues".into(),
        priority: 0,
        definition: serde_json::from_str(full).unwrap(),
        operator: false,
    };
    for n in ["n1", "n2", "n3"] {
        lock(&net.nodes[n].broker).apply_policies(std::slice::from_ref(&policy));
    }
    // Forwarded by a node `n9` under its identities (publisher 77).
    let publish = |id: u64, first: Option<u64>| warren_broker::LinkMsg::Publish {
        vhost: "/".into(),
        queue: QUEUE.into(),
        id,
        publisher: 77,
        first,
        meta: bytes::Bytes::new(),
        body: bytes::Bytes::from(first.unwrap_or(id).to_string()),
        persistent: true,
        expiration_ms: None,
        priority: 0,
    };
    let to = |net: &mut Net, node: &str, msgs| {
        lock(&net.nodes[node].broker).link_input("n9", msgs, common::now_ms());
        net.step(Duration::from_millis(100));
    };
    // 1 taken, 2 refused (full); 1 consumed, 3 taken.
    to(&mut net, "n1", vec![publish(1, None)]);
    to(&mut net, "n1", vec![publish(2, None)]);
    let mut c = Client::connect(&net.nodes["n1"].broker);
    assert_eq!(get_all(&mut net, &mut c), [1]);
    to(&mut net, "n1", vec![publish(3, None)]);
    net.step_until("the mirrors hold 3", step, limit, |n| {
        n.nodes["n2"].counts().0 == 1 && n.nodes["n3"].counts().0 == 1
    });
    net.kill("n1");
    net.step_until("a mirror took over", step, limit, |n| {
        n.record().master != "n1" && n.nodes[&n.record().master].role() == Some(Role::Master)
    });
    let master = net.record().master;
    let mut c = Client::connect(&net.nodes[&master].broker);
    assert_eq!(get_all(&mut net, &mut c), [3]);
    // 2 again, its nack lost.
    to(&mut net, &master, vec![publish(4, Some(2))]);
    assert_eq!(
        get_all(&mut net, &mut c),
        [2],
        "taken, not confirmed unheld"
    );
}

/// A cluster whose master `n1` holds 20 persistent publishes a client sent
/// through `n2`, whose link to `n1` went down before their confirms came
/// back: they wait at `n2` to be sent again.
fn held_by_n1_unconfirmed_at_n2(step: Duration, limit: Duration) -> (Net, Client) {
    let mut net = Net::simulated(1, 16);
    for n in ["n1", "n2", "n3"] {
        net.start_now(n);
    }
    net.step_until("both mirrors synchronised", step, limit, |n| {
        n.record().synchronised.len() == 2 && n.nodes["n1"].role() == Some(Role::Master)
    });
    let mut c = Client::connect(&net.nodes["n2"].broker);
    for seq in 1..=20 {
        c.publish(seq, true);
    }
    net.step_until(
        "the master holds them",
        Duration::from_millis(1),
        limit,
        |n| n.nodes["n1"].counts().0 == 20,
    );
    lock(&net.nodes["n2"].broker).link_down("n1", common::now_ms());
    (net, c)
}
