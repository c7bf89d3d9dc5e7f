//! `cargo xtask bench amqp`: one Warren node and — when Debian's
//! `rabbitmq-server` is installed — one RabbitMQ node, driven side by side by
//! the same loads: the project's lean generator
//! (`crates/node/examples/amqp_bench.rs`, every ready frame in one write)
//! and standard client libraries, lapin, Node.js's amqplib and RabbitMQ's Java client (`client_perf`:
//! each publish and each ack its own frame, as applications send them).
//!
//! Both brokers run on loopback on their own ports and data directories under
//! `target/bench-amqp/`; only processes this command started are stopped.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::client_perf::PerfClient;

const WARREN_PORT: u16 = 5801;
const RABBIT_PORT: u16 = 5802;
/// Warren's Prometheus listener (its broker lock's accounts).
const WARREN_METRICS: &str = "127.0.0.1:15891";

/// The workloads: a name and the load generator's flags.
pub(crate) const WORKLOADS: [(&str, &[&str]); 2] = [
    ("16 B transient, auto-ack, no confirms", &["--size", "16"]),
    (
        "1 KiB persistent, 100 confirms in flight, manual acks",
        &[
            "--size",
            "1024",
            "--confirms",
            "100",
            "--persistent",
            "--manual-ack",
        ],
    ),
];

/// The same kinds of load from standard client libraries, PerfTest-like
/// (`client_perf`: lapin, Node.js's amqplib and RabbitMQ's Java client; the
/// same flags for all).
pub(crate) const CLIENT_WORKLOADS: [(&str, &[&str]); 10] = [
    (
        "lapin: 16 B transient, auto-ack",
        &crate::client_perf::TRANSIENT,
    ),
    (
        "lapin: 1 KiB persistent, 100 confirms, manual acks, prefetch 200",
        &crate::client_perf::PERSISTENT,
    ),
    (
        "lapin: 1 KiB persistent, 100 confirms, manual acks, no prefetch limit",
        &crate::client_perf::PERSISTENT_UNLIMITED,
    ),
    (
        "lapin: 4 producers, 2 consumers, 1 KiB persistent, 1,000 confirms each, prefetch 200",
        &[
            "--producers",
            "4",
            "--consumers",
            "2",
            "--size",
            "1024",
            "--persistent",
            "--confirms",
            "1000",
            "--prefetch",
            "200",
        ],
    ),
    (
        "amqplib: 16 B transient, auto-ack",
        &crate::client_perf::TRANSIENT,
    ),
    (
        "amqplib: 1 KiB persistent, 100 confirms, manual acks, prefetch 200",
        &crate::client_perf::PERSISTENT,
    ),
    (
        "java: 16 B transient, auto-ack",
        &crate::client_perf::TRANSIENT,
    ),
    (
        "java: 1 KiB persistent, 100 confirms, manual acks, prefetch 200",
        &crate::client_perf::PERSISTENT,
    ),
    (
        "java: 1 KiB persistent, 100 confirms, manual acks, no prefetch limit",
        &crate::client_perf::PERSISTENT_UNLIMITED,
    ),
    (
        "java: the same, one ack (multiple) per 1,000 deliveries",
        &[
            "--size",
            "1024",
            "--persistent",
            "--confirms",
            "100",
            "--multi-ack",
            "1000",
        ],
    ),
];

