//! `cargo xtask bench …`: runs a criterion bench and prints its results as one table.
//!
//! Each bench is also a function returning its table (and, where `bench all`
//! charts them, its numbers), so that `bench all` can collect them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, bail};

/// Runs the named bench and prints its table.
pub(crate) fn run(root: &Path, which: &str, rest: &[&str]) -> anyhow::Result<()> {
    let quick = rest.contains(&"--quick");
    let (table, file) = match which {
        "transports" => (transports(root, quick)?.table, "bench-transports.md"),
        "amqp" => return crate::amqp_bench::run(root, rest),
        "gm" => (gm(quick)?.table, "bench-gm.md"),
        "backing-queue" => (backing_queue(root)?, "bench-backing-queue.md"),
        "all" => return crate::bench_all::run(root, rest),
        other => bail!(
            "unknown bench `{other}` (known: transports, gm, backing-queue, amqp, mirrored, many-queues, shards, all)"
        ),
    };
    let out = target_dir(root).join(file);
    std::fs::write(&out, &table)?;
    println!("\n{table}\n(written to {})", out.display());
    Ok(())
}

/// Builds the release `warren` and the `warren-node` examples `examples`.
pub(crate) fn build_node(examples: &[&str]) -> anyhow::Result<()> {
    let mut args = vec!["build", "--release", "-p", "warren-node", "--bin", "warren"];
    for e in examples {
        args.extend(["--example", e]);
    }
    crate::cargo_step(
        &format!("build warren and {} (release)", examples.join(", ")),
        &args,
    )
}

/// Where cargo puts its output: `CARGO_TARGET_DIR`, or `target/` under the root.
pub(crate) fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// The number after `key=` in a load generator's `result key=value …` line.
pub(crate) fn result_field(line: &str, key: &str) -> anyhow::Result<f64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .with_context(|| format!("no {key} in the load generator's result `{line}`"))?
        .parse()
        .with_context(|| format!("{key} in `{line}`"))
}

/// The transports bench's transports and frame sizes.
pub(crate) const KINDS: [&str; 4] = ["mem", "tcp", "tcp+tls", "quic"];
const SIZES: [u64; 3] = [64, 1024, 65536];

