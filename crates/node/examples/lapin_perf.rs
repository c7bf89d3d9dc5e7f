//! A PerfTest-like load on lapin, a standard client library: each publish and
//! each `basic.ack` is its own call (lapin writes frames as they are made),
//! as applications do. The same load runs against any AMQP 0-9-1 broker.
//!
//! ```text
//! cargo run --release -p warren-node --example lapin_perf -- \
//!     --url amqp://guest:guest@127.0.0.1:5672/%2f --size 1024 --persistent \
//!     --confirms 100 --prefetch 200 --duration 15
//! ```
//!
//! It declares the queue (durable unless `--transient-queue`) and purges it,
//! runs producers and consumers for `--duration` seconds, deletes the queue
//! (neither purge nor delete with `--keep-queue`), and prints one line:
//! `result secs=… published=… confirmed=… consumed=… e2e_p50_ms=… e2e_p99_ms=…
//! confirm_p50_ms=… confirm_p99_ms=… consumed_total=… backlog=…` (rates per
//! second and latencies over the run; `consumed_total` the messages consumed
//! and `backlog` those published but not consumed when it ended).
//!
//! `--url` and `--consume-url` take comma-separated lists (e.g. every node of
//! a cluster): producers take the `--url`s in turn, consumers the
//! `--consume-url`s (by default the `--url`s).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// Load settings.
#[derive(Debug, Parser, Clone)]
struct Args {
    /// Broker URLs, comma-separated: producers take them in turn; the
    /// queue is declared through the first.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    url: Vec<String>,
    /// Consumers' broker URLs, comma-separated, taken in turn (default:
    /// `--url`), e.g. other cluster nodes.
    #[arg(long, value_delimiter = ',')]
    consume_url: Vec<String>,
    /// The queue.
    #[arg(long, default_value = "perf")]
    queue: String,
    /// Declare the queue non-durable.
    #[arg(long)]
    transient_queue: bool,
    /// Neither purge the queue before nor delete it after (whoever runs the
    /// load declared it and deletes it).
    #[arg(long)]
    keep_queue: bool,
    /// Producers, one connection each.
    #[arg(long, default_value_t = 1)]
    producers: usize,
    /// Consumers, one connection each.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Body size in bytes (at least 8: the send time).
    #[arg(long, default_value_t = 16)]
    size: usize,
    /// delivery-mode 2.
    #[arg(long)]
    persistent: bool,
    /// Publishes in flight per producer awaiting a confirm (0: no confirms).
    #[arg(long, default_value_t = 0)]
    confirms: usize,
    /// Consumers ack automatically (no basic.ack).
    #[arg(long)]
    auto_ack: bool,
    /// basic.qos prefetch count per consumer (0: unlimited).
    #[arg(long, default_value_t = 0)]
    prefetch: u16,
    /// Messages per second per producer (0: as fast as possible).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Seconds of load.
    #[arg(long, default_value_t = 15)]
    duration: u64,
}

/// Counters and latency samples shared by every task.
#[derive(Default)]
struct Stats {
    published: AtomicU64,
    confirmed: AtomicU64,
    consumed: AtomicU64,
    e2e_us: Mutex<Vec<u64>>,
    confirm_us: Mutex<Vec<u64>>,
}

/// What each producer or consumer task is given: the settings, the broker
/// URL it connects to, and the shared counters and stop flag.
struct Client {
    args: Args,
    url: String,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
}

