//! AMQP load generator over TCP: producers, consumers, message size,
//! confirms, persistence, duration; prints published/s, consumed/s and the
//! p50/p99 publish-to-delivery latency (the generator: `loadgen/mod.rs`).
//!
//! ```text
//! cargo run --release -p warren-node --example amqp_bench -- \
//!     --url amqp://guest:guest@127.0.0.1:5672/%2f --size 16 --duration 10
//! ```

#![allow(clippy::print_stdout, clippy::print_stderr)]

use clap::Parser as _;

#[path = "loadgen/mod.rs"]
mod loadgen;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = loadgen::Args::parse();
    let dial = loadgen::tcp_dial(&args)?;
    let r = loadgen::run(args.clone(), dial).await?;
    if r.drain_timed_out {
        println!(
            "drain timed out after {} s: the consumers had not received every message",
            args.drain_timeout
        );
    }
    println!(
        "producers={} consumers={} size={} confirms={} persistent={} manual_ack={}",
        args.producers,
        args.consumers,
        args.size.max(8),
        args.confirms,
        args.persistent,
        args.manual_ack
    );
    println!(
        "published/s={:.0} consumed/s={:.0} latency p50={}us p99={}us",
        r.published_per_s, r.consumed_per_s, r.latency_us.0, r.latency_us.1
    );
    if r.nacked > 0 {
        println!(
            "nacked={} (publishes the broker refused; not counted as published)",
            r.nacked
        );
    }
    // The whole run's cost, warm-up and drain included, for CPU per message.
    println!(
        "total_consumed={} cpu_s={:.2}",
        r.total_consumed,
        loadgen::own_cpu_seconds()
    );
    Ok(())
}