/// A started broker process, stopped when dropped.
pub(crate) struct Broker {
    /// The broker's process.
    pub(crate) child: Child,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_warren(root: &Path, dir: &Path) -> anyhow::Result<Broker> {
    let data = dir.join("warren-data");
    let _ = std::fs::remove_dir_all(&data);
    let log = std::fs::File::create(dir.join("warren.log"))?;
    let child = Command::new(crate::bench::target_dir(root).join("release/warren"))
        .args(["--amqp-addr", &format!("127.0.0.1:{WARREN_PORT}")])
        .args([
            "--http-addr",
            "127.0.0.1:15801",
            "--prometheus-addr",
            WARREN_METRICS,
        ])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting warren")?;
    let broker = Broker { child };
    crate::bench_mirrored::wait_port(WARREN_PORT, "warren", Duration::from_secs(30))?;
    Ok(broker)
}

/// Starts RabbitMQ from Debian's package on its own port and directories.
fn start_rabbitmq(dir: &Path) -> anyhow::Result<Option<Broker>> {
    let server = Path::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
    if !server.exists() {
        return Ok(None);
    }
    let base = dir.join("rabbitmq");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(base.join("log"))?;
    let conf = base.join("rabbitmq.conf");
    std::fs::write(
        &conf,
        format!("listeners.tcp.default = 127.0.0.1:{RABBIT_PORT}\nloopback_users = none\n"),
    )?;
    let log = std::fs::File::create(dir.join("rabbitmq.log"))?;
    let child = Command::new(server)
        .env("RABBITMQ_NODENAME", "warren-bench@localhost")
        .env("RABBITMQ_NODE_PORT", RABBIT_PORT.to_string())
        .env("RABBITMQ_DIST_PORT", "25802")
        .env("RABBITMQ_MNESIA_BASE", base.join("mnesia"))
        .env("RABBITMQ_LOG_BASE", base.join("log"))
        .env("RABBITMQ_CONFIG_FILE", base.join("rabbitmq"))
        .env(
            "RABBITMQ_ENABLED_PLUGINS_FILE",
            base.join("enabled_plugins"),
        )
        .env("HOME", &base)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting rabbitmq-server")?;
    let broker = Broker { child };
    crate::bench_mirrored::wait_port(RABBIT_PORT, "rabbitmq-server", Duration::from_secs(90))?;
    Ok(Some(broker))
}

/// Runs the load generator against the broker on `port` (process `pid`);
/// returns its rates and the CPU both sides spent per message.
fn load(
    root: &Path,
    (port, pid): (u16, u32),
    flags: &[&str],
    duration: &str,
) -> anyhow::Result<([f64; 4], Option<Cost>)> {
    let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let before = crate::cpu::tree_ticks(pid);
    let out = Command::new(crate::bench::target_dir(root).join("release/examples/amqp_bench"))
        .args(["--url", &url, "--duration", duration])
        .args(flags)
        .output()
        .context("running amqp_bench")?;
    let broker_s =
        (crate::cpu::tree_ticks(pid).saturating_sub(before)) as f64 / crate::cpu::clock_ticks();
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "amqp_bench failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let cost = generator_cost(&text).map(|(messages, generator_s)| Cost {
        broker_us: broker_s * 1e6 / messages,
        generator_us: generator_s * 1e6 / messages,
    });
    Ok((rates(&text)?, cost))
}

/// Runs a standard client's load (`workload`'s, [`CLIENT_WORKLOADS`])
/// against the broker on `port`; returns its published/s, consumed/s and
/// end-to-end latency p50 and p99 (µs).
fn load_client(
    root: &Path,
    port: u16,
    (workload, flags): (&str, &[&str]),
    duration: &str,
) -> anyhow::Result<[f64; 4]> {
    let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let args: Vec<&str> = ["--url", &url]
        .into_iter()
        .chain(flags.iter().copied())
        .collect();
    let secs = duration
        .parse()
        .with_context(|| format!("--duration takes seconds, not {duration:?}"))?;
    let client = PerfClient::of(workload);
    let r = crate::client_perf::run(root, client, &args, secs)?;
    Ok([
        r.published,
        r.consumed,
        r.e2e_ms[0] * 1000.0,
        r.e2e_ms[1] * 1000.0,
    ])
}

/// CPU microseconds per consumed message over a whole load generator run
/// (warm-up and drain included).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cost {
    /// The broker's process (and its children).
    pub(crate) broker_us: f64,
    /// The load generator's, every thread of it.
    pub(crate) generator_us: f64,
}

/// The load generator's messages consumed over the whole run and its CPU
/// seconds, from its output (`total_consumed=… cpu_s=…`).
pub(crate) fn generator_cost(text: &str) -> Option<(f64, f64)> {
    let messages = field(text, "total_consumed=")?;
    (messages > 0.0).then_some((messages, field(text, "cpu_s=")?))
}

