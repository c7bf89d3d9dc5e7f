//! Transports side by side: one-way throughput at 64 B, 1 KiB and 64 KiB, and
//! round-trip latency at 64 B, over in-memory, TCP, TCP+TLS and QUIC.
//!
//! `cargo xtask bench transports` runs this and prints one table with ratios.

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::sync::mpsc;
use warren_benches::{Fabric, KINDS};

/// Frames sent per measured iteration, by frame size.
fn frames_per_iter(size: usize) -> u64 {
    match size {
        s if s <= 64 => 50_000,
        s if s <= 1024 => 20_000,
        _ => 400,
    }
}

/// Flush once this many bytes are buffered (one write per 64 KiB).
const FLUSH_AT: usize = 64 * 1024;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn throughput(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("transport_throughput");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for size in [64usize, 1024, 64 * 1024] {
        let per_iter = frames_per_iter(size);
        group.throughput(Throughput::Elements(per_iter));
        for kind in KINDS {
            let fabric = Fabric::new(kind);
            let (client, server, listener) = rt.block_on(fabric.pair());
            let (mut tx, _client_rx) = client.split();
            let (_server_tx, mut rx) = server.split();
            // The receiver counts frames and reports each completed iteration.
            let (done_tx, mut done_rx) = mpsc::channel::<()>(16);
            let counter = rt.spawn(async move {
                let mut got = 0u64;
                let mut batch = Vec::with_capacity(4096);
                loop {
                    batch.clear();
                    match rx.recv_batch(&mut batch, 4096).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got += n as u64,
                    }
                    while got >= per_iter {
                        got -= per_iter;
                        if done_tx.send(()).await.is_err() {
                            return;
                        }
                    }
                }
            });
            let frame = Bytes::from(vec![7u8; size]);
            group.bench_with_input(BenchmarkId::new(kind, size), &size, |b, _| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            for _ in 0..per_iter {
                                tx.feed(frame.clone()).expect("feed");
                                if tx.buffered() >= FLUSH_AT {
                                    tx.flush().await.expect("flush");
                                }
                            }
                            tx.flush().await.expect("flush");
                            done_rx.recv().await.expect("receiver alive");
                        }
                        start.elapsed()
                    })
                })
            });
            counter.abort();
            drop(listener);
        }
    }
    group.finish();
}

fn round_trip(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("transport_rtt");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for kind in KINDS {
        let fabric = Fabric::new(kind);
        let (mut client, server, listener) = rt.block_on(fabric.pair());
        let echo = rt.spawn(async move {
            let mut server = server;
            while let Ok(Some(frame)) = server.recv().await {
                if server.send(frame).await.is_err() {
                    return;
                }
            }
        });
        let frame = Bytes::from(vec![7u8; 64]);
        group.bench_function(BenchmarkId::new(kind, 64), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        client.send(frame.clone()).await.expect("send");
                        client.recv().await.expect("recv").expect("echo");
                    }
                    start.elapsed()
                })
            })
        });
        echo.abort();
        drop(listener);
    }
    group.finish();
}

criterion_group!(benches, throughput, round_trip);
criterion_main!(benches);
