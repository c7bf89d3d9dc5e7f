//! `cargo xtask bench …`: runs a criterion bench and prints its results as one table.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};

/// Runs the named bench and prints its table.
pub(crate) fn run(root: &Path, which: &str, rest: &[&str]) -> anyhow::Result<()> {
    match which {
        "transports" => transports(root, rest),
        "amqp" => crate::amqp_bench::run(root, rest),
        // These benches print their own tables at the end of the run.
        "gm" => crate::step(
            "GM ring bench",
            "cargo",
            &["bench", "-p", "warren-gm", "--bench", "gm"],
        ),
        "backing-queue" => crate::step(
            "backing-queue bench",
            "cargo",
            &["bench", "-p", "warren-backing-queue", "--", "--quick"],
        ),
        other => bail!("unknown bench `{other}` (known: transports, gm, backing-queue, amqp)"),
    }
}

const KINDS: [&str; 4] = ["mem", "tcp", "tcp+tls", "quic"];
const SIZES: [u64; 3] = [64, 1024, 65536];

/// Mean time per iteration (ns) and elements per iteration of one criterion benchmark.
fn estimate(root: &Path, id: &str) -> anyhow::Result<(f64, u64)> {
    let dir = root.join("target/criterion").join(id).join("new");
    let read = |file: &str| -> anyhow::Result<serde_json::Value> {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(serde_json::from_str(&text)?)
    };
    let mean = read("estimates.json")?["mean"]["point_estimate"]
        .as_f64()
        .context("estimates.json without a mean")?;
    let elements = read("benchmark.json")?["throughput"]["Elements"]
        .as_u64()
        .unwrap_or(1);
    Ok((mean, elements))
}

fn transports(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let mut args = vec![
        "bench",
        "-p",
        "warren-benches",
        "--bench",
        "transports",
        "--",
    ];
    if rest.contains(&"--quick") {
        args.push("--quick");
    }
    crate::step("transport bench", "cargo", &args)?;

    let mut table = String::new();
    writeln!(
        table,
        "| transport | 64 B frames/s | 64 B MiB/s | 1 KiB frames/s | 1 KiB MiB/s | 64 KiB frames/s | 64 KiB MiB/s | RTT 64 B (µs) |"
    )?;
    writeln!(table, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut rate = std::collections::BTreeMap::new();
    for kind in KINDS {
        let mut row = format!("| {kind} ");
        for size in SIZES {
            let (ns, elements) = estimate(root, &format!("transport_throughput/{kind}/{size}"))?;
            let per_sec = elements as f64 / (ns / 1e9);
            rate.insert((kind, size), per_sec);
            let mib = per_sec * size as f64 / (1024.0 * 1024.0);
            write!(row, "| {} | {mib:.0} ", human(per_sec))?;
        }
        let (rtt_ns, _) = estimate(root, &format!("transport_rtt/{kind}/64"))?;
        writeln!(row, "| {:.1} |", rtt_ns / 1e3)?;
        table.push_str(&row);
    }
    writeln!(table)?;
    writeln!(table, "| ratio (frames/s) | 64 B | 1 KiB | 64 KiB |")?;
    writeln!(table, "|---|---:|---:|---:|")?;
    for (name, num, den) in [
        ("TCP / in-memory", "tcp", "mem"),
        ("QUIC / TCP", "quic", "tcp"),
        ("QUIC / TCP+TLS", "quic", "tcp+tls"),
        ("TCP+TLS / TCP", "tcp+tls", "tcp"),
    ] {
        let mut row = format!("| {name} ");
        for size in SIZES {
            write!(row, "| {:.2} ", rate[&(num, size)] / rate[&(den, size)])?;
        }
        writeln!(row, "|")?;
        table.push_str(&row);
    }
    let out = root.join("target/bench-transports.md");
    std::fs::write(&out, &table)?;
    println!("\n{table}");
    println!("(written to {})", out.display());
    Ok(())
}

/// 1234567.0 → "1.23 M".
fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.0} k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}
