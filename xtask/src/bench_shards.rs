//! `cargo xtask bench shards [--queues K] [--duration S] [--runs R]`: the
//! shard model's bench (`crates/node/benches/shards.rs`): one node inside
//! the bench's process, driven by K independent loads of the lean generator
//! over in-process streams, with `--shards 1` and `--shards 2`, on 1 KiB
//! persistent messages with confirms and on 16 B transient ones. Prints
//! consumed/s side by side (the median of the runs), and the share of the
//! broker's CPU spent holding a lock shared by all queues: with one shard
//! its broker lock; with two there is none (each shard's lock is its
//! queues' alone), and each shard lock's share is shown beside it.
//!
//! Then the same with a standard client: `warren --shards N` as a process,
//! one `lapin_perf` process per queue over TCP (each publish and each ack
//! its own frame), consumed/s summed over the queues, and the CPU the node
//! and the clients used.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;

use crate::bench::result_field;
use crate::client_perf::PerfClient;

/// The standard-client rows: `lapin_perf`'s flags per queue.
const LAPIN_ROWS: [(&str, &[&str]); 2] = [
    (
        "lapin: 1 KiB persistent, 100 confirms, manual acks, prefetch 200",
        &crate::client_perf::PERSISTENT,
    ),
    (
        "lapin: 16 B transient, auto-ack",
        &crate::client_perf::TRANSIENT,
    ),
];

/// The AMQP port of the node the lapin rows run against.
const LAPIN_PORT: u16 = 5803;

/// One lapin run's figures: consumed/s summed over the queues, and the CPU
/// seconds of the node and of the clients per second of the run.
struct LapinRun {
    consumed: f64,
    node_cpu: f64,
    clients_cpu: f64,
}

/// Runs one `lapin_perf` per queue, together, against a fresh `warren
/// --shards N` process.
fn lapin_once(
    root: &Path,
    shards: u64,
    queues: u64,
    secs: u64,
    flags: &[&str],
) -> anyhow::Result<LapinRun> {
    let dir = crate::bench::target_dir(root).join("bench-shards");
    let data = dir.join(format!("data-{shards}"));
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&dir)?;
    let log = std::fs::File::create(dir.join(format!("warren-{shards}.log")))?;
    let child = std::process::Command::new(crate::bench::target_dir(root).join("release/warren"))
        .args(["--shards", &shards.to_string()])
        .args(["--amqp-addr", &format!("127.0.0.1:{LAPIN_PORT}")])
        .args(["--http-addr", "127.0.0.1:15803"])
        .args(["--prometheus-addr", "127.0.0.1:15893"])
        .arg("--data-dir")
        .arg(&data)
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting warren")?;
    let node = crate::amqp_bench::Broker { child };
    crate::bench_mirrored::wait_port(LAPIN_PORT, "warren", std::time::Duration::from_secs(30))?;
    let url = format!("amqp://guest:guest@127.0.0.1:{LAPIN_PORT}/%2f");
    let ticks = crate::cpu::clock_ticks();
    let node_before = crate::cpu::tree_ticks(node.child.id());
    let clients_before = crate::cpu::children_ticks()?;
    let results: Vec<anyhow::Result<crate::client_perf::PerfResult>> = std::thread::scope(|s| {
        let loads: Vec<_> = (0..queues)
            .map(|i| {
                let queue = format!("shards.q{i}");
                let url = &url;
                s.spawn(move || {
                    let args = [&["--url", url, "--queue", &queue], flags].concat();
                    crate::client_perf::run(root, PerfClient::Lapin, &args, secs)
                })
            })
            .collect();
        loads
            .into_iter()
            .map(|l| l.join().expect("a load's thread panicked"))
            .collect()
    });
    let node_ticks = crate::cpu::tree_ticks(node.child.id()).saturating_sub(node_before);
    // The clients are this process's children, waited for: their CPU is
    // counted in its children's times.
    let clients_ticks = crate::cpu::children_ticks()?.saturating_sub(clients_before);
    let mut consumed = 0.0;
    for r in results {
        consumed += r?.consumed;
    }
    let per_sec = |t: u64| t as f64 / ticks / secs as f64;
    Ok(LapinRun {
        consumed,
        node_cpu: per_sec(node_ticks),
        clients_cpu: per_sec(clients_ticks),
    })
}

/// One run's figures.
struct Run {
    consumed: f64,
    broker_cpu: f64,
    lock_held: Vec<f64>,
}

fn flag(rest: &[&str], name: &str, default: u64) -> anyhow::Result<u64> {
    match rest.iter().position(|a| *a == name) {
        Some(i) => rest
            .get(i + 1)
            .with_context(|| format!("{name} needs a value"))?
            .parse()
            .with_context(|| format!("{name} takes a number")),
        None => Ok(default),
    }
}

/// The run of median `key` (the upper one of an even count).
fn median<T>(mut runs: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    runs.sort_by(|a, b| key(a).total_cmp(&key(b)));
    runs.swap_remove(runs.len() / 2)
}

