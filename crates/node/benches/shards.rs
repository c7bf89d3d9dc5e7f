//! The shard model's bench (`cargo xtask bench shards`): one node of
//! `--shards N` inside this process, as `warren --shards N` runs it (its
//! brokers, metadata, links, group commits and connection shell), driven by
//! `--queues K` independent loads of the lean generator (`loadgen`), each
//! with its own queue, producer and consumer, over in-process streams
//! instead of sockets. Load `i`'s connections go to shard `i mod N`, where
//! its queue lives (declared there, `client-local`).
//!
//! The generator runs on a thread of its own, so that its CPU can be told
//! from the broker's. Prints one `result` line: consumed and published per
//! second summed over the loads, the broker's CPU seconds (the process's
//! less the generator thread's), and each shard lock's held seconds.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use warren::shards::InProcess;

// Shared with `examples/amqp_bench.rs`; each uses part of it.
#[allow(dead_code)]
#[path = "../examples/loadgen/mod.rs"]
mod loadgen;

/// The bench's settings.
#[derive(Debug, Parser)]
struct Args {
    /// Shards of the node.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Independent loads, each with its own queue.
    #[arg(long, default_value_t = 2)]
    queues: usize,
    /// Seconds each load is measured (after a second of warm-up).
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// 1 KiB persistent messages with 100 confirms in flight and manual
    /// acks (else 16 B transient, auto-ack, no confirms).
    #[arg(long)]
    persistent: bool,
    /// Ignored: `cargo bench` passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

/// CPU seconds (user + system) the calling thread has used.
fn thread_cpu_seconds() -> f64 {
    loadgen::cpu_seconds("/proc/thread-self/stat")
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    // The node's runtime: a worker thread per shard, as `warren` starts.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.shards.max(1))
        .enable_all()
        .build()?;
    let node = Arc::new(rt.block_on(InProcess::start(dir.path(), args.shards))?);
    // The generator's thread, with a runtime of its own.
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let workload: &[&str] = if args.persistent {
        &[
            "--size",
            "1024",
            "--confirms",
            "100",
            "--persistent",
            "--manual-ack",
        ]
    } else {
        &["--size", "16"]
    };
    let cpu0 = loadgen::own_cpu_seconds();
    let held0 = node.lock_held();
    let started = Instant::now();
    let (reports, client_cpu) = clients.block_on(async {
        let cpu0 = thread_cpu_seconds();
        let mut loads = Vec::new();
        for i in 0..args.queues {
            let duration = args.duration.to_string();
            let queue = format!("shards-bench-{i}");
            let mut argv = vec![
                "loadgen",
                "--duration",
                duration.as_str(),
                "--queue",
                queue.as_str(),
            ];
            argv.extend_from_slice(workload);
            let load = loadgen::Args::parse_from(argv);
            let (node, rt) = (node.clone(), rt.handle().clone());
            let dial: loadgen::Dial = Arc::new(move || {
                let (node, rt) = (node.clone(), rt.clone());
                Box::pin(async move {
                    let stream = rt.spawn(async move { node.connect(i).await }).await?;
                    anyhow::Ok(Box::new(stream) as Box<dyn loadgen::ByteStream>)
                })
            });
            loads.push(tokio::spawn(loadgen::run(load, dial)));
        }
        let mut reports = Vec::new();
        for l in loads {
            reports.push(l.await??);
        }
        anyhow::Ok((reports, thread_cpu_seconds() - cpu0))
    })?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = loadgen::own_cpu_seconds() - cpu0;
    let held: Vec<String> = node
        .lock_held()
        .iter()
        .zip(held0)
        .map(|(h, h0)| format!("{:.2}", (*h - h0).as_secs_f64()))
        .collect();
    let consumed: f64 = reports.iter().map(|r| r.consumed_per_s).sum();
    let published: f64 = reports.iter().map(|r| r.published_per_s).sum();
    let broker_cpu = (cpu - client_cpu).max(0.0);
    println!(
        "result shards={} queues={} persistent={} consumed/s={consumed:.0} published/s={published:.0} wall_s={wall:.2} broker_cpu_s={broker_cpu:.2} client_cpu_s={client_cpu:.2} lock_held_s={}",
        args.shards,
        args.queues,
        args.persistent,
        held.join(",")
    );
    if let Ok(node) = Arc::try_unwrap(node) {
        rt.block_on(node.stop());
    }
    Ok(())
}