impl Client {
    async fn connect(&self) -> anyhow::Result<Connection> {
        Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .with_context(|| format!("connect to {}", self.url))
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn percentile(v: &mut [u64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i] as f64 / 1000.0
}

async fn producer(client: Client) -> anyhow::Result<()> {
    let conn = client.connect().await.context("producer")?;
    let Client {
        args, stats, stop, ..
    } = client;
    let ch = conn.create_channel().await?;
    if args.confirms > 0 {
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
    }
    let props = if args.persistent {
        BasicProperties::default().with_delivery_mode(2)
    } else {
        BasicProperties::default()
    };
    let mut body = vec![0u8; args.size.max(8)];
    // Confirms are awaited by a task of their own, in order, so that each
    // one's latency is taken when it arrives, not when the producer next
    // looks; the semaphore keeps `--confirms` publishes in flight.
    let window = Arc::new(tokio::sync::Semaphore::new(args.confirms.max(1)));
    let (confirm_tx, mut confirm_rx) =
        tokio::sync::mpsc::unbounded_channel::<(u64, lapin::PublisherConfirm)>();
    let collector = {
        let (stats, window) = (stats.clone(), window.clone());
        tokio::spawn(async move {
            while let Some((t0, c)) = confirm_rx.recv().await {
                if c.await.is_err() {
                    break;
                }
                let latency = now_us().saturating_sub(t0);
                stats.confirm_us.lock().expect("stats").push(latency);
                stats.confirmed.fetch_add(1, Ordering::Relaxed);
                window.add_permits(1);
            }
        })
    };
    let started = Instant::now();
    let mut sent: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        if args.rate > 0.0 {
            let due = started + Duration::from_secs_f64(sent as f64 / args.rate);
            tokio::time::sleep_until(due.into()).await;
        }
        if args.confirms > 0 {
            window.acquire().await?.forget();
        }
        let t = now_us();
        body[..8].copy_from_slice(&t.to_be_bytes());
        let confirm = ch
            .basic_publish(
                "".into(),
                args.queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                props.clone(),
            )
            .await?;
        sent += 1;
        stats.published.fetch_add(1, Ordering::Relaxed);
        if args.confirms > 0 {
            let _ = confirm_tx.send((t, confirm));
        }
    }
    drop(confirm_tx);
    // The confirms still in flight are waited for, at most a few seconds.
    let _ = tokio::time::timeout(Duration::from_secs(5), collector).await;
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

async fn consumer(client: Client) -> anyhow::Result<()> {
    let conn = client.connect().await.context("consumer")?;
    let Client {
        args, stats, stop, ..
    } = client;
    let ch = conn.create_channel().await?;
    if args.prefetch > 0 {
        ch.basic_qos(args.prefetch, BasicQosOptions::default())
            .await?;
    }
    let mut deliveries = ch
        .basic_consume(
            args.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: args.auto_ack,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    while !stop.load(Ordering::Relaxed) {
        let next = tokio::time::timeout(Duration::from_millis(200), deliveries.next()).await;
        let Ok(Some(d)) = next else { continue };
        let d = d?;
        if d.data.len() >= 8 {
            let t = u64::from_be_bytes(d.data[..8].try_into().expect("8 bytes"));
            stats
                .e2e_us
                .lock()
                .expect("stats")
                .push(now_us().saturating_sub(t));
        }
        stats.consumed.fetch_add(1, Ordering::Relaxed);
        if !args.auto_ack {
            d.ack(BasicAckOptions::default()).await?;
        }
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let first = args.url.first().context("--url is empty")?;
    let setup = Connection::connect(first, ConnectionProperties::default())
        .await
        .context("connect")?;
    let ch = setup.create_channel().await?;
    ch.queue_declare(
        args.queue.as_str().into(),
        QueueDeclareOptions {
            durable: !args.transient_queue,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await?;
    if !args.keep_queue {
        ch.queue_purge(args.queue.as_str().into(), Default::default())
            .await?;
    }
    let stats = Arc::new(Stats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let consume_urls = if args.consume_url.is_empty() {
        &args.url
    } else {
        &args.consume_url
    };
    let client = |url: &String| Client {
        args: args.clone(),
        url: url.clone(),
        stats: stats.clone(),
        stop: stop.clone(),
    };
    for url in consume_urls.iter().cycle().take(args.consumers) {
        tasks.push(tokio::spawn(consumer(client(url))));
    }
    for url in args.url.iter().cycle().take(args.producers) {
        tasks.push(tokio::spawn(producer(client(url))));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.duration)).await;
    let counts = (
        stats.published.load(Ordering::Relaxed),
        stats.confirmed.load(Ordering::Relaxed),
        stats.consumed.load(Ordering::Relaxed),
    );
    let secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .map(|r| r.unwrap_or_else(|e| Err(e.into())))
        {
            eprintln!("task failed: {e:#}");
        }
    }
    if !args.keep_queue {
        let _ = ch
            .queue_delete(args.queue.as_str().into(), Default::default())
            .await;
    }
    let _ = setup.close(200, "done".into()).await;
    let mut e2e = std::mem::take(&mut *stats.e2e_us.lock().expect("stats"));
    let mut conf = std::mem::take(&mut *stats.confirm_us.lock().expect("stats"));
    println!(
        "result secs={secs:.1} published={:.0} confirmed={:.0} consumed={:.0} e2e_p50_ms={:.2} e2e_p99_ms={:.2} confirm_p50_ms={:.2} confirm_p99_ms={:.2} consumed_total={} backlog={}",
        counts.0 as f64 / secs,
        counts.1 as f64 / secs,
        counts.2 as f64 / secs,
        percentile(&mut e2e, 0.5),
        percentile(&mut e2e, 0.99),
        percentile(&mut conf, 0.5),
        percentile(&mut conf, 0.99),
        counts.2,
        counts.0.saturating_sub(counts.2),
    );
    Ok(())
}