/// The number after `key` in the load generator's output.
fn field(text: &str, key: &str) -> Option<f64> {
    let start = text.find(key)? + key.len();
    let digits: String = text[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    digits.parse().ok()
}

/// The load generator's published/s, consumed/s, latency p50 and p99 (µs),
/// from its output.
pub(crate) fn rates(text: &str) -> anyhow::Result<[f64; 4]> {
    let value = |key: &str| field(text, key).with_context(|| format!("no {key} in: {text}"));
    Ok([
        value("published/s=")?,
        value("consumed/s=")?,
        value("p50=")?,
        value("p99=")?,
    ])
}

/// One broker's rates on one workload of [`WORKLOADS`].
#[derive(Debug, Clone)]
pub(crate) struct AmqpRow {
    /// "warren" or "rabbitmq".
    pub(crate) broker: &'static str,
    /// The workload's name.
    pub(crate) workload: &'static str,
    /// published/s, consumed/s, latency p50 and p99 (µs).
    pub(crate) rates: [f64; 4],
    /// CPU per message, when the load generator reported its own.
    pub(crate) cost: Option<Cost>,
    /// Warren's: seconds its broker lock was held per second of the
    /// broker's CPU over the run ([`LockShare`]).
    pub(crate) lock: Option<f64>,
}

/// Samples Warren's broker lock and CPU around a run: the share of the
/// broker's CPU time spent holding the lock (wall-clock hold time, so a
/// holder preempted by the load's own threads counts too).
struct LockShare {
    held: f64,
    cpu_ticks: u64,
    pid: u32,
}

impl LockShare {
    fn start(pid: u32) -> anyhow::Result<Self> {
        Ok(Self {
            held: held_seconds()?,
            cpu_ticks: crate::cpu::tree_ticks(pid),
            pid,
        })
    }

    fn end(self) -> anyhow::Result<f64> {
        let cpu = crate::cpu::tree_ticks(self.pid).saturating_sub(self.cpu_ticks) as f64
            / crate::cpu::clock_ticks();
        Ok((held_seconds()? - self.held) / cpu.max(1e-3))
    }
}

fn held_seconds() -> anyhow::Result<f64> {
    crate::node::metric(WARREN_METRICS, "warren_broker_lock_held_seconds_total")?
        .context("Warren's metrics have no warren_broker_lock_held_seconds_total")
}

/// `bench amqp [--duration S]`: measures, prints and writes the table.
pub(crate) fn run(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let duration = rest
        .iter()
        .position(|a| *a == "--duration")
        .and_then(|i| rest.get(i + 1).copied())
        .unwrap_or("10");
    let rows = measure(root, duration)?;
    let table = table(&rows)?;
    let out = crate::bench::target_dir(root).join("bench-amqp/report.md");
    std::fs::write(&out, &table)?;
    println!("\n{table}(written to {})", out.display());
    Ok(())
}

/// Runs every workload for `duration` seconds against one Warren node, then
/// against one RabbitMQ node when it is installed.
pub(crate) fn measure(root: &Path, duration: &str) -> anyhow::Result<Vec<AmqpRow>> {
    crate::bench::build_node(&["amqp_bench", "lapin_perf"])?;
    let dir = crate::bench::target_dir(root).join("bench-amqp");
    std::fs::create_dir_all(&dir)?;
    let mut rows = Vec::new();
    let clients = crate::client_perf::Clients::prepare(root);
    // Every workload against the broker on `port`, named `broker`.
    let mut each = |broker: &'static str, server: (u16, u32)| -> anyhow::Result<()> {
        for (workload, flags) in WORKLOADS {
            println!("    {workload} ({duration} s)…");
            let share = (broker == "warren").then(|| LockShare::start(server.1));
            let (rates, cost) = load(root, server, flags, duration)?;
            rows.push(AmqpRow {
                broker,
                workload,
                rates,
                cost,
                lock: share.map(|s| s?.end()).transpose()?,
            });
        }
        for (workload, flags) in CLIENT_WORKLOADS {
            if let Some(why) = clients.why_not(PerfClient::of(workload)) {
                println!("    {workload}: skipped, {why}");
                continue;
            }
            println!("    {workload} ({duration} s)…");
            let share = (broker == "warren").then(|| LockShare::start(server.1));
            let rates = load_client(root, server.0, (workload, flags), duration)?;
            rows.push(AmqpRow {
                broker,
                workload,
                rates,
                cost: None,
                lock: share.map(|s| s?.end()).transpose()?,
            });
        }
        Ok(())
    };
    {
        println!("==> Warren on 127.0.0.1:{WARREN_PORT}");
        let warren = start_warren(root, &dir)?;
        each("warren", (WARREN_PORT, warren.child.id()))?;
    }
    let epmd_before = crate::bench_mirrored::epmd_pids();
    let rabbit = match start_rabbitmq(&dir) {
        Ok(None) => {
            println!(
                "==> rabbitmq-server is not installed (apt-get install rabbitmq-server): Warren only"
            );
            Ok(())
        }
        Ok(Some(rabbit)) => {
            println!("==> RabbitMQ on 127.0.0.1:{RABBIT_PORT}");
            each("rabbitmq", (RABBIT_PORT, rabbit.child.id()))
        }
        Err(e) => Err(e),
    };
    crate::bench_mirrored::stop_new_epmd(&epmd_before);
    rabbit?;
    Ok(rows)
}

