//! GM ring benchmarks: confirmed broadcasts per second and confirm latency
//! (p50, p99) for rings of 1, 3 and 5 members, 64 B and 1 KiB payloads.
//!
//! - `inproc`: the sans-IO members in one thread, frames handed over directly
//!   (the protocol's own cost, no I/O).
//! - `mem`, `tcp`, `quic`: one `GmNode` per member (one task each) in one
//!   process, over the in-memory transport, TCP and QUIC on loopback.
//!
//! One member (the queue master's role) broadcasts in batches with a window
//! of unconfirmed messages. Run: `cargo bench -p warren-gm --bench gm`; the
//! latency table is printed at the end (`GM_BENCH_QUICK=1` for a short run).

#![allow(clippy::print_stdout, reason = "a bench prints its table")]

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use warren_gm::{
    Action, Config, Frame, GmNode, HeartbeatDetector, InMemoryAuthority, Member, MemberId,
    NodeConfig, RingEvent, View, ViewChange,
};
use warren_tls::ClusterCa;
use warren_transport::mem::MemNetwork;
use warren_transport::{ClusterSecret, NodeName, PeerAddr, Transport, TransportConfig};
use warren_transport_quic::{QuicOptions, QuicTransport};
use warren_transport_tcp::TcpTransport;

const BATCH: usize = 256;
const WINDOW: u64 = 8192;

/// Latency samples (µs) per bench id, for the table printed at the end.
static LATENCIES: LazyLock<Mutex<BTreeMap<String, Vec<u64>>>> = LazyLock::new(Mutex::default);
/// Messages and seconds measured per bench id.
static THROUGHPUT: LazyLock<Mutex<BTreeMap<String, (u64, f64)>>> = LazyLock::new(Mutex::default);

fn record(id: &str, lat: &[u64], count: u64, took: Duration) {
    LATENCIES
        .lock()
        .unwrap()
        .entry(id.to_owned())
        .or_default()
        .extend_from_slice(lat);
    let mut t = THROUGHPUT.lock().unwrap();
    let total = t.entry(id.to_owned()).or_insert((0, 0.0));
    total.0 += count;
    total.1 += took.as_secs_f64();
}

/// Tracks when each batch was broadcast, to time its confirm.
struct Timer {
    sent: VecDeque<(u64, Instant)>,
    samples: Vec<u64>,
}

impl Timer {
    fn new() -> Self {
        Self {
            sent: VecDeque::new(),
            samples: Vec::new(),
        }
    }

    /// Messages up to `last_seq` were handed to the ring at `at`.
    fn sent(&mut self, last_seq: u64, at: Instant) {
        self.sent.push_back((last_seq, at));
    }

    fn confirmed(&mut self, up_to: u64) {
        let now = Instant::now();
        while let Some(&(seq, at)) = self.sent.front() {
            if seq > up_to {
                break;
            }
            self.samples
                .push(now.duration_since(at).as_micros().min(u128::from(u64::MAX)) as u64);
            self.sent.pop_front();
        }
    }
}

/// A ring of sans-IO members in one thread.
struct InProc {
    members: Vec<Member>,
    index: BTreeMap<MemberId, usize>,
    queue: VecDeque<(usize, Frame)>,
    confirmed: u64,
    delivered: u64,
}

impl InProc {
    fn new(n: usize) -> Self {
        let node = NodeName::new("bench@local").unwrap();
        let mut view = View::empty();
        let mut members = Vec::new();
        let mut index = BTreeMap::new();
        for i in 0..n {
            let id = MemberId(i as u64 + 1);
            view = view
                .apply(&ViewChange::Join {
                    member: id,
                    after: (i > 0).then_some(MemberId(i as u64)),
                    node: node.clone(),
                })
                .unwrap();
            members.push(Member::new(id, Config::default()));
            index.insert(id, i);
        }
        let mut ring = Self {
            members,
            index,
            queue: VecDeque::new(),
            confirmed: 0,
            delivered: 0,
        };
        for m in &mut ring.members {
            m.handle_view(view.clone());
        }
        ring.settle(&mut Timer::new());
        ring
    }

    fn drain(&mut self, i: usize, timer: &mut Timer) {
        let Self {
            members,
            index,
            queue,
            ..
        } = self;
        for a in members[i].drain_actions() {
            match a {
                Action::Send { to, frame } => queue.push_back((index[&to], frame)),
                Action::Confirm { up_to } => {
                    self.confirmed = up_to;
                    timer.confirmed(up_to);
                }
                Action::Deliver { .. } => self.delivered += 1,
                _ => {}
            }
        }
    }

