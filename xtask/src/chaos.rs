//! `cargo xtask chaos [--seed S] [--duration SECS] [--nodes 3|5] [--queues
//! 1-4] [--busy N] [--long-pauses] [--slow-links] [--unconfirmed]`: a
//! seeded fault schedule against a cluster of `warren` processes in a
//! private network namespace under a confirmed publish / acked consume
//! load, then a history check. `--busy N` spins N threads beside the run,
//! as a machine busy with other work: it widens the windows a timing fault
//! needs (chaos seed 50014 failed 2 runs in 3 with two spinning processes
//! beside it, none in 3 without). `--unconfirmed` has B's publishers
//! publish without confirm mode (their messages are checked for order and
//! repeats, not for loss); `--long-pauses` and `--slow-links` are on
//! [`Options`].
//!
//! The run creates the network namespace `warren-chaos-<pid>` (`lo` up,
//! deleted at the end, also on an error) and starts every node in it with
//! `ip netns exec`, node N on its own address 127.0.0.(N+1) (A on
//! 127.0.0.2, …) with the standard ports; the load, the management calls
//! and the drain run on a thread that entered the namespace (`setns`), so
//! the clients connect from 127.0.0.1, which no partition rule touches.
//! The cluster (`warren@a`, `warren@b`, … with `--join` to A on the first
//! start) gets the policy `ha-all` (`ha-mode: all`, `ha-sync-mode:
//! automatic`) and the durable queue `ha.chaos`, declared on A; with
//! `--queues K`, also (in this order) `ha2.chaos` declared on B with the
//! policy `ha-two` (`ha-mode: exactly`, 2: a queue some nodes only forward
//! to), `ha.chaos-c` declared on C (its master elsewhere than A's), and
//! `plain.chaos`, durable and unmirrored, on B. Every node has, for each
//! queue, a publisher (persistent messages, confirms, a unique body each)
//! and a consumer (manual acks) of its own; each moves to the next live node
//! when its connection fails, and none resends anything: the run only
//! records what was confirmed and what was delivered (with the redelivered
//! flag). Every 2–4 s the schedule (splitmix64 over the seed) picks a node
//! and a fault: SIGKILL then a restart 1–3 s later, SIGTERM then a restart
//! 1–3 s later, SIGSTOP for 1–2 s then SIGCONT, or for 3–10 s a partition
//! made with iptables in the namespace: the node isolated from every other
//! node both ways (DROP, or REJECT with a TCP reset), or 30 % of the
//! packets dropped at random both ways between it and one other node; then
//! the rules are flushed. One node at most is faulty at a time (an isolated
//! node stays reachable by the clients), and a fault waits until the
//! queues' mirrors are synchronised again (every node showing the same
//! master). Afterwards every node is up and connected, the load stops, the
//! queues are drained through A and the history is checked: no confirmed
//! message lost, no message delivered twice without the redelivered flag, every client
//! moving again within 5 s of each heal, the drain (the backlog the
//! consumers left) taking no longer than a fifth of the load's time, and no
//! queue holding a message after the drain (one left unacknowledged by a
//! consumer that is gone: the report names who holds it on each node). Data
//! directories, node logs and every delivery of each repeated message
//! (`repeats.txt`) are in `target/chaos/<seed>/`; after a loss, so is
//! every message of the publisher sessions that lost one (`lost.txt`).

pub(crate) mod netns;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::{Value, json};

use crate::scenario::{Bins, Node, Spec, names, spawn, tail};
use netns::Netns;

/// The queues of a run with `--queues K`, in order (the first K): name,
/// the node it is declared on (so where its master starts), and how many
/// synchronised mirrors it has when healthy (`all`: every other node).
/// `ha.` names match the policy `ha-all`, `ha2.` names `ha-two` (`ha-mode:
/// exactly`, 2), and `plain.` names no policy: a durable queue without
/// mirrors, unavailable while its node is down and recovered from its log.
const QUEUES: [(&str, usize, Mirrors); 4] = [
    ("ha.chaos", 0, Mirrors::All),
    ("ha2.chaos", 1, Mirrors::Exactly(1)),
    ("ha.chaos-c", 2, Mirrors::All),
    ("plain.chaos", 1, Mirrors::Exactly(0)),
];

/// How many synchronised mirrors a queue of the run has when healthy.
#[derive(Debug, Clone, Copy)]
enum Mirrors {
    /// One on every other node.
    All,
    /// This many.
    Exactly(usize),
}

/// One queue of the run.
#[derive(Debug, Clone)]
struct RunQueue {
    /// Its name.
    name: &'static str,
    /// The node it is declared on.
    home: usize,
    /// Its synchronised mirrors when healthy.
    mirrors: usize,
}

/// The first `opts.queues` of [`QUEUES`] for a cluster of `opts.nodes`.
fn run_queues(opts: Options) -> Vec<RunQueue> {
    QUEUES
        .iter()
        .take(opts.queues)
        .map(|&(name, home, mirrors)| RunQueue {
            name,
            home,
            mirrors: match mirrors {
                Mirrors::All => opts.nodes - 1,
                Mirrors::Exactly(n) => n,
            },
        })
        .collect()
}
/// How long the schedule waits for the mirrors to be synchronised before a
/// fault, and the drain for the queue to settle.
const SYNC_WAIT: Duration = Duration::from_secs(60);

/// What `cargo xtask chaos` runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    /// The schedule's seed.
    pub(crate) seed: u64,
    /// How long faults are injected.
    pub(crate) duration: Duration,
    /// The cluster size (3 or 5).
    pub(crate) nodes: usize,
    /// How many of [`QUEUES`] carry the load (1–4).
    pub(crate) queues: usize,
    /// Threads spinning beside the run (a busy machine).
    pub(crate) busy: usize,
    /// SIGSTOP pauses of 2–10 s instead of 1–2 s: longer than the nodes'
    /// `--net-ticktime` (3 s), so the others fail a paused node over while
    /// it still believes itself up (a long GC pause or a frozen VM).
    pub(crate) long_pauses: bool,
    /// Also draw slow links: the link between two nodes held to 1 Mbit/s
    /// each way (`tc` HTB) for 3–10 s.
    pub(crate) slow_links: bool,
    /// B's publishers publish without confirm mode (a batch of 20 every
    /// 50 ms): their publishes are checked for order and repeats, not for
    /// loss, which nothing promises them.
    pub(crate) unconfirmed: bool,
}

impl Options {
    /// The command that replays this run.
    fn replay(&self) -> String {
        let mut cmd = format!(
            "cargo xtask chaos --seed {} --duration {}",
            self.seed,
            self.duration.as_secs()
        );
        if self.nodes != 3 {
            cmd.push_str(&format!(" --nodes {}", self.nodes));
        }
        if self.queues != 1 {
            cmd.push_str(&format!(" --queues {}", self.queues));
        }
        if self.busy != 0 {
            cmd.push_str(&format!(" --busy {}", self.busy));
        }
        if self.long_pauses {
            cmd.push_str(" --long-pauses");
        }
        if self.slow_links {
            cmd.push_str(" --slow-links");
        }
        if self.unconfirmed {
            cmd.push_str(" --unconfirmed");
        }
        cmd
    }
}

