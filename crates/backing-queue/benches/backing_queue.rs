//! Backing-queue benchmarks: publish → fetch → ack cycles (transient and
//! persistent, 16 B and 1 KiB), persistent 1 KiB with confirms from 64
//! concurrent publishers (group commit), and memory per queued message.
//!
//! `cargo bench -p warren-backing-queue -- --quick`

use std::collections::VecDeque;
use std::hint::black_box;
use std::io::Write;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use warren_backing_queue::{BackingQueue, NewMessage, QueueConfig, StoreConfig, SyncJob};

const SIZES: [(usize, &str); 2] = [(16, "16B"), (1024, "1KiB")];
/// Persistent cycles are group-committed every this many.
const SYNC_EVERY: u64 = 256;

fn cycles(c: &mut Criterion) {
    let mut g = c.benchmark_group("cycle");
    g.throughput(Throughput::Elements(1));
    for (size, name) in SIZES {
        let body = Bytes::from(vec![7u8; size]);
        g.bench_function(BenchmarkId::new("transient", name), |b| {
            let mut q = BackingQueue::in_memory(QueueConfig::default());
            let mut id = 0;
            b.iter(|| {
                id += 1;
                q.publish(0, NewMessage::new(id, body.clone(), false))
                    .unwrap();
                let d = q.fetch(0).unwrap().unwrap();
                q.ack(black_box(d.tag)).unwrap();
            });
        });
        g.bench_function(BenchmarkId::new("persistent", name), |b| {
            let dir = tempfile::tempdir().unwrap();
            persistent_cycles(b, dir.path(), &body);
        });
        // The same on tmpfs, where fsync is nearly free: what the log costs
        // in CPU and syscalls, without the device.
        if let Ok(dir) = tempfile::tempdir_in("/dev/shm") {
            g.bench_function(BenchmarkId::new("persistent_tmpfs", name), |b| {
                persistent_cycles(b, dir.path(), &body);
            });
        }
    }
    g.finish();
}

fn persistent_cycles(b: &mut criterion::Bencher<'_>, dir: &std::path::Path, body: &Bytes) {
    let (mut q, _) =
        BackingQueue::open(dir, QueueConfig::default(), StoreConfig::default()).unwrap();
    let mut id = 0;
    b.iter(|| {
        id += 1;
        q.publish(0, NewMessage::new(id, body.clone(), true))
            .unwrap();
        let d = q.fetch(0).unwrap().unwrap();
        q.ack(black_box(d.tag)).unwrap();
        if id % SYNC_EVERY == 0 {
            q.sync().unwrap();
        }
    });
}

enum Event {
    Publish(usize),
    Synced(SyncJob),
}