/// Mean time per iteration (ns) and elements per iteration of one criterion benchmark.
fn estimate(root: &Path, id: &str) -> anyhow::Result<(f64, u64)> {
    let dir = target_dir(root).join("criterion").join(id).join("new");
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

/// Elements per second of one criterion benchmark.
fn per_second(root: &Path, id: &str) -> anyhow::Result<f64> {
    let (ns, elements) = estimate(root, id)?;
    Ok(elements as f64 / (ns / 1e9))
}

/// The transports bench: its table and frames/s by (transport, frame size).
#[derive(Debug)]
pub(crate) struct Transports {
    /// The Markdown tables (rates and ratios).
    pub(crate) table: String,
    /// Frames per second by transport (one of [`KINDS`]) and frame size in bytes.
    pub(crate) rate: BTreeMap<(&'static str, u64), f64>,
}

/// Runs the transports bench (`--quick` for criterion's quick mode).
pub(crate) fn transports(root: &Path, quick: bool) -> anyhow::Result<Transports> {
    let mut args = vec![
        "bench",
        "-p",
        "warren-benches",
        "--bench",
        "transports",
        "--",
    ];
    if quick {
        args.push("--quick");
    }
    crate::cargo_step("transport bench", &args)?;

    let mut table = String::new();
    writeln!(
        table,
        "| transport | 64 B frames/s | 64 B MiB/s | 1 KiB frames/s | 1 KiB MiB/s | 64 KiB frames/s | 64 KiB MiB/s | RTT 64 B (µs) |"
    )?;
    writeln!(table, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut rate = BTreeMap::new();
    for kind in KINDS {
        let mut row = format!("| {kind} ");
        for size in SIZES {
            let per_sec = per_second(root, &format!("transport_throughput/{kind}/{size}"))?;
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
    Ok(Transports { table, rate })
}

/// Runs `cargo args…` (with `envs`), echoing its stdout while collecting it.
fn cargo_captured(name: &str, args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<String> {
    println!("==> {name}: cargo {}", args.join(" "));
    let mut child = crate::cargo()
        .args(args)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start cargo for `{name}`"))?;
    let mut out = String::new();
    for line in BufReader::new(child.stdout.take().context("cargo stdout")?).lines() {
        let line = line?;
        println!("{line}");
        out.push_str(&line);
        out.push('\n');
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("step `{name}` failed ({status})");
    }
    Ok(out)
}

/// The GM ring bench: its table and confirmed broadcasts/s under load.
#[derive(Debug)]
pub(crate) struct Gm {
    /// The bench's own Markdown table.
    pub(crate) table: String,
    /// Confirmed msgs/s by (transport, members, payload), e.g. ("tcp", 3, "64B").
    pub(crate) rate: BTreeMap<(String, u32, String), f64>,
}

/// Runs the GM ring bench (`GM_BENCH_QUICK=1` when `quick`) and keeps the
/// table it prints at the end.
pub(crate) fn gm(quick: bool) -> anyhow::Result<Gm> {
    let envs: &[(&str, &str)] = if quick {
        &[("GM_BENCH_QUICK", "1")]
    } else {
        &[]
    };
    let out = cargo_captured(
        "GM ring bench",
        &["bench", "-p", "warren-gm", "--bench", "gm"],
        envs,
    )?;
    gm_table(&out)
}

/// The Markdown table in the GM bench's output, and its throughput column.
fn gm_table(output: &str) -> anyhow::Result<Gm> {
    let lines: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with("| ") || l.starts_with("|---"))
        .collect();
    if lines.len() < 3 {
        bail!("the GM bench printed no table");
    }
    let mut rate = BTreeMap::new();
    for line in &lines[2..] {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if let [_, kind, members, payload, msgs, ..] = cells.as_slice()
            && let (Ok(members), Ok(msgs)) = (members.parse(), msgs.parse())
        {
            rate.insert(((*kind).to_owned(), members, (*payload).to_owned()), msgs);
        }
    }
    Ok(Gm {
        table: lines.join("\n") + "\n",
        rate,
    })
}

/// Criterion ids of the backing-queue bench and what they measure.
const BACKING_QUEUE: [(&str, &str); 10] = [
    ("cycle/transient/16B", "transient cycle, 16 B"),
    ("cycle/transient/1KiB", "transient cycle, 1 KiB"),
    ("cycle/persistent/16B", "persistent cycle, 16 B"),
    ("cycle/persistent/1KiB", "persistent cycle, 1 KiB"),
    (
        "cycle/persistent_tmpfs/16B",
        "persistent cycle on tmpfs, 16 B",
    ),
    (
        "cycle/persistent_tmpfs/1KiB",
        "persistent cycle on tmpfs, 1 KiB",
    ),
    (
        "confirmed_persistent_1KiB/64_publishers_window/1",
        "1 KiB persistent with confirms, 64 publishers, window 1",
    ),
    (
        "confirmed_persistent_1KiB/64_publishers_window/16",
        "1 KiB persistent with confirms, 64 publishers, window 16",
    ),
    (
        "confirmed_persistent_1KiB/tmpfs_64_publishers_window/1",
        "the same on tmpfs, window 1",
    ),
    (
        "confirmed_persistent_1KiB/tmpfs_64_publishers_window/16",
        "the same on tmpfs, window 16",
    ),
];

/// Runs the backing-queue bench (criterion's quick mode); returns a table of
/// its rates (publish → fetch → ack cycles/s, confirmed msgs/s) and the
/// memory per queued message it prints.
pub(crate) fn backing_queue(root: &Path) -> anyhow::Result<String> {
    let out = cargo_captured(
        "backing-queue bench",
        &["bench", "-p", "warren-backing-queue", "--", "--quick"],
        &[],
    )?;
    let mut table = String::new();
    writeln!(table, "| measure | per second | mean per op |")?;
    writeln!(table, "|---|---:|---:|")?;
    for (id, what) in BACKING_QUEUE {
        // The tmpfs runs exist only where /dev/shm does.
        if let Ok((ns, elements)) = estimate(root, id) {
            let per_op = ns / elements as f64;
            let per_sec = 1e9 / per_op;
            writeln!(table, "| {what} | {} | {per_op:.0} ns |", human(per_sec))?;
        }
    }
    writeln!(table)?;
    for line in out.lines().filter(|l| l.starts_with("memory/")) {
        writeln!(table, "- {line}")?;
    }
    Ok(table)
}

/// 1234567.0 → "1.23 M".
pub(crate) fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.0} k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}