/// Runs `cargo xtask chaos …`.
pub(crate) fn main(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let usage = "usage: cargo xtask chaos [--seed S] [--duration SECS] [--nodes 3|5] [--queues 1-4] [--busy N] [--long-pauses] [--slow-links] [--unconfirmed]";
    let mut opts = Options {
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs(),
        duration: Duration::from_secs(60),
        nodes: 3,
        queues: 1,
        busy: 0,
        long_pauses: false,
        slow_links: false,
        unconfirmed: false,
    };
    let mut args = rest.iter();
    while let Some(flag) = args.next() {
        match *flag {
            "--long-pauses" => {
                opts.long_pauses = true;
                continue;
            }
            "--slow-links" => {
                opts.slow_links = true;
                continue;
            }
            "--unconfirmed" => {
                opts.unconfirmed = true;
                continue;
            }
            _ => {}
        }
        let value = args.next().context(usage)?;
        match *flag {
            "--seed" => opts.seed = value.parse().context(usage)?,
            "--duration" => opts.duration = Duration::from_secs(value.parse().context(usage)?),
            "--nodes" => match value.parse() {
                Ok(n @ (3 | 5)) => opts.nodes = n,
                _ => bail!("{usage}"),
            },
            "--queues" => match value.parse() {
                Ok(n @ 1..=4) => opts.queues = n,
                _ => bail!("{usage}"),
            },
            "--busy" => opts.busy = value.parse().context(usage)?,
            _ => bail!("{usage}"),
        }
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |t| root.join(t));
    println!("building warren and warrenctl (debug)…");
    let bins = Bins::build(root, &target)?;
    let work = root.join("target/chaos").join(opts.seed.to_string());
    let spinning = Arc::new(AtomicBool::new(true));
    let spinners: Vec<_> = (0..opts.busy)
        .map(|_| {
            let on = spinning.clone();
            std::thread::spawn(move || {
                while on.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let report = run(opts, &bins, &work);
    spinning.store(false, Ordering::Relaxed);
    for s in spinners {
        let _ = s.join();
    }
    let report = report?;
    println!("{report}");
    if !report.pass() {
        println!("replay: {}", opts.replay());
        bail!(
            "chaos run with seed {} failed (see the report above)",
            opts.seed
        );
    }
    Ok(())
}

/// splitmix64: a small deterministic generator for the schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// One fault of the schedule.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL, restart after the pause.
    Kill,
    /// SIGTERM (waiting for the exit), restart after the pause.
    Term,
    /// SIGSTOP, SIGCONT after the pause.
    Pause,
    /// Every packet between the node and every other node dropped (or, with
    /// `reset`, TCP refused with a reset) both ways; healed after the pause.
    Isolate {
        /// REJECT with `tcp-reset` instead of DROP.
        reset: bool,
    },
    /// 30 % of the packets between the node and node `other` dropped at
    /// random, both ways; healed after the pause.
    Lossy {
        /// The other end of the lossy link.
        other: usize,
    },
    /// Every packet between the node and node `other` alone dropped (the
    /// third node still reaches both), both ways or, `one_way`, only from
    /// the node to `other`; healed after the pause.
    Cut {
        /// The other end of the cut.
        other: usize,
        /// Only the node's packets to `other` are dropped.
        one_way: bool,
    },
    /// The link between the node and node `other` cut and healed in turn,
    /// every 0.5–2 s, for the pause.
    Flap {
        /// The other end of the flapping link.
        other: usize,
        /// Seeds the cut and heal times.
        seed: u64,
    },
    /// The link between the node and node `other` held to 1 Mbit/s each
    /// way; healed after the pause.
    Slow {
        /// The other end of the slow link.
        other: usize,
    },
}

impl Fault {
    /// The next fault of the schedule and its pause, for the cluster of
    /// `opts`, on node `i`.
    fn draw(rng: &mut Rng, opts: &Options, i: usize) -> anyhow::Result<(Self, u64)> {
        let nodes = opts.nodes;
        let other = |rng: &mut Rng| -> anyhow::Result<usize> {
            let step = usize::try_from(rng.range(1, nodes as u64 - 1))?;
            Ok((i + step) % nodes)
        };
        let fault = match rng.range(0, if opts.slow_links { 9 } else { 8 }) {
            0 => Self::Kill,
            1 => Self::Term,
            2 => Self::Pause,
            3 => Self::Isolate { reset: false },
            4 => Self::Isolate { reset: true },
            5 => Self::Lossy { other: other(rng)? },
            6 => Self::Cut {
                other: other(rng)?,
                one_way: false,
            },
            7 => Self::Cut {
                other: other(rng)?,
                one_way: true,
            },
            8 => Self::Flap {
                other: other(rng)?,
                seed: rng.next(),
            },
            _ => Self::Slow { other: other(rng)? },
        };
        let pause = match fault {
            Self::Kill | Self::Term => rng.range(1_000, 3_000),
            Self::Pause if opts.long_pauses => rng.range(2_000, 10_000),
            Self::Pause => rng.range(1_000, 2_000),
            Self::Flap { .. } => 10_000,
            _ => rng.range(3_000, 10_000),
        };
        Ok((fault, pause))
    }
}

/// What a run recorded and what the history check found.
#[derive(Debug)]
pub(crate) struct Report {
    /// The run's options.
    pub(crate) opts: Options,
    /// The faults injected, in order.
    pub(crate) faults: Vec<String>,
    /// Messages published (each body once).
    pub(crate) published: usize,
    /// Messages confirmed by the broker.
    pub(crate) confirmed: usize,
    /// Deliveries, the drain's included.
    pub(crate) deliveries: usize,
    /// Confirmed messages never delivered, with when they were confirmed
    /// (seconds into the run): the run fails on any.
    pub(crate) lost: Vec<String>,
    /// Messages delivered more than once without the redelivered flag (the
    /// run fails on any). One unflagged delivery beside flagged ones is
    /// right in any order: a delivery in flight to a node that a cut then
    /// parts from the master reaches its client unflagged, while the
    /// master redelivers it, flagged, to another consumer, which may
    /// record it first.
    pub(crate) unflagged: Vec<String>,
    /// Repeated deliveries in all (flagged or not).
    pub(crate) duplicates: usize,
    /// First deliveries (not flagged redelivered) that came after a message
    /// published later on the same channel (publisher session) had already
    /// come: reported, not a failure (a failover may legitimately reorder
    /// only what it flags redelivered). Across a publisher's sessions there
    /// is no order to keep: a publish nacked when its session broke may
    /// still reach the queue, after the next session's (RabbitMQ orders one
    /// channel's publishes only).
    pub(crate) out_of_order: Vec<String>,
    /// Delivered messages that were never confirmed (allowed).
    pub(crate) unconfirmed_delivered: usize,
    /// Of the messages published without confirm mode (`--unconfirmed`),
    /// how many were never delivered, and how many there were: reported,
    /// not a failure (nothing promises them, and a publisher's node that
    /// is down or cut off from the queue's master drops them).
    pub(crate) no_confirms_undelivered: (usize, usize),
    /// Delivered bodies that were never published (a broker bug).
    pub(crate) phantom: Vec<String>,
    /// What else the run observed.
    pub(crate) notes: Vec<String>,
    /// Heals after which the publisher got no confirm or the consumer no
    /// delivery within [`LIVENESS`]: the run fails on any.
    pub(crate) stalls: Vec<String>,
    /// Each node's digest of its copy when the copies still differed after
    /// the load stopped: the run fails.
    pub(crate) diverged: Option<String>,
    /// Queues that still held messages after the drain (with who holds
    /// them unacknowledged): messages no consumer can get, the run fails.
    pub(crate) stuck: Vec<String>,
    /// Messages confirmed and delivered to the consumers per second while
    /// the load ran.
    pub(crate) rates: (f64, f64),
    /// How long the drain after the load took, and how long the load ran.
    pub(crate) drain: (Duration, Duration),
}

impl Report {
    /// No confirmed message was lost, nothing unpublished came out, every
    /// repeat was flagged redelivered, the load moved again after every
    /// heal, and every node's copy of the queue had the same digest once
    /// the load stopped.
    pub(crate) fn pass(&self) -> bool {
        self.safe() && self.stalls.is_empty() && self.stuck.is_empty() && !self.slow_drain()
    }

    /// Nothing lost, nothing unpublished came out, every repeat flagged,
    /// the copies agree: what the run must never break, whatever the load's
    /// pace.
    pub(crate) fn safe(&self) -> bool {
        self.lost.is_empty()
            && self.phantom.is_empty()
            && self.unflagged.is_empty()
            && self.diverged.is_none()
            && self.confirmed > 0
    }

    /// The drain took longer than [`DRAIN_SHARE`] of the load's time: the
    /// consumers did not keep pace with what was confirmed.
    pub(crate) fn slow_drain(&self) -> bool {
        self.drain.0.as_secs_f64() > DRAIN_SHARE * self.drain.1.as_secs_f64()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let few = |v: &[String]| v.iter().take(10).cloned().collect::<Vec<_>>().join(", ");
        writeln!(
            f,
            "== chaos seed {} ({} nodes, {} queue(s), {} s of faults): {}",
            self.opts.seed,
            self.opts.nodes,
            self.opts.queues,
            self.opts.duration.as_secs(),
            if self.pass() { "PASS" } else { "FAIL" }
        )?;
        writeln!(f, "  faults injected: {}", self.faults.len())?;
        writeln!(
            f,
            "  published {}, confirmed {}, deliveries {} ({} repeats)",
            self.published, self.confirmed, self.deliveries, self.duplicates
        )?;
        writeln!(
            f,
            "  LOST (confirmed, never delivered): {} {}",
            self.lost.len(),
            few(&self.lost)
        )?;
        writeln!(
            f,
            "  delivered more than once without the redelivered flag: {} {}",
            self.unflagged.len(),
            few(&self.unflagged)
        )?;
        writeln!(
            f,
            "  out of publish order (first deliveries, not flagged): {} {}",
            self.out_of_order.len(),
            few(&self.out_of_order)
        )?;
        writeln!(
            f,
            "  delivered but never confirmed (allowed): {}",
            self.unconfirmed_delivered
        )?;
        if self.no_confirms_undelivered.1 > 0 {
            writeln!(
                f,
                "  published without confirms, never delivered (allowed): {} of {}",
                self.no_confirms_undelivered.0, self.no_confirms_undelivered.1
            )?;
        }
        write!(
            f,
            "  delivered but never published: {} {}",
            self.phantom.len(),
            few(&self.phantom)
        )?;
        write!(
            f,
            "\n  heals after which the load did not move within {LIVENESS:?}: {} {}",
            self.stalls.len(),
            few(&self.stalls)
        )?;
        write!(
            f,
            "\n  while the load ran: confirmed {:.0}/s, delivered {:.0}/s; drain {:.1} s after {:.1} s of load{}",
            self.rates.0,
            self.rates.1,
            self.drain.0.as_secs_f64(),
            self.drain.1.as_secs_f64(),
            if self.slow_drain() {
                " (SLOW: over a fifth of the load's time)"
            } else {
                ""
            }
        )?;
        for q in &self.stuck {
            write!(f, "\n  STUCK: {q}")?;
        }
        if let Some(each) = &self.diverged {
            write!(f, "\n  replicas that differ after the load stopped: {each}")?;
        }
        for n in &self.notes {
            write!(f, "\n  note: {n}")?;
        }
        Ok(())
    }
}

/// Everything the load saw.
#[derive(Default)]
struct History {
    /// Every body handed to `basic.publish`.
    published: BTreeSet<String>,
    /// Those published without confirm mode (`--unconfirmed`).
    no_confirms: BTreeSet<String>,
    /// Bodies the broker confirmed (`basic.ack`), with when.
    confirmed: BTreeMap<String, Instant>,
    /// Every delivery: body, redelivered flag, who got it (`consumer B`,
    /// `drain`) and when, in order.
    delivered: Vec<(String, bool, String, Instant)>,
    /// When each client (`publisher B`, `consumer C`, …) last moved: the
    /// times of its confirms or of its deliveries (not the drain's).
    moved: BTreeMap<String, Vec<Instant>>,
}

/// The drain may take at most this share of the load's time.
const DRAIN_SHARE: f64 = 0.2;

/// After each heal (a restarted node, a flushed rule, a SIGCONT), the load
/// must move again within this: a confirm to every publisher and a
/// delivery to every consumer.
const LIVENESS: Duration = Duration::from_secs(5);

/// When each fault ended and when the load stopped, for the liveness check.
struct Timeline {
    /// When each fault was healed.
    heals: Vec<Instant>,
    /// When the load started.
    started: Instant,
    /// When the load was told to stop.
    stopped: Instant,
}

/// The history check; `start` is when the run started.
fn check(
    opts: Options,
    h: &History,
    start: Instant,
    timeline: &Timeline,
    faults: Vec<String>,
    notes: Vec<String>,
) -> Report {
    let at = |t: Instant| (t - start).as_secs_f64();
    let mut stalls = Vec::new();
    for &healed in &timeline.heals {
        let by = healed + LIVENESS;
        if by > timeline.stopped {
            continue;
        }
        let moved = |t: &Instant| *t >= healed && *t <= by;
        for (client, times) in &h.moved {
            if !times.iter().any(moved) {
                // When it last moved before and first moved after: where
                // the stall began and whether it ended.
                let before = times.iter().filter(|t| **t < healed).max().copied();
                let after = times.iter().filter(|t| **t > by).min().copied();
                let when =
                    |t: Option<Instant>| t.map_or("never".to_owned(), |t| format!("{:.3}s", at(t)));
                stalls.push(format!(
                    "{client}: nothing in the {LIVENESS:?} after the heal at {:.3}s (last moved at {}, next at {})",
                    at(healed),
                    when(before),
                    when(after)
                ));
            }
        }
    }
    let load = timeline.stopped - timeline.started;
    let during = |kind: &str| {
        h.moved
            .iter()
            .filter(|(c, _)| c.starts_with(kind))
            .map(|(_, t)| t.len())
            .sum::<usize>() as f64
            / load.as_secs_f64().max(0.001)
    };
    let rates = (during("publisher"), during("consumer"));
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    // Each message's deliveries without the flag: who got it and when.
    let mut unflagged_by: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut out_of_order = Vec::new();
    // Per consumer and publisher session: what one consumer gets of one
    // channel's messages comes in publish order.
    let mut highest: BTreeMap<(&str, &str), (u64, Instant)> = BTreeMap::new();
    for (body, redelivered, by, when) in &h.delivered {
        let c = count.entry(body.as_str()).or_default();
        *c += 1;
        if !redelivered {
            unflagged_by
                .entry(body.as_str())
                .or_default()
                .push(format!("{by} at {:.3}s", at(*when)));
        }
        // Bodies end in "-<publisher>-s<its session>-m<its publish number>".
        let parsed = body.rsplit_once("-m").and_then(|(head, n)| {
            let (rest, _) = head.rsplit_once("-s")?;
            let publisher_session = &head[rest.rfind('-')? + 1..];
            Some((publisher_session, n.parse::<u64>().ok()?))
        });
        if *c == 1
            && !redelivered
            && let Some((publisher, n)) = parsed
        {
            let high = highest
                .entry((by.as_str(), publisher))
                .or_insert((0, *when));
            if n < high.0 {
                out_of_order.push(format!(
                    "{body} ({by} at {:.3}s, after m{} at {:.3}s)",
                    at(*when),
                    high.0,
                    at(high.1)
                ));
            } else {
                *high = (n, *when);
            }
        }
    }
    let unflagged = unflagged_by
        .into_iter()
        .filter(|(_, by)| by.len() > 1)
        .map(|(body, by)| format!("{body} ({})", by.join(", then ")))
        .collect();
    Report {
        opts,
        faults,
        published: h.published.len(),
        confirmed: h.confirmed.len(),
        deliveries: h.delivered.len(),
        lost: h
            .confirmed
            .iter()
            .filter(|(b, _)| !count.contains_key(b.as_str()))
            .map(|(b, at)| format!("{b} (confirmed at {:.3}s)", (*at - start).as_secs_f64()))
            .collect(),
        unflagged,
        duplicates: count.values().map(|c| c - 1).sum(),
        out_of_order,
        unconfirmed_delivered: count
            .keys()
            .filter(|b| !h.confirmed.contains_key(**b))
            .count(),
        no_confirms_undelivered: (
            h.no_confirms
                .iter()
                .filter(|b| !count.contains_key(b.as_str()))
                .count(),
            h.no_confirms.len(),
        ),
        phantom: count
            .keys()
            .filter(|b| !h.published.contains(**b))
            .map(|b| (*b).to_owned())
            .collect(),
        notes,
        stalls,
        diverged: None,
        stuck: Vec::new(),
        rates,
        drain: (Duration::ZERO, load),
    }
}

/// The cluster while the schedule runs: which node is up, shared with the
/// load so that it reconnects to a live node.
struct Cluster<'a> {
    bins: &'a Bins,
    ns: &'a Netns,
    secret: PathBuf,
    label: String,
    specs: Vec<Spec>,
    nodes: Vec<Option<Node>>,
    up: Arc<Vec<AtomicBool>>,
    start: Instant,
    /// The queues carrying the load.
    queues: Vec<RunQueue>,
}

impl Cluster<'_> {
    fn say(&self, what: &str) {
        println!(
            "[chaos {:>7.3}s] {what}",
            self.start.elapsed().as_secs_f64()
        );
    }

    /// Starts node `i` (joining A on its first start) and waits for it.
    fn start(&mut self, i: usize, join: bool) -> anyhow::Result<()> {
        let join = if join { Some(&self.specs[0]) } else { None };
        let node = spawn(self.bins, &self.secret, &self.label, &self.specs[i], join)?.ready()?;
        self.say(&format!(
            "{} is ready (pid {})",
            self.specs[i].name,
            node.pid().unwrap_or_default()
        ));
        self.nodes[i] = Some(node);
        self.up[i].store(true, Ordering::SeqCst);
        Ok(())
    }

    /// The first node that is up.
    fn any(&self) -> anyhow::Result<&Node> {
        self.nodes.iter().flatten().next().context("no node is up")
    }

    /// Queue `name` as the management API of node `node` shows it.
    fn queue(node: &Node, name: &str) -> Value {
        Self::queue_with(node, name, "")
    }

    /// [`Cluster::queue`] with a query string (`?digest=true`).
    fn queue_with(node: &Node, name: &str, query: &str) -> Value {
        match node.http("GET", &format!("/api/queues/%2F/{name}{query}"), None) {
            Ok((200, v)) => v,
            _ => Value::Null,
        }
    }

    /// Waits until, for every queue of the run, every node that is up shows
    /// the same master and the queue's synchronised mirrors (a node still
    /// cut off from the others would show its own stale view); false if it
    /// did not happen within `SYNC_WAIT`.
    fn wait_synchronised(&self) -> anyhow::Result<bool> {
        let deadline = Instant::now() + SYNC_WAIT;
        for q in &self.queues {
            loop {
                let seen = self.queue_views(q.name, "");
                let master = seen.first().map(|(_, v)| v["node"].clone());
                let agreed = seen.iter().all(|(_, v)| {
                    v["node"].is_string()
                        && Some(&v["node"]) == master.as_ref()
                        && names(v, "synchronised_slave_nodes").len() == q.mirrors
                });
                if agreed && !seen.is_empty() {
                    break;
                }
                if Instant::now() > deadline {
                    let views: Vec<String> = seen
                        .iter()
                        .map(|(n, v)| {
                            let synced = names(v, "synchronised_slave_nodes");
                            format!("{n}: master {}, synchronised {synced:?}", v["node"])
                        })
                        .collect();
                    self.say(&format!(
                        "{}: mirrors not synchronised after {SYNC_WAIT:?}: {}",
                        q.name,
                        views.join("; ")
                    ));
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(true)
    }

    /// Each live node's name and its view of queue `name` (`query`: the
    /// request's query string).
    fn queue_views(&self, name: &str, query: &str) -> Vec<(&str, Value)> {
        self.nodes
            .iter()
            .flatten()
            .map(|n| (n.spec.name.as_str(), Self::queue_with(n, name, query)))
            .collect()
    }

    /// Waits until, for every queue of the run, its master and each of its
    /// mirrors hold a copy with one and the same digest (`local_digest`:
    /// the same messages in the same order, settled alike); on a timeout,
    /// each node's digest of the first queue that differs.
    fn wait_replicas_agree(&self) -> Result<(), String> {
        let deadline = Instant::now() + SYNC_WAIT;
        for q in &self.queues {
            loop {
                let seen: Vec<(&str, Value)> = self
                    .queue_views(q.name, "?digest=true")
                    .into_iter()
                    .map(|(n, v)| (n, v["local_digest"].clone()))
                    .collect();
                let copies: Vec<&Value> = seen
                    .iter()
                    .map(|(_, d)| d)
                    .filter(|d| d.is_string())
                    .collect();
                if copies.len() == q.mirrors + 1 && copies.iter().all(|d| *d == copies[0]) {
                    break;
                }
                if Instant::now() > deadline {
                    let each: Vec<String> = seen.iter().map(|(n, d)| format!("{n}: {d}")).collect();
                    return Err(format!("{}: {}", q.name, each.join(", ")));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(())
    }

    /// Who holds queue `name`'s messages, as every live node shows it: the
    /// queue's consumers, and the channels with unacknowledged messages.
    fn holders(&self, name: &str) -> String {
        let mut out = Vec::new();
        for n in self.nodes.iter().flatten() {
            let q = Self::queue_with(n, name, "?digest=true");
            let consumers: Vec<String> = q["consumer_details"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| format!("{} on {}", c["consumer_tag"], c["channel_details"]["name"]))
                .collect();
            let channels: Vec<String> = match n.http("GET", "/api/channels", None) {
                Ok((200, Value::Array(list))) => list
                    .iter()
                    .filter(|ch| {
                        ch["messages_unacknowledged"]
                            .as_u64()
                            .is_some_and(|u| u > 0)
                    })
                    .map(|ch| format!("{} ({} unacked)", ch["name"], ch["messages_unacknowledged"]))
                    .collect(),
                _ => Vec::new(),
            };
            out.push(format!(
                "{}: consumers {consumers:?}, channels with unacked {channels:?}, unacked held by {}",
                n.spec.name, q["local_unacked_holders"]
            ));
        }
        out.join("; ")
    }

    /// Sends `signal` to node `i` with `kill`.
    fn signal(&self, i: usize, signal: &str) -> anyhow::Result<u32> {
        let pid = self.nodes[i]
            .as_ref()
            .and_then(Node::pid)
            .context("the node has no process")?;
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(pid)
    }

    /// Adds the iptables rules `rule` (after `-A INPUT`) for both directions
    /// between node `i` and every node of `others`.
    fn cut(&self, i: usize, others: &[usize], rule: &[&str]) -> anyhow::Result<()> {
        for &j in others {
            for (from, to) in [(i, j), (j, i)] {
                let (s, d) = (&self.specs[from].ip, &self.specs[to].ip);
                let mut args = vec!["-A", "INPUT", "-s", s, "-d", d];
                args.extend_from_slice(rule);
                self.ns.iptables(&args)?;
            }
        }
        Ok(())
    }

    /// Injects `fault` on node `i`, then brings it back after `pause`.
    fn inject(&mut self, fault: Fault, i: usize, pause: Duration) -> anyhow::Result<String> {
        let name = self.specs[i].name.clone();
        let ip = self.specs[i].ip.clone();
        let what = match fault {
            Fault::Kill => {
                self.up[i].store(false, Ordering::SeqCst);
                let node = self.nodes[i].take().context("the node is down")?;
                let pid = node.pid().unwrap_or_default();
                node.kill();
                format!("SIGKILL {name} (pid {pid}), restart in {pause:?}")
            }
            Fault::Term => {
                self.up[i].store(false, Ordering::SeqCst);
                let node = self.nodes[i].take().context("the node is down")?;
                let pid = node.pid().unwrap_or_default();
                self.say(&format!("SIGTERM {name} (pid {pid})"));
                match node.stop() {
                    Ok(()) => self.say(&format!("{name} exited")),
                    Err(e) => self.say(&format!("{name}: {e:#}")),
                }
                format!("SIGTERM {name} (pid {pid}), restart in {pause:?}")
            }
            Fault::Pause => {
                self.up[i].store(false, Ordering::SeqCst);
                let pid = self.signal(i, "STOP")?;
                format!("SIGSTOP {name} (pid {pid}), SIGCONT in {pause:?}")
            }
            Fault::Isolate { reset } => {
                let others: Vec<usize> = (0..self.specs.len()).filter(|&j| j != i).collect();
                let (rule, how): (&[&str], _) = if reset {
                    (
                        &["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
                        "REJECT tcp-reset",
                    )
                } else {
                    (&["-j", "DROP"], "DROP")
                };
                self.cut(i, &others, rule)?;
                format!(
                    "isolate {name} ({ip}) from the others ({how} both ways), heal in {pause:?}"
                )
            }
            Fault::Cut { other, one_way } => {
                let (o_name, o_ip) = (&self.specs[other].name, &self.specs[other].ip);
                if one_way {
                    self.ns
                        .iptables(&["-A", "INPUT", "-s", &ip, "-d", o_ip, "-j", "DROP"])?;
                    format!(
                        "drop what {name} ({ip}) sends {o_name} ({o_ip}), the other way open, heal in {pause:?}"
                    )
                } else {
                    self.cut(i, &[other], &["-j", "DROP"])?;
                    format!(
                        "cut {name} ({ip}) from {o_name} ({o_ip}) alone (DROP both ways), heal in {pause:?}"
                    )
                }
            }
            Fault::Flap { other, .. } => format!(
                "flap the link between {name} ({ip}) and {} ({}): cut and heal in turn every 0.5–2 s for {pause:?}",
                self.specs[other].name, self.specs[other].ip
            ),
            Fault::Lossy { other } => {
                let rule = [
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    "0.3",
                ];
                self.cut(i, &[other], &[&rule[..], &["-j", "DROP"]].concat())?;
                format!(
                    "drop 30% between {name} ({ip}) and {} ({}) both ways, heal in {pause:?}",
                    self.specs[other].name, self.specs[other].ip
                )
            }
            Fault::Slow { other } => {
                self.slow(i, other)?;
                format!(
                    "slow the link between {name} ({ip}) and {} ({}) to 1 Mbit/s each way, heal in {pause:?}",
                    self.specs[other].name, self.specs[other].ip
                )
            }
        };
        self.say(&what);
        match fault {
            Fault::Flap { other, seed } => self.flap(i, other, seed, pause)?,
            _ => std::thread::sleep(pause),
        }
        match fault {
            Fault::Pause => {
                self.signal(i, "CONT")?;
                self.up[i].store(true, Ordering::SeqCst);
                self.say(&format!("SIGCONT {name}"));
            }
            Fault::Kill | Fault::Term => {
                self.say(&format!("restarting {name}"));
                self.start(i, false)?;
            }
            Fault::Isolate { .. }
            | Fault::Lossy { .. }
            | Fault::Cut { .. }
            | Fault::Flap { .. } => {
                self.ns.iptables(&["-F", "INPUT"])?;
                self.say("healed (INPUT rules flushed)");
            }
            Fault::Slow { .. } => {
                self.ns.tc(&["qdisc", "del", "dev", "lo", "root"])?;
                self.say("healed (the link's qdisc removed)");
            }
        }
        Ok(what)
    }

    /// Holds the link between nodes `i` and `other` to 1 Mbit/s each way: an
    /// HTB qdisc on the namespace's loopback whose default class is
    /// unlimited, and one class of 1 Mbit/s per direction, chosen by the
    /// packets' source and destination addresses (nodes bind their own
    /// address when they dial a peer).
    fn slow(&self, i: usize, other: usize) -> anyhow::Result<()> {
        let tc = |args: &[&str]| self.ns.tc(args);
        tc(&[
            "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10", "r2q",
            "100000",
        ])?;
        tc(&[
            "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit",
        ])?;
        for (k, (from, to)) in [(i, other), (other, i)].into_iter().enumerate() {
            let class = format!("1:{}", 20 + k);
            tc(&[
                "class", "add", "dev", "lo", "parent", "1:", "classid", &class, "htb", "rate",
                "1mbit", "ceil", "1mbit",
            ])?;
            let (src, dst) = (
                format!("{}/32", self.specs[from].ip),
                format!("{}/32", self.specs[to].ip),
            );
            tc(&[
                "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "src", &src, "match", "ip", "dst", &dst, "flowid", &class,
            ])?;
        }
        Ok(())
    }

    /// Cuts and heals the link between nodes `i` and `other` in turn, each
    /// state for 0.5–2 s (drawn from `seed`), until `length` passed.
    fn flap(&self, i: usize, other: usize, seed: u64, length: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + length;
        let mut rng = Rng(seed);
        let mut cut = true;
        while Instant::now() < until {
            if cut {
                self.cut(i, &[other], &["-j", "DROP"])?;
            } else {
                self.ns.iptables(&["-F", "INPUT"])?;
            }
            cut = !cut;
            let left = until.saturating_duration_since(Instant::now());
            std::thread::sleep(Duration::from_millis(rng.range(500, 2_000)).min(left));
        }
        Ok(())
    }
}

/// Runs the schedule of `opts` with `bins` in a network namespace of its
/// own, data directories and logs under `work` (emptied first); returns
/// the history check's report.
pub(crate) fn run(opts: Options, bins: &Bins, work: &Path) -> anyhow::Result<Report> {
    let ns = Netns::create(&format!("warren-chaos-{}", std::process::id()))?;
    ns.run(|| run_in(&ns, opts, bins, work))
}

/// [`run`] on a thread inside `ns`.
fn run_in(ns: &Netns, opts: Options, bins: &Bins, work: &Path) -> anyhow::Result<Report> {
    if work.exists() {
        std::fs::remove_dir_all(work).with_context(|| format!("emptying {}", work.display()))?;
    }
    std::fs::create_dir_all(work)?;
    let secret = work.join("secret");
    std::fs::write(&secret, format!("chaos-{}-secret\n", opts.seed))?;
    let mut specs = Vec::new();
    for (n, short) in ["a", "b", "c", "d", "e"]
        .into_iter()
        .take(opts.nodes)
        .enumerate()
    {
        specs.push(Spec {
            name: format!("warren@{short}"),
            dir: work.join(short),
            log: work.join(format!("{short}.log")),
            amqp: 5672,
            http: 15672,
            metrics: 15692,
            peer: 25672,
            ip: format!("127.0.0.{}", n + 2),
            netns: Some(ns.name().to_owned()),
        });
    }
    let mut c = Cluster {
        bins,
        ns,
        secret,
        label: format!("chaos seed {}", opts.seed),
        nodes: specs.iter().map(|_| None).collect(),
        up: Arc::new(specs.iter().map(|_| AtomicBool::new(false)).collect()),
        specs,
        start: Instant::now(),
        queues: run_queues(opts),
    };
    for i in 0..opts.nodes {
        c.start(i, i > 0)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let a = c.any()?;
    let mut policies = vec![(
        "ha-all",
        json!({
            "pattern": "^ha\\.",
            "apply-to": "queues",
            "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
        }),
    )];
    if c.queues.iter().any(|q| q.name.starts_with("ha2.")) {
        policies.push((
            "ha-two",
            json!({
                "pattern": "^ha2\\.",
                "apply-to": "queues",
                "definition": {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"},
            }),
        ));
    }
    for (name, policy) in &policies {
        let (status, v) = a.http("PUT", &format!("/api/policies/%2F/{name}"), Some(policy))?;
        if status != 201 && status != 204 {
            bail!("setting the policy {name}: {status} {v}");
        }
    }
    for q in &c.queues {
        let home = c.nodes[q.home].as_ref().context("a queue's node is down")?;
        rt.block_on(async {
            let conn =
                Connection::connect(&home.amqp_url(), ConnectionProperties::default()).await?;
            let ch = conn.create_channel().await?;
            let opts = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            ch.queue_declare(q.name.into(), opts, FieldTable::default())
                .await?;
            let _ = conn.close(200, "bye".into()).await;
            anyhow::Ok(())
        })?;
    }
    if !c.wait_synchronised()? {
        bail!("the queues never got their synchronised mirrors");
    }
    for q in &c.queues {
        c.say(&format!(
            "{} declared on {} with {} synchronised mirrors",
            q.name, c.specs[q.home].name, q.mirrors
        ));
    }

    let load = Load {
        urls: c.specs.iter().map(Spec::amqp_url).collect(),
        names: c.specs.iter().map(|s| s.name.clone()).collect(),
        up: c.up.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        history: Arc::new(Mutex::new(History::default())),
        start: c.start,
    };
    let order = |first: usize| (0..opts.nodes).map(move |k| (first + k) % opts.nodes);
    // For every node and queue a publisher and a consumer, each preferring
    // that node; with one queue, named after the node alone.
    let mut clients = Vec::new();
    for (i, spec) in c.specs.iter().enumerate() {
        let letter = spec.name.rsplit('@').next().unwrap_or(&spec.name);
        for (k, q) in c.queues.iter().enumerate() {
            let (tag, of) = if c.queues.len() == 1 {
                (letter.to_owned(), String::new())
            } else {
                (format!("{letter}{k}"), format!(" on {}", q.name))
            };
            let client = |role: &str| Client {
                name: format!("{role} {}{of}", spec.name),
                queue: q.name,
                order: order(i).collect(),
            };
            clients.push(rt.spawn(publish(
                format!("chaos-{}-{tag}", opts.seed),
                client("publisher"),
                load.clone(),
                !(opts.unconfirmed && i == 1),
            )));
            clients.push(rt.spawn(consume(client("consumer"), load.clone())));
        }
    }
    let load_started = Instant::now();

    let mut rng = Rng(opts.seed);
    let mut faults = Vec::new();
    let mut heals = Vec::new();
    let mut notes = Vec::new();
    let faults_start = Instant::now();
    c.say(&format!(
        "load running; faults for {} s",
        opts.duration.as_secs()
    ));
    loop {
        let gap = Duration::from_millis(rng.range(2_000, 4_000));
        let i = usize::try_from(rng.range(0, opts.nodes as u64 - 1))?;
        let (fault, pause) = Fault::draw(&mut rng, &opts, i)?;
        std::thread::sleep(gap);
        if faults_start.elapsed() >= opts.duration {
            break;
        }
        if !c.wait_synchronised()? {
            notes.push(format!(
                "before fault {}: mirrors not synchronised within {SYNC_WAIT:?}",
                faults.len() + 1
            ));
        }
        let what = c.inject(fault, i, Duration::from_millis(pause))?;
        faults.push(format!("{:.3}s {what}", c.start.elapsed().as_secs_f64()));
        heals.push(Instant::now());
    }
    c.say("faults stopped; every node is up and connected");
    if c.wait_synchronised()? {
        c.say("every node shows the same master and synchronised mirrors");
    } else {
        notes.push(
            "after the faults: the nodes never agreed on a master with synchronised mirrors"
                .to_owned(),
        );
    }
    load.stop.store(true, Ordering::SeqCst);
    let timeline = Timeline {
        heals,
        started: load_started,
        stopped: Instant::now(),
    };
    for client in clients {
        if let Err(e) = rt.block_on(client)? {
            notes.push(format!("{e:#}"));
        }
    }
    let diverged = match c.wait_replicas_agree() {
        Ok(()) => {
            c.say("every copy of each queue has its master's digest");
            None
        }
        Err(each) => {
            c.say(&format!("the copies differ after {SYNC_WAIT:?}: {each}"));
            Some(each)
        }
    };
    let a = c.nodes[0].as_ref().context("A is down")?;
    for q in &c.queues {
        let v = Cluster::queue(a, q.name);
        c.say(&format!(
            "load stopped; draining {} through {}: messages {}, master {}, synchronised mirrors {:?}",
            q.name,
            a.spec.name,
            v["messages"],
            v["node"],
            names(&v, "synchronised_slave_nodes")
        ));
    }
    let drain_started = Instant::now();
    let names_of: Vec<&str> = c.queues.iter().map(|q| q.name).collect();
    let drained = rt.block_on(drain(&a.amqp_url(), &names_of))?;
    // (The drain ends after DRAIN_IDLE without a delivery.)
    let drain_took = drain_started.elapsed().saturating_sub(DRAIN_IDLE);
    c.say(&format!("drained {} deliveries", drained.len()));
    let mut stuck = Vec::new();
    for q in &c.queues {
        let v = Cluster::queue(a, q.name);
        c.say(&format!(
            "{} now shows messages {} (ready {}, unacknowledged {})",
            q.name, v["messages"], v["messages_ready"], v["messages_unacknowledged"]
        ));
        if v["messages"].as_u64() != Some(0) {
            stuck.push(format!(
                "{}: {} messages (ready {}, unacknowledged {}) after the drain; {}",
                q.name,
                v["messages"],
                v["messages_ready"],
                v["messages_unacknowledged"],
                c.holders(q.name)
            ));
        }
    }
    let mut h = std::mem::take(&mut *load.history.lock().expect("the history"));
    h.delivered.extend(drained);
    write_repeats(&work.join("repeats.txt"), &h, c.start)?;
    let mut report = check(opts, &h, c.start, &timeline, faults, notes);
    report.diverged = diverged;
    report.stuck = stuck;
    report.drain.0 = drain_took;
    if !report.lost.is_empty() {
        write_sessions(&work.join("lost.txt"), &h, &report.lost, c.start)?;
    }
    if !report.pass() {
        for s in &c.specs {
            println!("--- last lines of {}:\n{}", s.log.display(), tail(&s.log));
        }
    }
    Ok(report)
}

/// Connects to the first node of `order` that is up (waiting while none
/// is); returns the connection and the node's index.
async fn connect_live(
    urls: &[String],
    order: &[usize],
    up: &[AtomicBool],
    stop: &AtomicBool,
) -> Option<(Connection, usize)> {
    while !stop.load(Ordering::SeqCst) {
        for &i in order {
            if !up[i].load(Ordering::SeqCst) {
                continue;
            }
            let connect = Connection::connect(&urls[i], ConnectionProperties::default());
            if let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(5), connect).await {
                return Some((conn, i));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// A call on `conn` that ends with an error once the connection is lost
/// (looked at every 100 ms) or after 20 s: lapin leaves some calls (an
/// ack, a confirm) pending for ever on a connection whose node was
/// killed under them, and a client stuck there would read as a broker
/// that stopped delivering.
async fn live<T, E>(
    conn: &Connection,
    call: impl Future<Output = Result<T, E>>,
) -> anyhow::Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let call = tokio::time::timeout(Duration::from_secs(20), call);
    tokio::pin!(call);
    let mut check = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            r = &mut call => match r {
                Ok(r) => return Ok(r?),
                Err(_) => bail!("the broker did not answer within 20 s"),
            },
            _ = check.tick() => {
                if !conn.status().connected() {
                    bail!("the connection was lost");
                }
            }
        }
    }
}

/// Closes `conn` unless it is already lost (closing a lost connection
/// waits for a close-ok that never comes).
async fn close(conn: &Connection) {
    if conn.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
    }
}

/// What every client of the load shares.
#[derive(Clone)]
struct Load {
    /// Each node's AMQP URL.
    urls: Vec<String>,
    /// Each node's name.
    names: Vec<String>,
    /// Which nodes are up.
    up: Arc<Vec<AtomicBool>>,
    /// Set when the load is to stop.
    stop: Arc<AtomicBool>,
    /// What the clients saw.
    history: Arc<Mutex<History>>,
    /// When the run started (the clients' log lines count from it).
    start: Instant,
}

impl Load {
    /// Prints a client's session event (connected, session ended) with
    /// the run's clock, so that a failed run says where each client was.
    fn say(&self, what: &str) {
        println!(
            "[chaos {:>7.3}s] {what}",
            self.start.elapsed().as_secs_f64()
        );
    }

    /// Connects `me` to the first live node of its order, saying which.
    async fn connect(&self, me: &Client) -> Option<Connection> {
        let (conn, i) = connect_live(&self.urls, &me.order, &self.up, &self.stop).await?;
        self.say(&format!("{}: connected to {}", me.name, self.names[i]));
        Some(conn)
    }

    /// Says why a session of `client` ended, if it failed.
    fn ended(&self, client: &str, result: &anyhow::Result<()>) {
        if let Err(e) = result {
            self.say(&format!("{client}: session ended: {e:#}"));
        }
    }
}

/// One client of the load.
struct Client {
    /// How the report names it (`publisher warren@a`, `consumer warren@b on
    /// ha2.chaos`).
    name: String,
    /// The queue it publishes to or consumes from.
    queue: &'static str,
    /// The nodes it tries, in order.
    order: Vec<usize>,
}

/// A publisher: batches of 20 persistent messages into its queue with
/// unique bodies (`<prefix>-s<session>-m<n>`, a session per connection),
/// each batch's confirms awaited (20 s at most); on a failure it connects
/// to the next live node of its order and goes on with new bodies. Without
/// `confirms` (`--unconfirmed`), a batch every 50 ms, none confirmed.
async fn publish(prefix: String, me: Client, load: Load, confirms: bool) -> anyhow::Result<()> {
    let client = me.name.clone();
    let mut n = 0u64;
    let mut sessions = 0u64;
    while let Some(conn) = load.connect(&me).await {
        sessions += 1;
        let prefix = format!("{prefix}-s{sessions}");
        let session = async {
            let ch = live(&conn, conn.create_channel()).await?;
            if confirms {
                live(&conn, ch.confirm_select(ConfirmSelectOptions::default())).await?;
            }
            while !load.stop.load(Ordering::SeqCst) {
                let mut batch = Vec::new();
                for _ in 0..20 {
                    let body = format!("{prefix}-m{n}");
                    n += 1;
                    {
                        let mut h = load.history.lock().expect("the history");
                        h.published.insert(body.clone());
                        if !confirms {
                            h.no_confirms.insert(body.clone());
                        }
                    }
                    let confirm = live(
                        &conn,
                        ch.basic_publish(
                            "".into(),
                            me.queue.into(),
                            BasicPublishOptions::default(),
                            body.as_bytes(),
                            BasicProperties::default().with_delivery_mode(2),
                        ),
                    )
                    .await?;
                    batch.push((body, confirm));
                }
                if !confirms {
                    // Written: the publisher moves.
                    let now = Instant::now();
                    (load.history.lock().expect("the history").moved)
                        .entry(client.clone())
                        .or_default()
                        .push(now);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                let mut failed = false;
                for (body, confirm) in batch {
                    match tokio::time::timeout_at(deadline, live(&conn, confirm)).await {
                        Ok(Ok(c)) if c.is_ack() => {
                            let now = Instant::now();
                            let mut h = load.history.lock().expect("the history");
                            h.confirmed.insert(body, now);
                            h.moved.entry(client.clone()).or_default().push(now);
                        }
                        _ => failed = true,
                    }
                }
                if failed {
                    bail!("{client}: a batch was not confirmed");
                }
            }
            anyhow::Ok(())
        };
        let result = session.await;
        load.ended(&client, &result);
        close(&conn).await;
        if result.is_ok() {
            break;
        }
    }
    Ok(())
}

/// A consumer of its queue: prefetch 100, manual acks, every delivery
/// recorded before its ack; on a failure it connects to the next live node
/// of its order.
async fn consume(me: Client, load: Load) -> anyhow::Result<()> {
    let client = me.name.clone();
    while let Some(conn) = load.connect(&me).await {
        let session = async {
            let ch = live(&conn, conn.create_channel()).await?;
            live(&conn, ch.basic_qos(100, BasicQosOptions::default())).await?;
            let mut consumer = live(
                &conn,
                ch.basic_consume(
                    me.queue.into(),
                    "chaos".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
            while !load.stop.load(Ordering::SeqCst) {
                match tokio::time::timeout(Duration::from_millis(500), consumer.next()).await {
                    Err(_) => {}
                    Ok(Some(Ok(d))) => {
                        let body = String::from_utf8_lossy(&d.data).into_owned();
                        {
                            let mut h = load.history.lock().expect("the history");
                            h.delivered
                                .push((body, d.redelivered, client.clone(), Instant::now()));
                            h.moved
                                .entry(client.clone())
                                .or_default()
                                .push(Instant::now());
                        }
                        live(&conn, d.ack(BasicAckOptions::default())).await?;
                    }
                    Ok(Some(Err(e))) => bail!("{client}: {e}"),
                    Ok(None) => bail!("{client}: cancelled"),
                }
            }
            anyhow::Ok(())
        };
        let result = session.await;
        load.ended(&client, &result);
        close(&conn).await;
        if result.is_ok() {
            break;
        }
    }
    Ok(())
}

/// Writes every delivery of each message delivered more than once to
/// `path`, one line each (body, seconds since `start`, who, the redelivered
/// flag), for reading a failed run.
fn write_repeats(path: &Path, h: &History, start: Instant) -> anyhow::Result<()> {
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for (body, ..) in &h.delivered {
        *count.entry(body.as_str()).or_default() += 1;
    }
    let mut out = String::new();
    for (body, redelivered, by, when) in &h.delivered {
        if count[body.as_str()] > 1 {
            let t = when.saturating_duration_since(start).as_secs_f64();
            out.push_str(&format!("{body} {t:.3}s {by} redelivered={redelivered}\n"));
        }
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Writes, for each publisher session (`<prefix>-s<n>`) with a message in
/// `lost`, every message it published: when it was confirmed and every
/// delivery of it (who, when, redelivered), so that a loss can be traced
/// in the node logs.
fn write_sessions(path: &Path, h: &History, lost: &[String], start: Instant) -> anyhow::Result<()> {
    let session = |body: &str| body.rsplit_once("-m").map(|(s, _)| s.to_owned());
    let sessions: BTreeSet<String> = lost.iter().filter_map(|l| session(l)).collect();
    let t = |at: &Instant| at.saturating_duration_since(start).as_secs_f64();
    let ours = |body: &str| session(body).is_some_and(|s| sessions.contains(&s));
    let mut deliveries: BTreeMap<&str, String> = BTreeMap::new();
    for (body, redelivered, by, when) in &h.delivered {
        if ours(body) {
            let d = format!(" | {by} {:.3}s redelivered={redelivered}", t(when));
            deliveries.entry(body.as_str()).or_default().push_str(&d);
        }
    }
    let mut out = String::new();
    for body in h.published.iter().filter(|b| ours(b)) {
        let confirmed = h.confirmed.get(body).map(|at| format!("{:.3}s", t(at)));
        let delivered = deliveries.get(body.as_str()).map_or("", String::as_str);
        out.push_str(&format!(
            "{body} confirmed={}{delivered}\n",
            confirmed.as_deref().unwrap_or("-")
        ));
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// How long the drain waits for one more delivery before it is done.
const DRAIN_IDLE: Duration = Duration::from_secs(5);

/// Consumes (acking) `queues` through `url` until nothing came for
/// [`DRAIN_IDLE`]; returns every delivery (body, redelivered flag, `drain`,
/// when).
async fn drain(url: &str, queues: &[&str]) -> anyhow::Result<Vec<(String, bool, String, Instant)>> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(100, BasicQosOptions::default()).await?;
    let mut consumers = Vec::new();
    for q in queues {
        consumers.push(
            ch.basic_consume(
                (*q).into(),
                format!("chaos-drain-{q}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?,
        );
    }
    let mut all = futures::stream::select_all(consumers);
    let mut seen = Vec::new();
    while let Ok(Some(Ok(d))) = tokio::time::timeout(DRAIN_IDLE, all.next()).await {
        seen.push((
            String::from_utf8_lossy(&d.data).into_owned(),
            d.redelivered,
            "drain".to_owned(),
            Instant::now(),
        ));
        d.ack(BasicAckOptions::default()).await?;
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(seen)
}

#[cfg(test)]
mod tests {
    //! A short schedule (seed 1, 20 s of faults: a SIGKILL, then a partition)
    //! with the debug binaries of the target directory this test was built
    //! into. It needs root, `ip` and iptables: without them it is skipped
    //! with a message, unless `WARREN_REQUIRE_NETNS=1` makes it fail.

    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use std::time::Instant;

    use super::netns::Netns;
    use super::{History, Options, Timeline, check, run};
    use crate::scenario::Bins;

    #[test]
    fn the_history_check_finds_loss_repeats_and_reordering() {
        let start = Instant::now();
        let body = |n: u32| format!("chaos-9-a1-s1-m{n}");
        let mut h = History::default();
        for n in 1..=6 {
            h.published.insert(body(n));
            h.confirmed.insert(body(n), start);
        }
        let by = |c: &str, (b, r): (String, bool)| (b, r, format!("consumer {c}"), start);
        h.delivered = vec![
            by("A", (body(1), false)),
            by("A", (body(3), false)),
            by("A", (body(2), false)), // out of order, not flagged
            by("A", (body(3), true)),  // a flagged repeat
            by("B", (body(1), false)), // a repeat without the flag
            by("B", (body(5), false)), // B's first: in order
            // A redelivery recorded before the first delivery it repeats
            // (that one was in flight across a cut): right.
            by("A", (body(6), true)),
            by("B", (body(6), false)),
            by("A", ("chaos-9-m99".into(), false)), // never published
            // Another session of the same publisher: its own order.
            by("A", ("chaos-9-a1-s2-m1".into(), false)),
        ];
        h.published.insert("chaos-9-a1-s2-m1".into());
        let opts = Options {
            seed: 9,
            duration: Duration::from_secs(1),
            nodes: 3,
            queues: 1,
            busy: 0,
            long_pauses: false,
            slow_links: false,
            unconfirmed: false,
        };
        // The consumer's deliveries at 1 s and 2 s, the publisher's confirms
        // at 0 s; heals at 0.5 s (the consumer moved in the 5 s after it)
        // and 10 s (nothing after it: a stall), the load ran for 20 s.
        h.moved.insert(
            "consumer B".into(),
            vec![
                start + Duration::from_secs(1),
                start + Duration::from_secs(2),
            ],
        );
        h.moved.insert("publisher A".into(), vec![start; 5]);
        let timeline = Timeline {
            heals: vec![
                start + Duration::from_millis(500),
                start + Duration::from_secs(10),
            ],
            started: start,
            stopped: start + Duration::from_secs(20),
        };
        let mut r = check(opts, &h, start, &timeline, Vec::new(), Vec::new());
        assert_eq!(
            r.stalls,
            [
                "publisher A: nothing in the 5s after the heal at 0.500s (last moved at 0.000s, next at never)",
                "consumer B: nothing in the 5s after the heal at 10.000s (last moved at 2.000s, next at never)",
                "publisher A: nothing in the 5s after the heal at 10.000s (last moved at 0.000s, next at never)",
            ]
        );
        assert_eq!(r.rates, (0.25, 0.1));
        assert!(!r.slow_drain(), "no drain measured yet");
        r.drain.0 = Duration::from_secs(5);
        assert!(r.slow_drain(), "5 s of drain after 20 s of load");
        assert_eq!(r.lost.len(), 1, "m4: {:?}", r.lost);
        assert_eq!(
            r.unflagged,
            [format!(
                "{} (consumer A at 0.000s, then consumer B at 0.000s)",
                body(1)
            )]
        );
        assert_eq!(r.duplicates, 3);
        assert_eq!(
            r.out_of_order,
            [format!(
                "{} (consumer A at 0.000s, after m3 at 0.000s)",
                body(2)
            )]
        );
        assert_eq!(r.phantom, ["chaos-9-m99"]);
        assert!(!r.pass());
        assert!(r.to_string().contains("out of publish order"));
    }

    #[test]
    fn chaos_seed_1_loses_no_confirmed_message() {
        if let Err(e) = Netns::create(&format!("warren-probe-{}", std::process::id())) {
            let required = std::env::var("WARREN_REQUIRE_NETNS").is_ok_and(|v| v == "1");
            assert!(!required, "WARREN_REQUIRE_NETNS=1 but: {e:#}");
            println!("skipped: no network namespace with iptables here ({e:#})");
            return;
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root")
            .to_path_buf();
        // <target>/debug/deps/xtask-HASH
        let exe = std::env::current_exe().expect("the test binary");
        let target: PathBuf = exe
            .ancestors()
            .nth(3)
            .expect("a target directory")
            .to_path_buf();
        let bins = Bins::build(&root, &target).expect("building warren and warrenctl");
        let opts = Options {
            seed: 1,
            duration: Duration::from_secs(20),
            nodes: 3,
            queues: 1,
            busy: 0,
            long_pauses: false,
            slow_links: false,
            unconfirmed: false,
        };
        let report = run(opts, &bins, &root.join("target/chaos/1")).expect("the run");
        println!("{report}");
        // Safety and liveness (nothing left in the queue after the drain);
        // the drain's pace (whether consumers kept up with the confirms) is
        // reported, not asserted: a timing.
        assert!(
            report.safe() && report.stalls.is_empty() && report.stuck.is_empty(),
            "{report}\nreplay: {}",
            opts.replay()
        );
        assert!(
            report
                .faults
                .iter()
                .any(|f| f.contains("isolate") || f.contains("drop 30%")),
            "seed 1 injected no partition: {:?}",
            report.faults
        );
    }
}