/// The Markdown table of [`measure`]'s rows, with Warren / RabbitMQ ratios.
pub(crate) fn table(rows: &[AmqpRow]) -> anyhow::Result<String> {
    let mut table = String::new();
    writeln!(
        table,
        "| workload | broker | published/s | consumed/s | p50 µs | p99 µs | broker CPU µs/msg | generator CPU µs/msg | broker lock held / broker CPU |"
    )?;
    writeln!(table, "|---|---|---:|---:|---:|---:|---:|---:|---:|")?;
    for r in rows {
        let [p, c, p50, p99] = r.rates;
        let (b, g) = match r.cost {
            Some(c) => (
                format!("{:.1}", c.broker_us),
                format!("{:.1}", c.generator_us),
            ),
            None => ("–".to_owned(), "–".to_owned()),
        };
        let lock = r
            .lock
            .map_or_else(|| "–".to_owned(), |l| format!("{:.0} %", l * 100.0));
        writeln!(
            table,
            "| {} | {} | {p:.0} | {c:.0} | {p50:.0} | {p99:.0} | {b} | {g} | {lock} |",
            r.workload, r.broker
        )?;
    }
    writeln!(
        table,
        "\nBroker lock held / broker CPU: the seconds Warren's one broker lock was held (`warren_broker_lock_held_seconds_total`, wall clock) per CPU second of the broker over the run: the share of its work serialised behind that lock (over 100 % when holders wait for a CPU).\n"
    )?;
    for (name, _) in WORKLOADS.iter().chain(&CLIENT_WORKLOADS) {
        if let (Some(w), Some(r)) = (
            consumed(rows, "warren", name),
            consumed(rows, "rabbitmq", name),
        ) {
            writeln!(
                table,
                "- {name}: Warren / RabbitMQ consumed/s = {:.2}",
                w / r.max(1.0)
            )?;
        }
        if let (Some(w), Some(r)) = (cost(rows, "warren", name), cost(rows, "rabbitmq", name)) {
            writeln!(
                table,
                "- {name}: RabbitMQ / Warren broker CPU per message = {:.2}",
                r.broker_us / w.broker_us.max(0.001)
            )?;
        }
    }
    Ok(table)
}

/// The CPU per message of `broker` on the workload named `workload`, if measured.
fn cost(rows: &[AmqpRow], broker: &str, workload: &str) -> Option<Cost> {
    rows.iter()
        .find(|r| r.broker == broker && r.workload == workload)
        .and_then(|r| r.cost)
}

/// The consumed/s of `broker` on the workload named `workload`, if it ran.
pub(crate) fn consumed(rows: &[AmqpRow], broker: &str, workload: &str) -> Option<f64> {
    rows.iter()
        .find(|r| r.broker == broker && r.workload == workload)
        .map(|r| r.rates[1])
}
