//! AMQP load generator on lapin: producers, consumers, message size,
//! confirms, persistence, duration; prints published/s, consumed/s and the
//! p50/p99 publish-to-delivery latency.
//!
//! ```text
//! cargo run --release -p warren-node --example amqp_bench -- \
//!     --url amqp://guest:guest@127.0.0.1:5672/%2f --size 16 --duration 10
//! ```

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// Load generator settings.
#[derive(Debug, Parser, Clone)]
struct Args {
    /// Broker URL.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    /// Publishing connections.
    #[arg(long, default_value_t = 1)]
    producers: usize,
    /// Consuming connections.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Message body size in bytes (at least 8: a timestamp).
    #[arg(long, default_value_t = 16)]
    size: usize,
    /// Publisher confirms in flight per producer (0 = no confirms).
    #[arg(long, default_value_t = 0)]
    confirms: usize,
    /// Persistent messages on a durable queue.
    #[arg(long)]
    persistent: bool,
    /// Manual acks (else auto-ack).
    #[arg(long)]
    manual_ack: bool,
    /// Consumer prefetch with manual acks.
    #[arg(long, default_value_t = 1000)]
    prefetch: u16,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Queue name.
    #[arg(long, default_value = "warren-bench")]
    queue: String,
    /// A durable queue even for transient messages (`--persistent` implies it).
    #[arg(long)]
    durable: bool,
    /// Use the queue as it is: neither delete it before nor after the run (for
    /// a queue set up beforehand, e.g. mirrored and synchronised).
    #[arg(long)]
    keep_queue: bool,
    /// Seconds to wait, after publishing stopped, for the consumers to drain
    /// the queue (0 = as long as it takes); past it the run ends anyway and
    /// says so.
    #[arg(long, default_value_t = 0)]
    drain_timeout: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let size = args.size.max(8);
    let setup = Connection::connect(&args.url, ConnectionProperties::default())
        .await
        .context("connecting")?;
    if !args.keep_queue {
        let ch = setup.create_channel().await?;
        let _ = ch
            .queue_delete(args.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let ch = setup.create_channel().await?;
    ch.queue_declare(
        args.queue.as_str().into(),
        QueueDeclareOptions {
            durable: args.persistent || args.durable,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;

    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let consumed = Arc::new(AtomicU64::new(0));
    let latencies: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();

    let mut consumers = Vec::new();
    for _ in 0..args.consumers {
        let (args, stop, consumed, latencies) = (
            args.clone(),
            stop.clone(),
            consumed.clone(),
            latencies.clone(),
        );
        let conn = Connection::connect(&args.url, ConnectionProperties::default()).await?;
        consumers.push(tokio::spawn(async move {
            let ch = conn.create_channel().await?;
            if args.manual_ack {
                ch.basic_qos(args.prefetch, BasicQosOptions::default())
                    .await?;
            }
            let c = ch
                .basic_consume(
                    args.queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions {
                        no_ack: !args.manual_ack,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            // An empty body (sent once the producers stopped) ends the run.
            // Deliveries are taken in the chunks that are ready, and each
            // chunk's acks (one basic.ack per message) are sent together
            // rather than each awaited before the next delivery is read.
            let mut c = c.ready_chunks(256);
            let mut done = false;
            while !done && let Some(chunk) = c.next().await {
                let mut acks = Vec::with_capacity(chunk.len());
                for d in chunk {
                    let d = d?;
                    if d.data.is_empty() {
                        done = true;
                        break;
                    }
                    if d.data.len() >= 8 && !stop.load(Ordering::Relaxed) {
                        let sent = u64::from_be_bytes(d.data[..8].try_into().unwrap_or([0; 8]));
                        let now = start.elapsed().as_micros() as u64;
                        if let Ok(mut l) = latencies.lock() {
                            l.push(now.saturating_sub(sent));
                        }
                    }
                    consumed.fetch_add(1, Ordering::Relaxed);
                    if args.manual_ack {
                        acks.push(d.acker);
                    }
                }
                futures::future::try_join_all(
                    acks.iter().map(|a| a.ack(BasicAckOptions::default())),
                )
                .await?;
            }
            let _ = conn.close(200, "done".into()).await;
            anyhow::Ok(())
        }));
    }

    let mut producers = Vec::new();
    for _ in 0..args.producers {
        let (args, stop, published) = (args.clone(), stop.clone(), published.clone());
        let conn = Connection::connect(&args.url, ConnectionProperties::default()).await?;
        producers.push(tokio::spawn(async move {
            let ch = conn.create_channel().await?;
            if args.confirms > 0 {
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
            }
            let props = if args.persistent {
                BasicProperties::default().with_delivery_mode(2)
            } else {
                BasicProperties::default()
            };
            let mut inflight = VecDeque::new();
            // Publishes are pipelined in batches (lapin sends them in call order).
            let batch = if args.confirms > 0 {
                args.confirms.clamp(1, 64)
            } else {
                64
            };
            while !stop.load(Ordering::Relaxed) {
                let now = start.elapsed().as_micros() as u64;
                let mut body = vec![0u8; size];
                body[..8].copy_from_slice(&now.to_be_bytes());
                let sends = (0..batch).map(|_| {
                    ch.basic_publish(
                        "".into(),
                        args.queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        props.clone(),
                    )
                });
                let confirms = futures::future::try_join_all(sends).await?;
                if args.confirms > 0 {
                    inflight.extend(confirms);
                    while inflight.len() > args.confirms {
                        if let Some(c) = inflight.pop_front() {
                            c.await?;
                            published.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                } else {
                    published.fetch_add(batch as u64, Ordering::Relaxed);
                }
            }
            for c in inflight {
                c.await?;
                published.fetch_add(1, Ordering::Relaxed);
            }
            let _ = conn.close(200, "done".into()).await;
            anyhow::Ok(())
        }));
    }

    // Warm up for a second, then measure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (p0, c0, t0) = (
        published.load(Ordering::Relaxed),
        consumed.load(Ordering::Relaxed),
        Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(args.duration)).await;
    let (p1, c1, secs) = (
        published.load(Ordering::Relaxed),
        consumed.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await??;
    }
    let ch = setup.create_channel().await?;
    for _ in 0..args.consumers {
        ch.basic_publish(
            "".into(),
            args.queue.as_str().into(),
            BasicPublishOptions::default(),
            b"",
            BasicProperties::default(),
        )
        .await?;
    }
    let drain = async {
        for c in consumers {
            c.await??;
        }
        anyhow::Ok(())
    };
    if args.drain_timeout == 0 {
        drain.await?;
    } else if let Ok(r) = tokio::time::timeout(Duration::from_secs(args.drain_timeout), drain).await
    {
        r?;
    } else {
        println!(
            "drain timed out after {} s: the consumers had not received every message",
            args.drain_timeout
        );
    }
    let mut lat = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "producers={} consumers={} size={} confirms={} persistent={} manual_ack={}",
        args.producers, args.consumers, size, args.confirms, args.persistent, args.manual_ack
    );
    println!(
        "published/s={:.0} consumed/s={:.0} latency p50={}us p99={}us",
        (p1 - p0) as f64 / secs,
        (c1 - c0) as f64 / secs,
        pct(0.50),
        pct(0.99)
    );
    // The whole run's cost, warm-up and drain included, for CPU per message.
    println!(
        "total_consumed={} cpu_s={:.2}",
        consumed.load(Ordering::Relaxed),
        own_cpu_seconds()
    );
    if !args.keep_queue {
        let ch = setup.create_channel().await?;
        let _ = ch
            .queue_delete(args.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = setup.close(200, "done".into()).await;
    Ok(())
}

/// CPU time (user + system) this process used so far, every thread's, from
/// `/proc/self/stat` (in USER_HZ ticks, 100 per second on Linux); 0 where
/// there is no `/proc`.
fn own_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // utime and stime are fields 14 and 15, 12 and 13 after the name's ')'.
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .map(|f| f.parse().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    (fields.get(11).unwrap_or(&0) + fields.get(12).unwrap_or(&0)) as f64 / 100.0
}