/// `publishers` threads each keep `window` publishes awaiting confirm; one
/// queue thread publishes, consumes and acks, and hands group commits to a
/// sync thread while it goes on appending. Returns the time for `total` confirms.
fn confirmed_run(tmpfs: bool, publishers: usize, window: u64, total: u64) -> Duration {
    let dir = if tmpfs {
        tempfile::tempdir_in("/dev/shm")
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let (mut q, _) =
        BackingQueue::open(dir.path(), QueueConfig::default(), StoreConfig::default()).unwrap();
    let body = Bytes::from(vec![7u8; 1024]);
    let per = total.div_ceil(publishers as u64);
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let (job_tx, job_rx) = mpsc::channel::<SyncJob>();
    let start = Instant::now();
    std::thread::scope(|s| {
        let syncer_tx = ev_tx.clone();
        s.spawn(move || {
            for mut job in job_rx {
                job.run().unwrap();
                if syncer_tx.send(Event::Synced(job)).is_err() {
                    break;
                }
            }
        });
        let mut confirm_txs = Vec::new();
        for p in 0..publishers {
            let (ctx, crx) = mpsc::channel::<u64>();
            confirm_txs.push(ctx);
            let tx = ev_tx.clone();
            s.spawn(move || {
                let mut sent = 0;
                let mut confirmed = 0;
                while sent < per.min(window) {
                    tx.send(Event::Publish(p)).unwrap();
                    sent += 1;
                }
                while confirmed < per {
                    confirmed += crx.recv().unwrap();
                    while sent < per && sent - confirmed < window {
                        tx.send(Event::Publish(p)).unwrap();
                        sent += 1;
                    }
                }
            });
        }
        drop(ev_tx);
        let mut owners: VecDeque<(u64, usize)> = VecDeque::new();
        let mut confirmed = Vec::new();
        let mut in_flight = false;
        let mut done = 0u64;
        let mut id = 0u64;
        let target = per * publishers as u64;
        while done < target {
            let first = ev_rx.recv().unwrap();
            for ev in std::iter::once(first).chain(ev_rx.try_iter()) {
                match ev {
                    Event::Publish(p) => {
                        id += 1;
                        let r = q
                            .publish(0, NewMessage::new(id, body.clone(), true))
                            .unwrap();
                        owners.push_back((r.seq, p));
                        let d = q.fetch(0).unwrap().unwrap();
                        q.ack(d.tag).unwrap();
                    }
                    Event::Synced(job) => {
                        q.complete_sync(&job).unwrap();
                        in_flight = false;
                        q.drain_confirmed(&mut confirmed);
                        let mut counts = vec![0u64; publishers];
                        for seq in confirmed.drain(..) {
                            while let Some((s, p)) = owners.pop_front() {
                                counts[p] += 1;
                                if s == seq {
                                    break;
                                }
                            }
                        }
                        for (p, n) in counts.into_iter().enumerate() {
                            if n > 0 {
                                done += n;
                                let _ = confirm_txs[p].send(n);
                            }
                        }
                    }
                }
            }
            if !in_flight && q.needs_sync() {
                job_tx.send(q.prepare_sync().unwrap().unwrap()).unwrap();
                in_flight = true;
            }
        }
        drop(job_tx);
    });
    start.elapsed()
}

fn confirms(c: &mut Criterion) {
    let mut g = c.benchmark_group("confirmed_persistent_1KiB");
    g.throughput(Throughput::Elements(1));
    g.sample_size(10);
    let tmpfs = std::path::Path::new("/dev/shm").is_dir();
    for (on_tmpfs, name) in [
        (false, "64_publishers_window"),
        (true, "tmpfs_64_publishers_window"),
    ] {
        if on_tmpfs && !tmpfs {
            continue;
        }
        for window in [1u64, 16] {
            g.bench_function(BenchmarkId::new(name, window), |b| {
                b.iter_custom(|iters| confirmed_run(on_tmpfs, 64, window, iters.max(64)));
            });
        }
    }
    g.finish();
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

const MEM_VAR: &str = "WARREN_BQ_MEMORY_SIZE";

/// Resident memory per queued message, from the RSS of a fresh process (this
/// bench binary re-executed), so that no earlier run's freed memory counts.
fn memory_report() {
    let mut out = std::io::stdout().lock();
    if let Ok(size) = std::env::var(MEM_VAR) {
        let size: usize = size.parse().unwrap_or(16);
        let n: u64 = if size > 100 { 250_000 } else { 1_000_000 };
        let before = rss_bytes();
        let mut q = BackingQueue::in_memory(QueueConfig::default());
        for id in 0..n {
            q.publish(0, NewMessage::new(id, vec![id as u8; size], false))
                .unwrap();
        }
        let per = (rss_bytes().saturating_sub(before)) as f64 / n as f64;
        let _ = writeln!(
            out,
            "memory/{size}B: {n} queued messages, {per:.1} B resident per message \
             (target <= {} B = 2 x {size} + 100)",
            2 * size + 100
        );
        black_box(&q);
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    for (size, _) in SIZES {
        if let Ok(o) = std::process::Command::new(&exe)
            .env(MEM_VAR, size.to_string())
            .output()
        {
            let _ = out.write_all(&o.stdout);
        }
    }
}

fn main() {
    memory_report();
    if std::env::var_os(MEM_VAR).is_some() {
        return;
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    cycles(&mut c);
    confirms(&mut c);
    c.final_summary();
}