    /// Delivers every frame in flight, flushing members as they go idle.
    fn settle(&mut self, timer: &mut Timer) {
        loop {
            for i in 0..self.members.len() {
                self.members[i].flush();
                self.drain(i, timer);
            }
            if self.queue.is_empty() {
                return;
            }
            while let Some((i, frame)) = self.queue.pop_front() {
                self.members[i].handle_frame(frame);
                self.drain(i, timer);
            }
        }
    }

    /// Broadcasts `count` messages from member 0, at most `window` unconfirmed,
    /// and returns once all are confirmed.
    fn run(&mut self, count: u64, window: u64, payload: &Bytes, timer: &mut Timer) -> Duration {
        let start = Instant::now();
        let target = self.members[0].last_broadcast() + count;
        while self.confirmed < target {
            let sent = self.members[0].last_broadcast();
            if sent < target && sent - self.confirmed < window {
                let n = (target - sent).min(BATCH as u64).min(window);
                let at = Instant::now();
                for _ in 0..n {
                    self.members[0].broadcast(payload.clone()).unwrap();
                }
                timer.sent(self.members[0].last_broadcast(), at);
                self.drain(0, timer);
            }
            // One hop per turn: every member handles what reached it, then flushes.
            let frames: Vec<(usize, Frame)> = self.queue.drain(..).collect();
            for (i, frame) in frames {
                self.members[i].handle_frame(frame);
                self.drain(i, timer);
            }
            for i in 0..self.members.len() {
                self.members[i].flush();
                self.drain(i, timer);
            }
        }
        start.elapsed()
    }
}

fn sizes() -> [(usize, &'static str); 2] {
    [(64, "64B"), (1024, "1KiB")]
}

fn bench_inproc(c: &mut Criterion) {
    let mut g = c.benchmark_group("gm/inproc");
    g.throughput(Throughput::Elements(1));
    g.sample_size(10);
    for members in [1, 3, 5] {
        for (size, label) in sizes() {
            let payload = Bytes::from(vec![7u8; size]);
            let id = format!("inproc/{members}/{label}");
            let mut ring = InProc::new(members);
            for (window, mode) in [(WINDOW, "load"), (1, "idle")] {
                let id = format!("{id}/{mode}");
                g.bench_function(format!("{members}members/{label}/{mode}"), |b| {
                    b.iter_custom(|iters| {
                        let mut timer = Timer::new();
                        let took = ring.run(iters, window, &payload, &mut timer);
                        record(&id, &timer.samples, iters, took);
                        took
                    });
                });
            }
        }
    }
    g.finish();
}

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("gm-bench").expect("CA"));

fn transport(kind: &str, node: &NodeName, mem: &MemNetwork) -> Arc<dyn Transport> {
    let config = TransportConfig::new(node.clone(), ClusterSecret::new("bench"));
    match kind {
        "mem" => Arc::new(mem.transport(config)),
        "tcp" => Arc::new(TcpTransport::new(config)),
        _ => {
            let id = CA.issue(node.as_str()).expect("certificate");
            Arc::new(QuicTransport::new(config, &id, &QuicOptions::loopback()).expect("quic"))
        }
    }
}

/// A ring of `GmNode`s over a real transport.
struct NetRing {
    _nodes: Vec<GmNode>,
    publisher: warren_gm::RingHandle,
    confirmed: u64,
    sent: u64,
}

async fn net_ring(kind: &str, members: usize) -> NetRing {
    let mem = MemNetwork::new(1);
    let authority = Arc::new(InMemoryAuthority::new());
    let mut nodes = Vec::new();
    for i in 0..members {
        let name = NodeName::new(format!("b{i}@bench")).unwrap();
        let listen = if kind == "mem" {
            PeerAddr::new(name.as_str())
        } else {
            PeerAddr::new("127.0.0.1:0")
        };
        let mut config = NodeConfig::new(name.clone(), listen);
        config.tick_interval = Duration::from_millis(5);
        let detector = HeartbeatDetector::new(Duration::from_millis(100), Duration::from_secs(10));
        let t = transport(kind, &name, &mem);
        nodes.push(
            GmNode::start(config, t, authority.clone(), Box::new(detector))
                .await
                .unwrap(),
        );
    }
    for a in &nodes {
        for b in &nodes {
            if a.node() != b.node() {
                a.add_peer(b.node().clone(), b.local_addr().clone())
                    .await
                    .unwrap();
            }
        }
    }
    let mut handles = Vec::new();
    for node in &nodes {
        let h = node.join("bench").await.unwrap();
        let want = handles.len() as u64 + 1;
        let mut events = Vec::new();
        'wait: while h.next_events(&mut events).await {
            for e in events.drain(..) {
                if matches!(e, RingEvent::View { version } if version >= want) {
                    break 'wait;
                }
            }
        }
        handles.push(h);
    }
    // Every member must hold the whole view before traffic starts.
    for h in handles.iter().skip(1).rev() {
        let mut events = Vec::new();
        let mut seen = 0;
        while seen < members as u64 {
            let got =
                tokio::time::timeout(Duration::from_millis(200), h.next_events(&mut events)).await;
            for e in events.drain(..) {
                if let RingEvent::View { version } = e {
                    seen = seen.max(version);
                }
            }
            if got.is_err() {
                break;
            }
        }
    }
    let publisher = handles.remove(0);
    // Keep the other members' event queues drained.
    for h in handles {
        tokio::spawn(async move {
            let mut events = Vec::new();
            while h.next_events(&mut events).await {
                events.clear();
            }
        });
    }
    NetRing {
        _nodes: nodes,
        publisher,
        confirmed: 0,
        sent: 0,
    }
}

