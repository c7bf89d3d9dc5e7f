//! `cargo xtask bench amqp`: one Warren node and — when Debian's
//! `rabbitmq-server` is installed — one RabbitMQ node, driven side by side by
//! the same lapin load generator (`crates/node/examples/amqp_bench.rs`).
//!
//! Both brokers run on loopback on their own ports and data directories under
//! `target/bench-amqp/`; only processes this command started are stopped.

use std::fmt::Write as _;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

const WARREN_PORT: u16 = 5801;
const RABBIT_PORT: u16 = 5802;

/// A workload: a name and the load generator's flags.
const WORKLOADS: [(&str, &[&str]); 2] = [
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

/// A started broker process, stopped when dropped.
struct Broker {
    child: Child,
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

fn wait_port(port: u16, what: &str, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{what} did not open port {port} within {limit:?}")
}

fn start_warren(root: &Path, dir: &Path) -> anyhow::Result<Broker> {
    let data = dir.join("warren-data");
    let _ = std::fs::remove_dir_all(&data);
    let log = std::fs::File::create(dir.join("warren.log"))?;
    let child = Command::new(root.join("target/release/warren"))
        .args(["--amqp-addr", &format!("127.0.0.1:{WARREN_PORT}")])
        .args([
            "--http-addr",
            "127.0.0.1:15801",
            "--prometheus-addr",
            "127.0.0.1:15891",
        ])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting warren")?;
    let broker = Broker { child };
    wait_port(WARREN_PORT, "warren", Duration::from_secs(30))?;
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
    wait_port(RABBIT_PORT, "rabbitmq-server", Duration::from_secs(90))?;
    Ok(Some(broker))
}

/// Runs the load generator; returns (published/s, consumed/s, p50 µs, p99 µs).
fn load(root: &Path, port: u16, flags: &[&str], duration: &str) -> anyhow::Result<[f64; 4]> {
    let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let out = Command::new(root.join("target/release/examples/amqp_bench"))
        .args(["--url", &url, "--duration", duration])
        .args(flags)
        .output()
        .context("running amqp_bench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "amqp_bench failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let value = |key: &str| -> anyhow::Result<f64> {
        let start = text
            .find(key)
            .with_context(|| format!("no {key} in: {text}"))?
            + key.len();
        let digits: String = text[start..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        Ok(digits.parse()?)
    };
    Ok([
        value("published/s=")?,
        value("consumed/s=")?,
        value("p50=")?,
        value("p99=")?,
    ])
}

/// Runs the side-by-side AMQP bench.
pub(crate) fn run(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let duration = rest
        .iter()
        .position(|a| *a == "--duration")
        .and_then(|i| rest.get(i + 1).copied())
        .unwrap_or("10");
    crate::step(
        "build warren and the load generator (release)",
        "cargo",
        &[
            "build",
            "--release",
            "-p",
            "warren-node",
            "--bin",
            "warren",
            "--example",
            "amqp_bench",
        ],
    )?;
    let dir = root.join("target/bench-amqp");
    std::fs::create_dir_all(&dir)?;
    let mut results: Vec<(&str, &str, [f64; 4])> = Vec::new();
    {
        println!("==> Warren on 127.0.0.1:{WARREN_PORT}");
        let _warren = start_warren(root, &dir)?;
        for (name, flags) in WORKLOADS {
            println!("    {name} ({duration} s)…");
            results.push(("warren", name, load(root, WARREN_PORT, flags, duration)?));
        }
    }
    match start_rabbitmq(&dir)? {
        None => println!(
            "==> rabbitmq-server is not installed (apt-get install rabbitmq-server): Warren only"
        ),
        Some(_rabbit) => {
            println!("==> RabbitMQ on 127.0.0.1:{RABBIT_PORT}");
            for (name, flags) in WORKLOADS {
                println!("    {name} ({duration} s)…");
                results.push(("rabbitmq", name, load(root, RABBIT_PORT, flags, duration)?));
            }
        }
    }
    let mut table = String::new();
    writeln!(
        table,
        "| workload | broker | published/s | consumed/s | p50 µs | p99 µs |"
    )?;
    writeln!(table, "|---|---|---:|---:|---:|---:|")?;
    for (broker, name, [p, c, p50, p99]) in &results {
        writeln!(
            table,
            "| {name} | {broker} | {p:.0} | {c:.0} | {p50:.0} | {p99:.0} |"
        )?;
    }
    writeln!(table)?;
    for (name, _) in WORKLOADS {
        let of = |b: &str| {
            results
                .iter()
                .find(|r| r.0 == b && r.1 == name)
                .map(|r| r.2[1])
        };
        if let (Some(w), Some(r)) = (of("warren"), of("rabbitmq")) {
            writeln!(
                table,
                "- {name}: Warren / RabbitMQ consumed/s = {:.2}",
                w / r.max(1.0)
            )?;
        }
    }
    let out = dir.join("report.md");
    std::fs::write(&out, &table)?;
    println!("\n{table}(written to {})", out.display());
    Ok(())
}