/// Runs `once(shards, run)` `runs` times with 1 shard and with 2, printing
/// `name` before each; returns the median run of each by consumed/s.
fn one_and_two<T>(
    name: &str,
    runs: u64,
    consumed: impl Fn(&T) -> f64,
    mut once: impl FnMut(u64) -> anyhow::Result<T>,
) -> anyhow::Result<(T, T)> {
    let mut by_shards = Vec::new();
    for shards in [1, 2] {
        let mut all = Vec::new();
        for r in 0..runs {
            println!("==> {name}, {shards} shard(s), run {} of {runs}", r + 1);
            all.push(once(shards)?);
        }
        by_shards.push(median(all, &consumed));
    }
    let two = by_shards.pop().expect("two shard counts");
    let one = by_shards.pop().expect("two shard counts");
    Ok((one, two))
}

/// Runs the bench once.
fn run_once(
    exe: &Path,
    shards: u64,
    queues: u64,
    secs: u64,
    persistent: bool,
) -> anyhow::Result<Run> {
    let mut cmd = std::process::Command::new(exe);
    cmd.args([
        "--shards",
        &shards.to_string(),
        "--queues",
        &queues.to_string(),
        "--duration",
        &secs.to_string(),
    ]);
    if persistent {
        cmd.arg("--persistent");
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "the shards bench failed: {}{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("result "))
        .context("no result line from the shards bench")?;
    println!("    {line}");
    let held = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("lock_held_s="))
        .context("no lock_held_s")?
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<f64>, _>>()?;
    Ok(Run {
        consumed: result_field(line, "consumed/s")?,
        broker_cpu: result_field(line, "broker_cpu_s")?,
        lock_held: held,
    })
}

/// Builds the bench (release) once and returns its executable.
fn build(root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let out = crate::cargo()
        .current_dir(root)
        .args([
            "bench",
            "-p",
            "warren-node",
            "--bench",
            "shards",
            "--no-run",
            "--message-format",
            "json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the shards bench")?;
    anyhow::ensure!(out.status.success(), "building the shards bench failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == "shards")
        .find_map(|v| v["executable"].as_str().map(std::path::PathBuf::from))
        .context("cargo named no shards bench executable")
}

/// `bench shards`.
pub(crate) fn run(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let queues = flag(rest, "--queues", 4)?;
    let secs = flag(rest, "--duration", 5)?;
    let runs = flag(rest, "--runs", 3)?.max(1);
    let exe = build(root)?;
    crate::bench::build_node(&["lapin_perf"])?;
    let mut table = String::new();
    writeln!(
        table,
        "| workload ({queues} queues) | 1 shard consumed/s | 2 shards consumed/s | ratio | lock shared by all queues, held / broker CPU: 1 shard | 2 shards | each shard lock, held / broker CPU (2 shards) |"
    )?;
    writeln!(table, "|---|---:|---:|---:|---:|---:|---|")?;
    for (name, persistent) in [
        ("1 KiB persistent, 100 confirms, manual acks", true),
        ("16 B transient, auto-ack", false),
    ] {
        let (one, two) = one_and_two(
            name,
            runs,
            |r: &Run| r.consumed,
            |shards| run_once(&exe, shards, queues, secs, persistent),
        )?;
        let (one, two) = (&one, &two);
        let share = |r: &Run, h: f64| {
            if r.broker_cpu > 0.0 {
                format!("{:.0} %", 100.0 * h / r.broker_cpu)
            } else {
                "–".to_owned()
            }
        };
        let each: Vec<String> = two.lock_held.iter().map(|h| share(two, *h)).collect();
        writeln!(
            table,
            "| {name} | {} | {} | {:.2}× | {} | 0 % (none) | {} |",
            crate::bench::human(one.consumed),
            crate::bench::human(two.consumed),
            two.consumed / one.consumed.max(1.0),
            share(one, one.lock_held.iter().sum()),
            each.join(", ")
        )?;
    }
    writeln!(
        table,
        "\n| workload ({queues} queues, one lapin_perf process each, over TCP) | 1 shard consumed/s | 2 shards consumed/s | ratio | node CPU, 1 → 2 shards (cores) | clients' CPU, 1 → 2 shards (cores) |"
    )?;
    writeln!(table, "|---|---:|---:|---:|---|---|")?;
    for (name, flags) in LAPIN_ROWS {
        let (one, two) = one_and_two(
            name,
            runs,
            |r: &LapinRun| r.consumed,
            |shards| {
                let run = lapin_once(root, shards, queues, secs, flags)?;
                println!(
                    "    consumed/s={:.0} node_cpu={:.2} clients_cpu={:.2}",
                    run.consumed, run.node_cpu, run.clients_cpu
                );
                Ok(run)
            },
        )?;
        writeln!(
            table,
            "| {name} | {} | {} | {:.2}× | {:.2} → {:.2} | {:.2} → {:.2} |",
            crate::bench::human(one.consumed),
            crate::bench::human(two.consumed),
            two.consumed / one.consumed.max(1.0),
            one.node_cpu,
            two.node_cpu,
            one.clients_cpu,
            two.clients_cpu,
        )?;
    }
    let out = crate::bench::target_dir(root).join("bench-shards.md");
    std::fs::write(&out, &table)?;
    println!("\n{table}\n(written to {})", out.display());
    Ok(())
}