impl NetRing {
    async fn run(
        &mut self,
        count: u64,
        window: u64,
        payload: &Bytes,
        timer: &mut Timer,
    ) -> Duration {
        let start = Instant::now();
        let target = self.sent + count;
        let mut events = Vec::new();
        while self.confirmed < target {
            while self.sent < target && self.sent - self.confirmed < window {
                let n = (target - self.sent).min(BATCH as u64).min(window) as usize;
                let batch = vec![payload.clone(); n];
                let at = Instant::now();
                self.sent = self.publisher.broadcast(batch).await.unwrap();
                timer.sent(self.sent, at);
            }
            if !self.publisher.next_events(&mut events).await {
                break;
            }
            for e in events.drain(..) {
                if let RingEvent::Confirm { up_to } = e {
                    self.confirmed = up_to;
                    timer.confirmed(up_to);
                }
            }
        }
        start.elapsed()
    }
}

fn bench_net(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for kind in ["mem", "tcp", "quic"] {
        let mut g = c.benchmark_group(format!("gm/{kind}"));
        g.throughput(Throughput::Elements(1));
        g.sample_size(10);
        for members in [1, 3, 5] {
            let ring = Arc::new(tokio::sync::Mutex::new(
                rt.block_on(net_ring(kind, members)),
            ));
            for (size, label) in sizes() {
                let payload = Bytes::from(vec![7u8; size]);
                for (window, mode) in [(WINDOW, "load"), (1, "idle")] {
                    let id = format!("{kind}/{members}/{label}/{mode}");
                    g.bench_function(format!("{members}members/{label}/{mode}"), |b| {
                        b.to_async(&rt).iter_custom(|iters| {
                            let ring = ring.clone();
                            let payload = payload.clone();
                            let id = id.clone();
                            async move {
                                let mut timer = Timer::new();
                                let mut ring = ring.lock().await;
                                let took = ring.run(iters, window, &payload, &mut timer).await;
                                record(&id, &timer.samples, iters, took);
                                took
                            }
                        });
                    });
                }
            }
        }
        g.finish();
    }
    drop(rt);
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn print_table(_c: &mut Criterion) {
    let lat = LATENCIES.lock().unwrap();
    let thr = THROUGHPUT.lock().unwrap();
    let pct = |id: &str| {
        let mut s = lat.get(id).cloned().unwrap_or_default();
        s.sort_unstable();
        (percentile(&s, 0.5), percentile(&s, 0.99))
    };
    println!();
    println!(
        "| transport | members | payload | confirmed msgs/s (window {WINDOW}) | p50 / p99 confirm latency under that load | p50 / p99 one message at a time |"
    );
    println!("|---|---|---|---|---|---|");
    let bases: std::collections::BTreeSet<String> = lat
        .keys()
        .filter_map(|id| id.rsplit_once('/').map(|(base, _)| base.to_owned()))
        .collect();
    for base in bases {
        let parts: Vec<&str> = base.split('/').collect();
        let load = format!("{base}/load");
        let (l50, l99) = pct(&load);
        let (i50, i99) = pct(&format!("{base}/idle"));
        println!(
            "| {} | {} | {} | {:.0} | {l50} µs / {l99} µs | {i50} µs / {i99} µs |",
            parts[0],
            parts[1],
            parts[2],
            thr.get(&load).map_or(0.0, |&(n, secs)| n as f64 / secs),
        );
    }
}

fn config() -> Criterion {
    let quick = std::env::var_os("GM_BENCH_QUICK").is_some();
    let c = Criterion::default().configure_from_args();
    if quick {
        c.warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
    } else {
        c.warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_inproc, bench_net, print_table
}
criterion_main!(benches);
