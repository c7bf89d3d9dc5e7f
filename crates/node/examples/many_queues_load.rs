//! Load generator for many queues, on lapin: paced confirmed publishing of
//! persistent messages to N existing queues at R msg/s each, consumed with
//! acks. `cargo xtask bench many-queues` runs it against a Warren cluster.
//!
//! ```text
//! cargo run --release -p warren-node --example many_queues_load -- \
//!     --url amqp://guest:guest@127.0.0.1:5672/%2f --queues 1000 --rate 10
//! ```
//!
//! It prints `measuring` when the warm-up ends, a progress line every five
//! seconds, `done` when the measured window ends, then one `result` line:
//! `result secs=… confirmed=… consumed=… nacked=… p50_ms=… p99_ms=…`
//! (counts within the window; latency from publish to confirm).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// Load settings.
#[derive(Debug, Parser, Clone)]
struct Args {
    /// Broker URL.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    /// Queues, named `<prefix>0` … `<prefix>N-1`; they must exist.
    #[arg(long, default_value_t = 1000)]
    queues: usize,
    /// Queue name prefix.
    #[arg(long, default_value = "ha.q")]
    prefix: String,
    /// Messages per second per queue.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Publishing connections (and as many consuming ones); each takes every
    /// n-th queue.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// Seconds measured.
    #[arg(long, default_value_t = 30)]
    duration: u64,
}

/// Counters shared by the publishers and consumers.
#[derive(Default)]
struct Counters {
    confirmed: AtomicU64,
    nacked: AtomicU64,
    consumed: AtomicU64,
    /// Confirm latencies (µs) while measuring.
    latencies: Mutex<Vec<u64>>,
    measuring: AtomicBool,
    stop: AtomicBool,
}

impl Counters {
    fn snapshot(&self) -> [u64; 3] {
        [
            self.confirmed.load(Ordering::Relaxed),
            self.consumed.load(Ordering::Relaxed),
            self.nacked.load(Ordering::Relaxed),
        ]
    }
}

/// Unconfirmed publishes per publisher past which it stops publishing.
const MAX_UNCONFIRMED: u64 = 20_000;
/// Body size: 64 B.
const BODY: [u8; 64] = [0; 64];

/// Publishes persistent messages with confirms to `queues` at `rate` msg/s
/// each, paced every 10 ms: what is due goes out together.
async fn paced_publisher(
    url: String,
    queues: Vec<String>,
    rate: f64,
    counters: Arc<Counters>,
) -> anyhow::Result<()> {
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, lapin::PublisherConfirm)>();
    let sent = Arc::new(AtomicU64::new(0));
    let settled = Arc::new(AtomicU64::new(0));
    let collector = {
        let (counters, settled) = (counters.clone(), settled.clone());
        // Confirms are awaited as they come, not in publish order: a broker
        // confirms out of order across queues, and awaiting in order would
        // charge a slow queue's wait to every later publish.
        tokio::spawn(async move {
            let mut pending = futures::stream::FuturesUnordered::new();
            let mut open = true;
            while open || !pending.is_empty() {
                tokio::select! {
                    next = rx.recv(), if open => match next {
                        Some((at, confirm)) => pending.push(async move {
                            (at, confirm.await.is_ok_and(|c| c.is_ack()))
                        }),
                        None => open = false,
                    },
                    Some((at, ack)) = pending.next(), if !pending.is_empty() => {
                        settled.fetch_add(1, Ordering::Relaxed);
                        if ack {
                            counters.confirmed.fetch_add(1, Ordering::Relaxed);
                        } else {
                            counters.nacked.fetch_add(1, Ordering::Relaxed);
                        }
                        if counters.measuring.load(Ordering::Relaxed)
                            && let Ok(mut l) = counters.latencies.lock()
                        {
                            l.push(at.elapsed().as_micros() as u64);
                        }
                    }
                }
            }
        })
    };
    let props = BasicProperties::default().with_delivery_mode(2);
    let total_rate = rate * queues.len() as f64;
    let start = Instant::now();
    let mut next = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while !counters.stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let due = (start.elapsed().as_secs_f64() * total_rate) as u64;
        let done = sent.load(Ordering::Relaxed);
        let unsettled = done - settled.load(Ordering::Relaxed);
        let n = due
            .saturating_sub(done)
            .min(MAX_UNCONFIRMED.saturating_sub(unsettled));
        let at = Instant::now();
        let publishes = (0..n).map(|k| {
            let queue = &queues[(next + k as usize) % queues.len()];
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &BODY,
                props.clone(),
            )
        });
        let confirms = futures::future::try_join_all(publishes).await?;
        next += confirms.len();
        sent.fetch_add(confirms.len() as u64, Ordering::Relaxed);
        for confirm in confirms {
            let _ = tx.send((at, confirm));
        }
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(5), collector).await;
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.close(200, "done".into())).await;
    Ok(())
}

/// Consumes (acking each message) from every queue of `queues` on one
/// connection and channel, prefetch 50.
async fn consumer(url: String, queues: Vec<String>, counters: Arc<Counters>) -> anyhow::Result<()> {
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(50, BasicQosOptions::default()).await?;
    let mut tasks = Vec::new();
    for queue in queues {
        let mut stream = ch
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consuming from {queue}"))?;
        let counters = counters.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(Ok(d)) = stream.next().await {
                counters.consumed.fetch_add(1, Ordering::Relaxed);
                if d.ack(BasicAckOptions::default()).await.is_err() {
                    break;
                }
            }
        }));
    }
    while !counters.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for t in tasks {
        t.abort();
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.close(200, "done".into())).await;
    Ok(())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let names: Vec<String> = (0..args.queues)
        .map(|i| format!("{}{i}", args.prefix))
        .collect();
    let counters = Arc::new(Counters::default());
    let connections = args.connections.max(1);
    let mut tasks = Vec::new();
    for k in 0..connections {
        let share: Vec<String> = names.iter().skip(k).step_by(connections).cloned().collect();
        tasks.push(tokio::spawn(consumer(
            args.url.clone(),
            share.clone(),
            counters.clone(),
        )));
        tasks.push(tokio::spawn(paced_publisher(
            args.url.clone(),
            share,
            args.rate,
            counters.clone(),
        )));
    }
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;
    let before = counters.snapshot();
    counters.measuring.store(true, Ordering::Relaxed);
    say("measuring");
    let t0 = Instant::now();
    for s in 1..=args.duration {
        tokio::time::sleep_until((t0 + Duration::from_secs(s)).into()).await;
        if s % 5 == 0 || s == args.duration {
            let now = counters.snapshot();
            say(&format!(
                "{s} s: confirmed {}, consumed {}",
                now[0] - before[0],
                now[1] - before[1]
            ));
        }
    }
    let after = counters.snapshot();
    let secs = t0.elapsed().as_secs_f64();
    say("done");
    counters.measuring.store(false, Ordering::Relaxed);
    counters.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(15), t).await {
            Ok(Ok(Err(e))) => eprintln!("a load task failed: {e:#}"),
            Ok(Err(e)) => eprintln!("a load task panicked: {e}"),
            _ => {}
        }
    }
    let mut lat = counters
        .latencies
        .lock()
        .map(|l| l.clone())
        .unwrap_or_default();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .map_or(f64::NAN, |&us| us as f64 / 1e3)
    };
    say(&format!(
        "result secs={secs:.3} confirmed={} consumed={} nacked={} p50_ms={:.1} p99_ms={:.1}",
        after[0] - before[0],
        after[1] - before[1],
        after[2] - before[2],
        pct(0.50),
        pct(0.99)
    ));
    Ok(())
}
