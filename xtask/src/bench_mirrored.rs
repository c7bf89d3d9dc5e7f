//! `cargo xtask bench mirrored` and `cargo xtask bench many-queues`: mirrored
//! queues on a 3-node Warren cluster (separate processes on 127.0.0.1, over
//! TCP and over QUIC) and — when Debian's `rabbitmq-server` is installed — on
//! a 3-node RabbitMQ cluster with the same `ha-mode: all` policy, driven by
//! the same loads: the project's generator (`crates/node/examples/amqp_bench.rs`)
//! and standard clients: lapin (`crates/node/examples/lapin_perf.rs`),
//! Node.js's amqplib (`benches/amqplib/perf.js`) and RabbitMQ's Java client
//! (`benches/java/JavaPerf.java`).
//!
//! Every node runs on loopback on its own ports with its data and logs under
//! `target/bench-mirrored/`; only processes this command started are stopped
//! (by their pid), `epmd` included when RabbitMQ started it.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::Value;

use crate::client_perf::{PERSISTENT, PERSISTENT_UNLIMITED, PerfClient, TRANSIENT};
use crate::node::{NodeArgs, http, http_json, metric, wait_ready};

/// Warren node *i* (1-based) listens on these ports plus *i*.
const WARREN_AMQP: u16 = 5910;
const WARREN_HTTP: u16 = 15910;
const WARREN_METRICS: u16 = 15920;
const WARREN_PEER: u16 = 25910;
/// RabbitMQ node *i* listens on these ports plus *i*.
const RABBIT_AMQP: u16 = 5930;
const RABBIT_DIST: u16 = 25930;

/// The mirroring policy: queues named `ha.*` on every node, synced at once.
const HA_ALL: &str = r#"{"pattern":"^ha\\.","apply-to":"queues","definition":{"ha-mode":"all","ha-sync-mode":"automatic"}}"#;

/// The workloads: a name, the queue, and the load generator's flags.
pub(crate) const WORKLOADS: [(&str, &str, &[&str]); 2] = [
    (
        "1 KiB persistent, durable queue, 100 confirms in flight, manual acks",
        "ha.bench.persistent",
        &[
            "--size",
            "1024",
            "--confirms",
            "100",
            "--persistent",
            "--manual-ack",
        ],
    ),
    (
        "16 B transient, durable queue, no confirms, auto-ack",
        "ha.bench.transient",
        &["--size", "16", "--durable"],
    ),
];

/// A standard-client row of `bench mirrored`: its client's load on a fresh queue declared
/// through node 1 (so its master is there) and synchronised.
pub(crate) struct ClientWorkload {
    /// The row's name in the report.
    pub(crate) name: &'static str,
    /// The queue (matched by the `ha-all` policy).
    queue: &'static str,
    /// The nodes (0-based) the producers connect to, in turn.
    producers: &'static [usize],
    /// The nodes (0-based) the consumers connect to, in turn.
    consumers: &'static [usize],
    /// The client's load flags (`client_perf`), in groups.
    flags: &'static [&'static [&'static str]],
}

/// The standard clients' rows (lapin, Node.js's amqplib, RabbitMQ's Java
/// client), PerfTest-like: each publish and each ack its own frame.
pub(crate) const CLIENT_WORKLOADS: [ClientWorkload; 14] = [
    ClientWorkload {
        name: "lapin: 1 KiB persistent, 100 confirms in flight, manual acks, prefetch 200",
        queue: "ha.lapin.persistent",
        producers: &[0],
        consumers: &[0],
        flags: &[&PERSISTENT],
    },
    ClientWorkload {
        name: "lapin: the same, consumer on a mirror's node (node 2)",
        queue: "ha.lapin.mirror-consumer",
        producers: &[0],
        consumers: &[1],
        flags: &[&PERSISTENT],
    },
    ClientWorkload {
        name: "lapin: the same with no prefetch limit, consumer on node 2",
        queue: "ha.lapin.unlimited",
        producers: &[0],
        consumers: &[1],
        flags: &[&PERSISTENT_UNLIMITED],
    },
    ClientWorkload {
        name: "lapin: 16 B transient, no confirms, auto-ack",
        queue: "ha.lapin.transient",
        producers: &[0],
        consumers: &[0],
        flags: &[&TRANSIENT],
    },
    ClientWorkload {
        name: "lapin: 4 producers (100 confirms in flight each) on nodes 1, 2, 3, 1 and 2 consumers (manual acks, prefetch 200) on nodes 2, 3, 1 KiB persistent",
        queue: "ha.lapin.spread",
        producers: &[0, 1, 2],
        consumers: &[1, 2],
        flags: &[&["--producers", "4", "--consumers", "2"], &PERSISTENT],
    },
    ClientWorkload {
        name: "lapin: 16 B transient at 10,000 msg/s, no confirms, auto-ack",
        queue: "ha.lapin.rate-transient",
        producers: &[0],
        consumers: &[0],
        flags: &[&TRANSIENT, &["--rate", "10000"]],
    },
    ClientWorkload {
        name: "lapin: 1 KiB persistent at 2,000 msg/s, 100 confirms in flight, manual acks, prefetch 200",
        queue: "ha.lapin.rate-persistent",
        producers: &[0],
        consumers: &[0],
        flags: &[&PERSISTENT, &["--rate", "2000"]],
    },
    ClientWorkload {
        name: "amqplib: 1 KiB persistent, 100 confirms in flight, manual acks, prefetch 200",
        queue: "ha.amqplib.persistent",
        producers: &[0],
        consumers: &[0],
        flags: &[&PERSISTENT],
    },
    ClientWorkload {
        name: "amqplib: 16 B transient, no confirms, auto-ack",
        queue: "ha.amqplib.transient",
        producers: &[0],
        consumers: &[0],
        flags: &[&TRANSIENT],
    },
    ClientWorkload {
        name: "amqplib: 1 KiB persistent at 2,000 msg/s, 100 confirms in flight, manual acks, prefetch 200",
        queue: "ha.amqplib.rate-persistent",
        producers: &[0],
        consumers: &[0],
        flags: &[&PERSISTENT, &["--rate", "2000"]],
    },
    ClientWorkload {
        name: "java: 1 KiB persistent, 100 confirms in flight, manual acks, prefetch 200",
        queue: "ha.java.persistent",
        producers: &[0],
        consumers: &[0],
        flags: &[&PERSISTENT],
    },
    ClientWorkload {
        name: "java: 16 B transient, no confirms, auto-ack",
        queue: "ha.java.transient",
        producers: &[0],
        consumers: &[0],
        flags: &[&TRANSIENT],
    },
    ClientWorkload {
        name: "java: 1 KiB persistent at 2,000 msg/s, 100 confirms in flight, manual acks, prefetch 200",
        queue: "ha.java.rate-persistent",
        producers: &[0],
        consumers: &[0],
        flags: &[&PERSISTENT, &["--rate", "2000"]],
    },
    ClientWorkload {
        name: "java: 4 producers (no confirms) on nodes 1, 2, 3, 1 and 2 consumers (manual acks, no prefetch limit) on nodes 2, 3, 16 B transient",
        queue: "ha.java.spread",
        producers: &[0, 1, 2],
        consumers: &[1, 2],
        flags: &[&["--producers", "4", "--consumers", "2", "--size", "16"]],
    },
];

fn flag<'a>(rest: &[&'a str], name: &str) -> Option<&'a str> {
    rest.iter()
        .position(|a| *a == name)
        .and_then(|i| rest.get(i + 1).copied())
}

fn number(rest: &[&str], name: &str, default: u64) -> anyhow::Result<u64> {
    flag(rest, name).map_or(Ok(default), |v| {
        v.parse()
            .with_context(|| format!("{name} takes a number, not {v:?}"))
    })
}

/// Where cargo puts the release binaries (`CARGO_TARGET_DIR` or `target/`).
fn release_dir(root: &Path) -> PathBuf {
    crate::bench::target_dir(root).join("release")
}

fn build() -> anyhow::Result<()> {
    crate::cargo_step(
        "build warren and the load generator (release)",
        &[
            "build",
            "--release",
            "-p",
            "warren-node",
            "--bins",
            "--examples",
        ],
    )
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// Waits up to `limit` for `child` to exit; true if it did.
fn wait_exit(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// Runs `cmd` (named `what`) to its end, killing it after `limit`;
/// returns its stdout, or fails with its stdout and stderr if it failed.
pub(crate) fn output_within(
    cmd: &mut Command,
    what: &str,
    limit: Duration,
) -> anyhow::Result<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {what}"))?;
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut stderr = child.stderr.take().context("stderr")?;
    let reader = std::thread::spawn(move || {
        let (mut out, mut err) = (String::new(), String::new());
        let _ = stdout.read_to_string(&mut out);
        let _ = stderr.read_to_string(&mut err);
        (out, err)
    });
    if !wait_exit(&mut child, limit) {
        let _ = child.kill();
        let _ = child.wait();
        bail!("{what} did not finish within {limit:?}: killed");
    }
    let status = child.wait()?;
    let (text, err) = reader.join().unwrap_or_default();
    if !status.success() {
        bail!("{what} failed ({status}): {text}{err}");
    }
    Ok(text)
}

pub(crate) fn wait_port(port: u16, what: &str, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{what} did not open port {port} within {limit:?}")
}

/// Polls `check` every 200 ms until it holds; fails after `limit`.
pub(crate) fn eventually(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        if check()? {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn list_len(v: &Value, key: &str) -> usize {
    v.get(key).and_then(Value::as_array).map_or(0, Vec::len)
}

/// One started `warren` process, stopped (SIGTERM, then SIGKILL) when dropped.
struct WarrenNode {
    name: String,
    amqp: u16,
    http: String,
    /// The Prometheus listener.
    metrics: String,
    child: Child,
}

impl WarrenNode {
    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for WarrenNode {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        signal(self.pid(), "-TERM");
        if !wait_exit(&mut self.child, Duration::from_secs(20)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Started `warren` nodes, all sent SIGTERM at once when dropped.
struct WarrenCluster(Vec<WarrenNode>);

impl Drop for WarrenCluster {
    fn drop(&mut self) {
        for n in &mut self.0 {
            if let Ok(None) = n.child.try_wait() {
                signal(n.pid(), "-TERM");
            }
        }
    }
}

impl std::ops::Deref for WarrenCluster {
    type Target = [WarrenNode];

    fn deref(&self) -> &[WarrenNode] {
        &self.0
    }
}

/// Starts `size` clustered `warren` processes on 127.0.0.1 and sets `ha-all`.
fn warren_cluster(
    root: &Path,
    dir: &Path,
    transport: &str,
    size: u16,
) -> anyhow::Result<WarrenCluster> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let secret = dir.join("cluster-secret");
    std::fs::write(&secret, format!("warren-bench-{}\n", std::process::id()))?;
    let bin = release_dir(root).join("warren");
    let mut nodes = WarrenCluster(Vec::new());
    for i in 1..=size {
        let name = format!("warren@n{i}");
        let data = dir.join(format!("node{i}"));
        let ca = dir.join("ca");
        let mut cmd = Command::new(&bin);
        NodeArgs {
            name: &name,
            amqp: format!("127.0.0.1:{}", WARREN_AMQP + i),
            http: format!("127.0.0.1:{}", WARREN_HTTP + i),
            metrics: format!("127.0.0.1:{}", WARREN_METRICS + i),
            peer: format!("127.0.0.1:{}", WARREN_PEER + i),
            transport: Some(transport),
            secret: &secret,
            data: &data,
            ca_dir: (transport == "quic").then_some(ca.as_path()),
            join: (i > 1).then(|| format!("127.0.0.1:{}", WARREN_PEER + 1)),
        }
        .apply(&mut cmd);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn,openraft=error");
        }
        let log = std::fs::File::create(dir.join(format!("node{i}.log")))?;
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("node stdout")?;
        nodes.0.push(WarrenNode {
            name: name.clone(),
            amqp: WARREN_AMQP + i,
            http: format!("127.0.0.1:{}", WARREN_HTTP + i),
            metrics: format!("127.0.0.1:{}", WARREN_METRICS + i),
            child,
        });
        wait_ready(stdout, &name, Duration::from_secs(120), None)
            .with_context(|| format!("see {}", dir.join(format!("node{i}.log")).display()))?;
    }
    let first = nodes[0].http.clone();
    eventually(
        &format!("{size} running cluster members"),
        Duration::from_secs(60),
        || {
            Ok(http_json(&first, "/api/cluster")?
                .is_some_and(|v| list_len(&v, "running_nodes") == usize::from(size)))
        },
    )?;
    let (status, text) = http(&first, "PUT", "/api/policies/%2F/ha-all", Some(HA_ALL))?;
    if ![200, 201, 204].contains(&status) {
        bail!("setting the ha-all policy answered {status}: {text}");
    }
    Ok(nodes)
}

/// Waits until the Warren queue `name` has `mirrors` synchronised mirrors.
fn warren_synced(node: &WarrenNode, name: &str, mirrors: usize) -> anyhow::Result<Duration> {
    let path = format!("/api/queues/%2F/{name}");
    eventually(
        &format!("{name} to have {mirrors} synchronised mirrors on Warren"),
        Duration::from_secs(60),
        || {
            Ok(http_json(&node.http, &path)?
                .is_some_and(|q| list_len(&q, "synchronised_slave_nodes") == mirrors))
        },
    )
}

/// A RabbitMQ node from Debian's package, stopped (SIGTERM to its start
/// script, then SIGKILL to the Erlang VM) when dropped.
pub(crate) struct RabbitNode {
    name: String,
    port: u16,
    child: Child,
    home: PathBuf,
}

const RABBIT_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// `rabbitmq.conf` lines every RabbitMQ node started from now on gets
/// (the conformance scenarios' settings); none for the benches.
static RABBIT_SETTINGS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Whether the nodes run RabbitMQ's management plugin, node `i`'s API on
/// `127.0.0.1:RABBIT_MANAGEMENT + i` (the Java client scenarios' recording).
static RABBIT_WITH_MANAGEMENT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
/// Where node `i`'s management API listens: this port + `i`.
pub(crate) const RABBIT_MANAGEMENT: u16 = 15930;

/// Starts the nodes with the management plugin (once per process).
pub(crate) fn rabbit_with_management() {
    let _ = RABBIT_WITH_MANAGEMENT.set(());
}

/// Sets [`RABBIT_SETTINGS`] (once per process).
pub(crate) fn set_rabbit_settings(lines: String) {
    let _ = RABBIT_SETTINGS.set(lines);
}
const RABBIT_CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";

impl RabbitNode {
    /// Starts node `i` of a cluster under `dir` (its data kept there, so a
    /// node started again rejoins) and waits until it is up.
    fn start(dir: &Path, i: u16) -> anyhow::Result<Self> {
        let base = dir.join(format!("rabbit{i}"));
        std::fs::create_dir_all(base.join("log"))?;
        let port = RABBIT_AMQP + i;
        let mut settings = RABBIT_SETTINGS.get().cloned().unwrap_or_default();
        if RABBIT_WITH_MANAGEMENT.get().is_some() {
            std::fs::write(base.join("enabled_plugins"), "[rabbitmq_management].\n")?;
            settings.push_str(&format!(
                "management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {}\n",
                RABBIT_MANAGEMENT + i
            ));
        }
        std::fs::write(
            base.join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n{settings}"),
        )?;
        // With settings (the conformance runs'), a channel looks at its
        // consumer timeout every second, as Warren does (RabbitMQ's channel
        // tick: 60 s by default).
        let tick = if RABBIT_SETTINGS.get().is_none_or(String::is_empty) {
            ""
        } else {
            "{channel_tick_interval, 1000}"
        };
        std::fs::write(
            base.join("advanced.config"),
            format!("[{{rabbit, [{tick}]}}].\n"),
        )?;
        let name = format!("rabbit{i}@localhost");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("rabbit{i}.log")))?;
        let child = Command::new(RABBIT_SERVER)
            .env("RABBITMQ_NODENAME", &name)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", (RABBIT_DIST + i).to_string())
            .env("RABBITMQ_MNESIA_BASE", base.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", base.join("log"))
            .env("RABBITMQ_CONFIG_FILE", base.join("rabbitmq"))
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                base.join("advanced.config"),
            )
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                base.join("enabled_plugins"),
            )
            .env("HOME", dir)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting rabbitmq-server")?;
        let node = RabbitNode {
            name,
            port,
            child,
            home: dir.to_owned(),
        };
        wait_port(port, &node.name, Duration::from_secs(120))?;
        node.ctl(&["await_startup"])?;
        Ok(node)
    }

    /// Kills the node's Erlang VM: SIGKILL, no clean stop.
    pub(crate) fn crash(&mut self) -> anyhow::Result<()> {
        let beam = self.beam_pid()?;
        signal(beam, "-KILL");
        let _ = self.child.kill();
        let _ = self.child.wait();
        Ok(())
    }

    /// Starts this node, number `i` of its cluster, again on its data
    /// (after [`Self::crash`]); returns once it is up.
    pub(crate) fn restart(&mut self, i: u16) -> anyhow::Result<()> {
        let home = self.home.clone();
        // The old value's Drop finds its start script gone and does nothing.
        *self = Self::start(&home, i)?;
        Ok(())
    }

    pub(crate) fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Runs `rabbitmqctl -n NODE args…`; returns its stdout.
    pub(crate) fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        rabbitmqctl(&self.home, &self.name, args)
    }

    /// The Erlang VM's pid.
    fn beam_pid(&self) -> anyhow::Result<u32> {
        let out = self.ctl(&["eval", "os:getpid()."])?;
        out.trim()
            .trim_matches('"')
            .parse()
            .with_context(|| format!("os:getpid() on {} answered {out:?}", self.name))
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let beam = self.beam_pid().ok();
        signal(self.child.id(), "-TERM");
        if !wait_exit(&mut self.child, Duration::from_secs(30)) {
            if let Some(pid) = beam {
                signal(pid, "-KILL");
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn rabbitmqctl(home: &Path, node: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(RABBIT_CTL)
        .env("HOME", home)
        .args(["-n", node])
        .args(args)
        .output()
        .context("running rabbitmqctl")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl -n {node} {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Stops the `epmd` RabbitMQ started (it outlives the nodes): every one
/// not in `before` ([`epmd_pids`] taken before starting them), by its pid.
pub(crate) fn stop_new_epmd(before: &[u32]) {
    let started: Vec<u32> = epmd_pids()
        .into_iter()
        .filter(|pid| !before.contains(pid))
        .collect();
    for &pid in &started {
        signal(pid, "-TERM");
    }
    std::thread::sleep(Duration::from_secs(1));
    // `epmd -daemon` may outlive SIGTERM.
    let running = epmd_pids();
    for pid in started.into_iter().filter(|p| running.contains(p)) {
        signal(pid, "-KILL");
    }
}

/// The pids of running `epmd` processes.
pub(crate) fn epmd_pids() -> Vec<u32> {
    Command::new("pidof")
        .arg("epmd")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Starts a RabbitMQ cluster of `size` nodes with the `ha-all` policy;
/// `None` when `rabbitmq-server` is not installed.
pub(crate) fn rabbit_cluster(dir: &Path, size: u16) -> anyhow::Result<Option<Vec<RabbitNode>>> {
    if !Path::new(RABBIT_SERVER).exists() {
        return Ok(None);
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    // A shared Erlang cookie for the nodes and rabbitmqctl, in a HOME of our own.
    let cookie = dir.join(".erlang.cookie");
    std::fs::write(&cookie, format!("WARRENBENCH{}", std::process::id()))?;
    Command::new("chmod").arg("400").arg(&cookie).status()?;
    let mut nodes: Vec<RabbitNode> = Vec::new();
    for i in 1..=size {
        let node = RabbitNode::start(dir, i)?;
        let name = node.name.clone();
        if i > 1 {
            node.ctl(&["stop_app"])?;
            node.ctl(&["join_cluster", "rabbit1@localhost"])?;
            node.ctl(&["start_app"])?;
        }
        println!("    {name} up on 127.0.0.1:{}", node.port);
        nodes.push(node);
    }
    nodes[0].ctl(&[
        "set_policy",
        "--apply-to",
        "queues",
        "ha-all",
        r"^ha\.",
        r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#,
    ])?;
    Ok(Some(nodes))
}

/// Waits until the RabbitMQ queue `name` has `mirrors` synchronised mirrors.
fn rabbit_synced(node: &RabbitNode, name: &str, mirrors: usize) -> anyhow::Result<Duration> {
    rabbit_synced_or(node, name, mirrors, false)
}

/// Waits until the RabbitMQ queue `name` has `mirrors` synchronised mirrors,
/// or (with `or_gone`) no longer exists.
pub(crate) fn rabbit_synced_or(
    node: &RabbitNode,
    name: &str,
    mirrors: usize,
    or_gone: bool,
) -> anyhow::Result<Duration> {
    eventually(
        &format!("{name} to have {mirrors} synchronised mirrors on RabbitMQ"),
        Duration::from_secs(60),
        || {
            let out = node.ctl(&[
                "list_queues",
                "-q",
                "--no-table-headers",
                "name",
                "synchronised_slave_pids",
            ])?;
            let line = out
                .lines()
                .find(|l| l.split_whitespace().next() == Some(name));
            Ok(match line {
                Some(l) => l.matches("@localhost").count() == mirrors,
                None => or_gone,
            })
        },
    )
}

/// Declares durable queues on `url`, `parallel` channels at a time.
async fn declare(url: &str, names: &[String], parallel: usize) -> anyhow::Result<()> {
    tokio::time::timeout(ADMIN_TIMEOUT, declare_all(url, names, parallel))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "declaring {} queue(s) on {url} took over {} s",
                names.len(),
                ADMIN_TIMEOUT.as_secs()
            )
        })?
}

/// Closes a bench connection; says so if the broker never answers the
/// `connection.close` (instead of waiting for ever).
async fn close(conn: &Connection, url: &str) {
    let closing = conn.close(200, "done".into());
    if tokio::time::timeout(Duration::from_secs(10), closing)
        .await
        .is_err()
    {
        println!("    warning: {url} did not answer connection.close within 10 s");
    }
}

/// How long declaring or deleting the bench's queues may take before the
/// bench gives up with an error (once, a client's declare never returned).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(120);

async fn declare_all(url: &str, names: &[String], parallel: usize) -> anyhow::Result<()> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let mut tasks = Vec::new();
    for part in names.chunks(names.len().div_ceil(parallel.max(1)).max(1)) {
        let ch = conn.create_channel().await?;
        let part = part.to_vec();
        tasks.push(tokio::spawn(async move {
            for name in part {
                ch.queue_declare(
                    name.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    close(&conn, url).await;
    Ok(())
}

/// Deletes a queue (what a run left in it included).
async fn delete(url: &str, name: &str) -> anyhow::Result<()> {
    let delete = async {
        let conn = Connection::connect(url, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        ch.queue_delete(name.into(), QueueDeleteOptions::default())
            .await?;
        close(&conn, url).await;
        anyhow::Ok(())
    };
    tokio::time::timeout(ADMIN_TIMEOUT, delete)
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "deleting {name} on {url} took over {} s",
                ADMIN_TIMEOUT.as_secs()
            )
        })?
}

/// One load generator run: published/s, consumed/s, latency p50 and p99
/// (µs), and the CPU all the cluster's nodes spent per consumed message (µs,
/// NaN when the generator did not report its count).
pub(crate) type Rates = [f64; 5];

/// One standard-client row's run: published/s, confirmed/s, consumed/s, end-to-end
/// latency p50 and p99 (ms), confirm latency p50 and p99 (ms), the backlog
/// left (messages published and not consumed when it ended) and the CPU all
/// the cluster's nodes spent per consumed message (µs) over the whole run.
pub(crate) type ClientRates = [f64; 9];

/// CPU time (clock ticks) of the processes `pids` and their descendants.
fn cluster_ticks(pids: &[u32]) -> u64 {
    pids.iter().map(|p| crate::cpu::tree_ticks(*p)).sum()
}

/// Seconds of CPU the processes `pids` spent since [`cluster_ticks`] gave `before`.
fn cluster_secs(pids: &[u32], before: u64) -> f64 {
    cluster_ticks(pids).saturating_sub(before) as f64 / crate::cpu::clock_ticks()
}

/// Runs a standard client's load (`client_perf`) against an existing (mirrored) queue on the cluster
/// whose nodes' AMQP URLs are `urls` and processes `pids`.
fn load_client(
    root: &Path,
    (urls, pids): (&[String], &[u32]),
    w: &ClientWorkload,
    duration: u64,
) -> anyhow::Result<ClientRates> {
    let pick = |nodes: &[usize]| {
        nodes
            .iter()
            .map(|&n| urls[n].as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (producers, consumers) = (pick(w.producers), pick(w.consumers));
    let mut args = vec!["--url", &producers, "--consume-url", &consumers];
    args.extend(["--queue", w.queue, "--keep-queue"]);
    args.extend(w.flags.concat());
    let before = cluster_ticks(pids);
    let r = crate::client_perf::run(root, PerfClient::of(w.name), &args, duration)?;
    let cluster_s = cluster_secs(pids, before);
    let cpu = if r.consumed_total > 0.0 {
        cluster_s * 1e6 / r.consumed_total
    } else {
        f64::NAN
    };
    Ok([
        r.published,
        r.confirmed,
        r.consumed,
        r.e2e_ms[0],
        r.e2e_ms[1],
        r.confirm_ms[0],
        r.confirm_ms[1],
        r.backlog,
        cpu,
    ])
}

/// Seconds the load generator waits for its consumer to drain the queue.
const DRAIN_TIMEOUT: u64 = 60;

/// Runs the load generator against an existing (mirrored) queue on the
/// cluster whose nodes' processes are `pids`; returns its rates and whether
/// the consumer received everything before [`DRAIN_TIMEOUT`].
fn load(
    root: &Path,
    (url, pids): (&str, &[u32]),
    queue: &str,
    flags: &[&str],
    duration: u64,
) -> anyhow::Result<(Rates, bool)> {
    let before = cluster_ticks(pids);
    let mut cmd = Command::new(release_dir(root).join("examples/amqp_bench"));
    cmd.args(["--url", url, "--queue", queue, "--keep-queue"])
        .args(["--duration", &duration.to_string()])
        .args(["--drain-timeout", &DRAIN_TIMEOUT.to_string()])
        .args(flags);
    let limit = Duration::from_secs(duration + DRAIN_TIMEOUT + 60);
    let text = output_within(&mut cmd, "amqp_bench", limit)?;
    let cluster_s = cluster_secs(pids, before);
    let [p, c, p50, p99] = crate::amqp_bench::rates(&text)?;
    let cpu = crate::amqp_bench::generator_cost(&text)
        .map_or(f64::NAN, |(messages, _)| cluster_s * 1e6 / messages);
    Ok(([p, c, p50, p99, cpu], !text.contains("drain timed out")))
}

/// Declares `queue` on `url`'s node, waits until it is synchronised
/// (`synced` waits for that), runs `run` (`name`, for `duration` s) on it
/// and deletes the queue afterwards (what the run left in it included).
fn on_synced_queue<T>(
    rt: &tokio::runtime::Runtime,
    (url, queue): (&str, &str),
    (name, duration): (&str, u64),
    synced: impl Fn(&str) -> anyhow::Result<Duration>,
    run: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    rt.block_on(declare(url, &[queue.to_owned()], 1))?;
    let took = synced(queue)?;
    println!(
        "    {queue}: mirrors synchronised after {:.1} s; {name} for {duration} s…",
        took.as_secs_f64()
    );
    let result = run()?;
    rt.block_on(delete(url, queue))?;
    Ok(result)
}

/// Runs one workload on a queue declared on `url`'s node and synchronised
/// (`synced` waits for that). Returns the rates and what went wrong on the
/// way, if anything.
fn workload(
    root: &Path,
    rt: &tokio::runtime::Runtime,
    (url, pids): (&str, &[u32]),
    (name, queue, flags): (&str, &str, &[&str]),
    duration: u64,
    synced: impl Fn(&str) -> anyhow::Result<Duration>,
) -> anyhow::Result<(Rates, Option<String>)> {
    let (r, drained) = on_synced_queue(rt, (url, queue), (name, duration), synced, || {
        load(root, (url, pids), queue, flags, duration)
    })?;
    println!(
        "    published/s {:.0}, consumed/s {:.0}, p50 {:.0} µs, p99 {:.0} µs, cluster CPU {:.1} µs/msg",
        r[0], r[1], r[2], r[3], r[4]
    );
    let note = (!drained).then(|| {
        format!("{name}: the consumer had not received every message {DRAIN_TIMEOUT} s after publishing stopped")
    });
    if let Some(n) = &note {
        println!("    {n}");
    }
    Ok((r, note))
}

/// Runs every standard-client row of [`CLIENT_WORKLOADS`] on the cluster whose nodes'
/// AMQP URLs are `urls` and processes `pids`, each on a fresh queue declared
/// through node 1 and synchronised (`synced` waits for that). Returns the
/// rates (`None` where a row failed) and the failures.
fn client_rows(
    root: &Path,
    rt: &tokio::runtime::Runtime,
    (urls, pids): (&[String], &[u32]),
    duration: u64,
    synced: impl Fn(&str) -> anyhow::Result<Duration>,
) -> (Vec<Option<ClientRates>>, Vec<String>) {
    let (mut rates, mut notes) = (Vec::new(), Vec::new());
    let clients = crate::client_perf::Clients::prepare(root);
    for w in &CLIENT_WORKLOADS {
        if let Some(why) = clients.why_not(PerfClient::of(w.name)) {
            println!("    {}: skipped, {why}", w.name);
            notes.push(format!("{} skipped: {why}", w.name));
            rates.push(None);
            continue;
        }
        let run = || load_client(root, (urls, pids), w, duration);
        match on_synced_queue(rt, (&urls[0], w.queue), (w.name, duration), &synced, run) {
            Ok(r) => {
                println!(
                    "    published/s {:.0}, confirmed/s {:.0}, consumed/s {:.0}, e2e p50 {:.2} ms, p99 {:.2} ms, confirm p50 {:.2} ms, p99 {:.2} ms, backlog {:.0}, cluster CPU {:.1} µs/msg",
                    r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]
                );
                rates.push(Some(r));
            }
            Err(e) => {
                println!("    failed: {e:#}");
                notes.push(format!("{} failed: {e:#}", w.name));
                rates.push(None);
            }
        }
    }
    (rates, notes)
}

/// Seconds the stall measurement goes on publishing after the SIGKILL.
const AFTER_KILL: Duration = Duration::from_secs(8);

/// The failover stalls measured, each on a fresh cluster: what happens, the
/// publisher's node, the queue master's node and the node SIGKILLed (0-based).
const STALLS: [(&str, usize, usize, usize); 2] = [
    (
        "a mirror dies (publisher and master on node 2, node 3 SIGKILLed)",
        1,
        1,
        2,
    ),
    (
        "the master dies (publisher on node 2, master on node 1 SIGKILLed)",
        1,
        0,
        0,
    ),
];

/// What a confirmed publisher saw around the SIGKILL of a mirror's node.
#[derive(Debug, Clone)]
struct Stall {
    /// The longest time without a positive confirm (ack) from the SIGKILL on
    /// (to the end of the run if acks never resumed); nacks do not count.
    longest_gap: Duration,
    /// When that pause began, counted from the SIGKILL.
    gap_start: Duration,
    /// From the SIGKILL to the first ack of a message published after it.
    first_new_confirm: Option<Duration>,
    /// Acks received after the SIGKILL.
    confirms_after: usize,
    /// Publishes the broker nacked.
    nacks: u64,
    /// Whether confirms were still outstanding 10 s after publishing stopped.
    stuck: bool,
    /// The publisher's error, if its channel or connection failed.
    error: Option<String>,
}

/// Publishes 1 KiB persistent messages with 100 confirms in flight to
/// `queue` on `url`; after 2 s SIGKILLs `pid` and goes on for [`AFTER_KILL`].
async fn stall(url: &str, queue: &str, pid: u32) -> anyhow::Result<Stall> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    // (sent, confirmed, ack) for every confirm received.
    let seen: Arc<Mutex<Vec<(Instant, Instant, bool)>>> = Arc::default();
    let producer = {
        let (stop, seen, queue) = (stop.clone(), seen.clone(), queue.to_owned());
        tokio::spawn(async move {
            let body = vec![0u8; 1024];
            let props = BasicProperties::default().with_delivery_mode(2);
            let mut inflight = std::collections::VecDeque::new();
            loop {
                let stopping = stop.load(Ordering::Relaxed);
                if !stopping {
                    let sent = Instant::now();
                    let confirm = ch
                        .basic_publish(
                            "".into(),
                            queue.as_str().into(),
                            BasicPublishOptions::default(),
                            &body,
                            props.clone(),
                        )
                        .await?;
                    inflight.push_back((sent, confirm));
                }
                let window = if stopping { 0 } else { 100 };
                while inflight.len() > window {
                    if let Some((sent, c)) = inflight.pop_front() {
                        let ack = c.await.is_ok_and(|c| c.is_ack());
                        if let Ok(mut s) = seen.lock() {
                            s.push((sent, Instant::now(), ack));
                        }
                    }
                }
                if stopping {
                    return anyhow::Ok(());
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let killed = Instant::now();
    signal(pid, "-KILL");
    tokio::time::sleep(AFTER_KILL).await;
    let end = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let (stuck, error) = match tokio::time::timeout(Duration::from_secs(10), producer).await {
        Err(_) => (true, None),
        Ok(Ok(Ok(()))) => (false, None),
        Ok(Ok(Err(e))) => (false, Some(format!("{e:#}"))),
        Ok(Err(e)) => (false, Some(e.to_string())),
    };
    close(&conn, url).await;
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    let mut times: Vec<Instant> = seen
        .iter()
        .filter(|s| s.2)
        .map(|s| s.1)
        .filter(|t| (killed..end).contains(t))
        .collect();
    times.sort_unstable();
    let (mut longest_gap, mut gap_start) = (Duration::ZERO, Duration::ZERO);
    let mut previous = killed;
    for t in times.iter().copied().chain([end]) {
        if t.saturating_duration_since(previous) > longest_gap {
            longest_gap = t.saturating_duration_since(previous);
            gap_start = previous.duration_since(killed);
        }
        previous = t;
    }
    Ok(Stall {
        longest_gap,
        gap_start,
        first_new_confirm: seen
            .iter()
            .filter(|s| s.2 && s.0 >= killed)
            .map(|s| s.1.duration_since(killed))
            .min(),
        confirms_after: times.len(),
        nacks: seen.iter().filter(|s| !s.2).count() as u64,
        stuck,
        error,
    })
}

/// The results of one broker: rates per workload and the failover stalls.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// "Warren TCP", "Warren QUIC" or "RabbitMQ 3.x mirrored".
    pub(crate) broker: String,
    /// Rates per workload of [`WORKLOADS`], `None` where it failed.
    pub(crate) rates: Vec<Option<Rates>>,
    /// Rates per standard-client row of [`CLIENT_WORKLOADS`], `None` where it failed.
    pub(crate) lapin: Vec<Option<ClientRates>>,
    stalls: Vec<Option<Stall>>,
    note: String,
}

impl Outcome {
    /// The consumed/s of row `k`: the workloads of [`WORKLOADS`], then the
    /// standard-client rows of [`CLIENT_WORKLOADS`]; `None` where it failed.
    fn consumed(&self, k: usize) -> Option<f64> {
        match k.checked_sub(WORKLOADS.len()) {
            None => self.rates.get(k).copied().flatten().map(|r| r[1]),
            Some(l) => self.lapin.get(l).copied().flatten().map(|r| r[2]),
        }
    }
}

/// The names of the report's rows: [`WORKLOADS`], then [`CLIENT_WORKLOADS`].
fn row_names() -> impl Iterator<Item = &'static str> {
    WORKLOADS
        .iter()
        .map(|w| w.0)
        .chain(CLIENT_WORKLOADS.iter().map(|w| w.name))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Runs both workloads and the stall measurements on Warren clusters.
fn bench_warren(
    root: &Path,
    dir: &Path,
    transport: &str,
    opts: &Options,
) -> anyhow::Result<Outcome> {
    let rt = runtime()?;
    let broker = format!("Warren {}", transport.to_uppercase());
    let mut notes = Vec::new();
    let (size, mirrors, duration) = (opts.nodes, opts.mirrors(), opts.duration);
    println!(
        "==> {broker}: starting {size} nodes on 127.0.0.1 ({})",
        dir.display()
    );
    let mut rates = Vec::new();
    let lapin;
    {
        let nodes = warren_cluster(root, &dir.join("workloads"), transport, size)?;
        for w in WORKLOADS {
            let synced = |queue: &str| warren_synced(&nodes[0], queue, mirrors);
            let pids: Vec<u32> = nodes.iter().map(WarrenNode::pid).collect();
            let result = workload(root, &rt, (&nodes[0].url(), &pids), w, duration, synced);
            // Where the queue's master is now (it should not have moved).
            let master = http_json(&nodes[1].http, &format!("/api/queues/%2F/{}", w.1))
                .ok()
                .flatten()
                .and_then(|q| q["node"].as_str().map(str::to_owned));
            match result {
                Ok((r, note)) => {
                    rates.push(Some(r));
                    notes.extend(note);
                }
                Err(e) => {
                    println!("    failed: {e:#}");
                    let moved = master
                        .filter(|m| *m != nodes[0].name)
                        .map(|m| format!(" (the queue's master was {m} afterwards)"))
                        .unwrap_or_default();
                    notes.push(format!("{} failed: {e:#}{moved}", w.0));
                    rates.push(None);
                }
            }
        }
        let urls: Vec<String> = nodes.iter().map(WarrenNode::url).collect();
        let pids: Vec<u32> = nodes.iter().map(WarrenNode::pid).collect();
        let synced = |queue: &str| warren_synced(&nodes[0], queue, mirrors);
        let (r, failures) = client_rows(root, &rt, (&urls, &pids), duration, synced);
        lapin = r;
        notes.extend(failures);
    }
    let mut stalls = Vec::new();
    for (k, (what, publisher, master, victim)) in opts.stalls().enumerate() {
        println!("    publisher stall when {what}: a fresh cluster…");
        let run = || -> anyhow::Result<Stall> {
            let nodes = warren_cluster(root, &dir.join(format!("stall{k}")), transport, size)?;
            let queue = "ha.bench.stall";
            rt.block_on(declare(&nodes[master].url(), &[queue.to_owned()], 1))?;
            warren_synced(&nodes[master], queue, mirrors)?;
            let actual = http_json(&nodes[master].http, &format!("/api/queues/%2F/{queue}"))?
                .and_then(|q| q["node"].as_str().map(str::to_owned))
                .unwrap_or_default();
            if actual != nodes[master].name {
                bail!(
                    "the queue's master is {actual:?}, not {}",
                    nodes[master].name
                );
            }
            let s = rt.block_on(stall(&nodes[publisher].url(), queue, nodes[victim].pid()))?;
            print_stall(&s);
            Ok(s)
        };
        match run() {
            Ok(s) => stalls.push(Some(s)),
            Err(e) => {
                println!("    failed: {e:#}");
                notes.push(format!("stall when {what} failed: {e:#}"));
                stalls.push(None);
            }
        }
    }
    Ok(Outcome {
        broker,
        rates,
        lapin,
        stalls,
        note: notes.join("; "),
    })
}

fn print_stall(s: &Stall) {
    println!("    {}", describe_stall(s));
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn describe_stall(s: &Stall) -> String {
    format!(
        "longest pause in acks {} (from {} after the SIGKILL), first ack of a new publish after {}, {} acks in the {} s after the SIGKILL, {} nacks{}",
        ms(s.longest_gap),
        ms(s.gap_start),
        s.first_new_confirm.map_or("never".to_owned(), ms),
        s.confirms_after,
        AFTER_KILL.as_secs(),
        s.nacks,
        match (&s.error, s.stuck) {
            (Some(e), _) => format!("; the publisher failed: {e}"),
            (None, true) => "; confirms still outstanding 10 s after publishing stopped".to_owned(),
            (None, false) => String::new(),
        }
    )
}

/// Runs both workloads and the stall measurement on a RabbitMQ cluster.
fn bench_rabbit(root: &Path, dir: &Path, opts: &Options) -> anyhow::Result<Option<Outcome>> {
    let rt = runtime()?;
    let (size, mirrors, duration) = (opts.nodes, opts.mirrors(), opts.duration);
    let version = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "rabbitmq-server"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let broker = format!(
        "RabbitMQ {} mirrored",
        version.split('-').next().unwrap_or("3")
    );
    println!(
        "==> {broker}: starting {size} nodes on 127.0.0.1 ({})",
        dir.display()
    );
    let epmd_before = epmd_pids();
    let result = (|| -> anyhow::Result<Option<Outcome>> {
        let Some(nodes) = rabbit_cluster(&dir.join("workloads"), size)? else {
            return Ok(None);
        };
        let mut rates = Vec::new();
        let mut notes = Vec::new();
        for w in WORKLOADS {
            let synced = |queue: &str| rabbit_synced(&nodes[0], queue, mirrors);
            // rabbitmq-server's process tree holds the Erlang VM.
            let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
            match workload(root, &rt, (&nodes[0].url(), &pids), w, duration, synced) {
                Ok((r, note)) => {
                    rates.push(Some(r));
                    notes.extend(note);
                }
                Err(e) => {
                    println!("    failed: {e:#}");
                    notes.push(format!("{} failed: {e:#}", w.0));
                    rates.push(None);
                }
            }
        }
        let urls: Vec<String> = nodes.iter().map(RabbitNode::url).collect();
        let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
        let synced = |queue: &str| rabbit_synced(&nodes[0], queue, mirrors);
        let (lapin, failures) = client_rows(root, &rt, (&urls, &pids), duration, synced);
        notes.extend(failures);
        drop(nodes);
        let mut stalls = Vec::new();
        for (k, (what, publisher, master, victim)) in opts.stalls().enumerate() {
            println!("    publisher stall when {what}: a fresh cluster…");
            let run = || -> anyhow::Result<Stall> {
                let nodes = rabbit_cluster(&dir.join(format!("stall{k}")), size)?
                    .context("rabbitmq-server went missing")?;
                let queue = "ha.bench.stall";
                rt.block_on(declare(&nodes[master].url(), &[queue.to_owned()], 1))?;
                rabbit_synced(&nodes[master], queue, mirrors)?;
                let pid = nodes[victim].beam_pid()?;
                let s = rt.block_on(stall(&nodes[publisher].url(), queue, pid))?;
                print_stall(&s);
                Ok(s)
            };
            match run() {
                Ok(s) => stalls.push(Some(s)),
                Err(e) => {
                    println!("    failed: {e:#}");
                    notes.push(format!("stall when {what} failed: {e:#}"));
                    stalls.push(None);
                }
            }
        }
        Ok(Some(Outcome {
            broker: broker.clone(),
            rates,
            lapin,
            stalls,
            note: notes.join("; "),
        }))
    })();
    stop_new_epmd(&epmd_before);
    result
}

/// What `bench mirrored` runs, from its flags.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Seconds per load generator run and per lapin row.
    pub(crate) duration: u64,
    /// Warren's cluster transports to run: "tcp", "quic".
    pub(crate) transports: Vec<String>,
    /// Whether to run RabbitMQ too (when it is installed).
    pub(crate) rabbitmq: bool,
    /// Nodes per cluster (at least 3: the stalls kill node 1 or 3).
    pub(crate) nodes: u16,
    /// Whether to measure the publisher stalls when a node is SIGKILLed.
    pub(crate) stalls: bool,
    /// How many times every broker runs the workloads, in turn; the report
    /// gives each figure's median and each round's ratios.
    pub(crate) rounds: u64,
}

impl Options {
    /// `[--duration S] [--transports tcp,quic] [--nodes N] [--rounds N] [--no-rabbitmq] [--no-stalls]`.
    pub(crate) fn parse(rest: &[&str]) -> anyhow::Result<Self> {
        let transports: Vec<String> = flag(rest, "--transports")
            .unwrap_or("tcp,quic")
            .split(',')
            .map(str::to_owned)
            .collect();
        if let Some(t) = transports
            .iter()
            .find(|t| !["tcp", "quic"].contains(&t.as_str()))
        {
            bail!("unknown transport {t:?} (tcp, quic)");
        }
        let nodes = number(rest, "--nodes", 3)?;
        if !(3..=9).contains(&nodes) {
            bail!("--nodes takes 3 to 9, not {nodes}");
        }
        let rounds = number(rest, "--rounds", 1)?;
        if rounds == 0 {
            bail!("--rounds takes 1 or more");
        }
        Ok(Self {
            duration: number(rest, "--duration", 10)?,
            transports,
            rabbitmq: !rest.contains(&"--no-rabbitmq"),
            nodes: nodes as u16,
            stalls: !rest.contains(&"--no-stalls"),
            rounds,
        })
    }

    /// Synchronised mirrors a queue has once mirrored on every node.
    fn mirrors(&self) -> usize {
        usize::from(self.nodes) - 1
    }

    /// The stall measurements to run.
    fn stalls(&self) -> impl Iterator<Item = (&'static str, usize, usize, usize)> {
        STALLS.into_iter().filter(|_| self.stalls)
    }

    /// The file the report is written to, under `target/bench-mirrored/`.
    pub(crate) fn report_file(&self) -> String {
        if self.nodes == 3 {
            "report.md".to_owned()
        } else {
            format!("report-{}-nodes.md", self.nodes)
        }
    }
}

/// What `bench mirrored` measured: each broker's outcome and the report.
#[derive(Debug)]
pub(crate) struct Mirrored {
    /// One per Warren transport, then RabbitMQ's when it ran.
    pub(crate) outcomes: Vec<Outcome>,
    /// The Markdown report (tables and notes).
    pub(crate) report: String,
}

impl Mirrored {
    /// The consumed/s of the broker whose name starts with `broker` on
    /// workload `w` of [`WORKLOADS`], if it ran.
    pub(crate) fn consumed(&self, broker: &str, w: usize) -> Option<f64> {
        self.outcomes
            .iter()
            .find(|o| o.broker.starts_with(broker))
            .and_then(|o| o.consumed(w))
    }
}

/// `bench mirrored [--duration S] [--transports tcp,quic] [--nodes N]
/// [--rounds N] [--no-rabbitmq] [--no-stalls]`: measures, prints and writes
/// the report.
pub(crate) fn mirrored(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let opts = Options::parse(rest)?;
    let m = measure(root, &opts)?;
    let out = crate::bench::target_dir(root)
        .join("bench-mirrored")
        .join(opts.report_file());
    std::fs::write(&out, &m.report)?;
    println!("\n{}\n(written to {})", m.report, out.display());
    Ok(())
}

/// Runs the workloads (and stalls) on each Warren transport, then on
/// RabbitMQ, `--rounds` times; the stalls only in the first round.
pub(crate) fn measure(root: &Path, opts: &Options) -> anyhow::Result<Mirrored> {
    build()?;
    let out_dir = crate::bench::target_dir(root).join("bench-mirrored");
    std::fs::create_dir_all(&out_dir)?;
    let mut rounds = Vec::new();
    let mut rabbit_note = String::new();
    for round in 0..opts.rounds {
        if opts.rounds > 1 {
            println!("==> round {} of {}", round + 1, opts.rounds);
        }
        let round_opts = Options {
            stalls: opts.stalls && round == 0,
            ..opts.clone()
        };
        let (outcomes, note) = measure_round(root, &out_dir, &round_opts);
        rounds.push(outcomes);
        rabbit_note = note;
    }
    let outcomes = medians(&rounds);
    let mut report = mirrored_report(&outcomes, opts, &rabbit_note)?;
    if rounds.len() > 1 {
        report.push_str(&round_ratios(&rounds)?);
    }
    Ok(Mirrored { outcomes, report })
}

/// One round: every Warren transport, then RabbitMQ; returns the outcomes
/// and why RabbitMQ did not run, if it did not.
fn measure_round(root: &Path, out_dir: &Path, opts: &Options) -> (Vec<Outcome>, String) {
    let mut outcomes = Vec::new();
    for t in &opts.transports {
        match bench_warren(root, &out_dir.join(format!("warren-{t}")), t, opts) {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                println!("    Warren over {t} failed: {e:#}");
                outcomes.push(Outcome {
                    broker: format!("Warren {}", t.to_uppercase()),
                    rates: vec![None; WORKLOADS.len()],
                    lapin: vec![None; CLIENT_WORKLOADS.len()],
                    stalls: Vec::new(),
                    note: format!("failed: {e:#}"),
                });
            }
        }
    }
    let mut rabbit_note = String::new();
    if !opts.rabbitmq {
        rabbit_note = "RabbitMQ skipped (--no-rabbitmq).".to_owned();
    } else {
        match bench_rabbit(root, &out_dir.join("rabbitmq"), opts) {
            Ok(Some(o)) => outcomes.push(o),
            Ok(None) => {
                rabbit_note = format!(
                    "RabbitMQ could not be run: {RABBIT_SERVER} is missing (apt-get install rabbitmq-server)."
                );
            }
            Err(e) => rabbit_note = format!("RabbitMQ could not be run: {e:#}"),
        }
    }
    if !rabbit_note.is_empty() {
        println!("    {rabbit_note}");
    }
    (outcomes, rabbit_note)
}

/// The first round's outcomes with each rate replaced by its median over
/// the rounds in which that broker ran that workload.
fn medians(rounds: &[Vec<Outcome>]) -> Vec<Outcome> {
    let Some((first, _)) = rounds.split_first() else {
        return Vec::new();
    };
    first
        .iter()
        .map(|o| {
            let runs: Vec<&Outcome> = rounds
                .iter()
                .filter_map(|r| r.iter().find(|x| x.broker == o.broker))
                .collect();
            Outcome {
                rates: row_medians(&runs, WORKLOADS.len(), |x| &x.rates),
                lapin: row_medians(&runs, CLIENT_WORKLOADS.len(), |x| &x.lapin),
                ..o.clone()
            }
        })
        .collect()
}

/// For each of `rows` rows, the median of each figure over the `runs` that
/// have that row (`None` if none has).
fn row_medians<const N: usize>(
    runs: &[&Outcome],
    rows: usize,
    of: impl Fn(&Outcome) -> &[Option<[f64; N]>],
) -> Vec<Option<[f64; N]>> {
    (0..rows)
        .map(|w| {
            let got: Vec<[f64; N]> = runs
                .iter()
                .filter_map(|x| of(x).get(w).copied().flatten())
                .collect();
            (!got.is_empty())
                .then(|| std::array::from_fn(|m| median(got.iter().map(|r| r[m]).collect())))
        })
        .collect()
}

/// The median of the finite values (NaN when there are none).
fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Each round's consumed/s ratio of every Warren transport to the RabbitMQ
/// run of the same round, per workload.
fn round_ratios(rounds: &[Vec<Outcome>]) -> anyhow::Result<String> {
    let mut t = format!(
        "\nThe figures above are medians of {} rounds (each broker once per round, in turn; the stalls from the first round). Consumed/s against the RabbitMQ run of the same round:\n\n",
        rounds.len()
    );
    let Some(first) = rounds.first() else {
        return Ok(t);
    };
    for (w, name) in row_names().enumerate() {
        for o in first.iter().filter(|o| o.broker.starts_with("Warren")) {
            let ratios: Vec<String> = rounds
                .iter()
                .map(|r| {
                    let warren = r.iter().find(|x| x.broker == o.broker);
                    let rabbit = r.iter().find(|x| x.broker.starts_with("RabbitMQ"));
                    match (
                        warren.and_then(|x| x.consumed(w)),
                        rabbit.and_then(|x| x.consumed(w)),
                    ) {
                        (Some(a), Some(b)) => format!("{:.2}×", a / b.max(1.0)),
                        _ => "–".to_owned(),
                    }
                })
                .collect();
            writeln!(t, "- {name}, {}: {}", o.broker, ratios.join(", "))?;
        }
    }
    Ok(t)
}

fn mirrored_report(
    outcomes: &[Outcome],
    opts: &Options,
    rabbit_note: &str,
) -> anyhow::Result<String> {
    let mut t = String::new();
    let rabbit = outcomes.iter().find(|o| o.broker.starts_with("RabbitMQ"));
    let warrens: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.broker.starts_with("Warren"))
        .collect();
    writeln!(
        t,
        "{} nodes on 127.0.0.1, policy ha-mode all with automatic sync, one producer and one consumer on the master's node, {} s per run (after 1 s of warm-up).\n",
        opts.nodes, opts.duration
    )?;
    write!(t, "| workload | measure |")?;
    for o in outcomes {
        write!(t, " {} |", o.broker)?;
    }
    if let Some(r) = rabbit {
        for w in &warrens {
            write!(
                t,
                " {} / {} |",
                w.broker,
                r.broker.trim_end_matches(" mirrored")
            )?;
        }
    }
    writeln!(t)?;
    write!(t, "|---|---|")?;
    for _ in 0..outcomes.len() + rabbit.map_or(0, |_| warrens.len()) {
        write!(t, "---:|")?;
    }
    writeln!(t)?;
    let measures = [
        "published/s",
        "consumed/s",
        "latency p50 µs",
        "latency p99 µs",
        "CPU of all nodes per message µs",
    ];
    for (w, (name, _, _)) in WORKLOADS.iter().enumerate() {
        for (m, measure) in measures.iter().enumerate() {
            write!(t, "| {name} | {measure} |")?;
            let value = |o: &Outcome| {
                o.rates
                    .get(w)
                    .copied()
                    .flatten()
                    .map(|r| r[m])
                    .filter(|v| v.is_finite())
            };
            for o in outcomes {
                match value(o) {
                    Some(v) if m == 4 => write!(t, " {v:.1} |")?,
                    Some(v) => write!(t, " {} |", thousands(v))?,
                    None => write!(t, " – |")?,
                }
            }
            if let Some(r) = rabbit {
                for o in &warrens {
                    match (value(o), value(r)) {
                        (Some(a), Some(b)) if m < 2 => write!(t, " {:.2}× |", a / b.max(1.0))?,
                        // CPU: how many times less Warren spends.
                        (Some(a), Some(b)) if m == 4 => {
                            write!(t, " {:.2}× less |", b / a.max(0.001))?
                        }
                        _ => write!(t, " |")?,
                    }
                }
            }
            writeln!(t)?;
        }
    }
    lapin_table(&mut t, outcomes, opts.duration)?;
    if opts.stalls {
        stall_table(&mut t, outcomes, opts.mirrors())?;
    } else {
        writeln!(t, "\nPublisher stalls not measured (--no-stalls).")?;
    }
    let notes: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.note.is_empty())
        .map(|o| format!("- {}: {}", o.broker, o.note))
        .chain((!rabbit_note.is_empty()).then(|| format!("- {rabbit_note}")))
        .collect();
    if !notes.is_empty() {
        writeln!(t, "\n{}", notes.join("\n"))?;
    }
    Ok(t)
}

/// The lapin table: one row per lapin workload and broker, then each
/// Warren transport's ratios to RabbitMQ.
fn lapin_table(t: &mut String, outcomes: &[Outcome], duration: u64) -> anyhow::Result<()> {
    writeln!(
        t,
        "\nlapin rows (`lapin_perf`, on lapin, a standard client: each publish and each ack its own frame): {duration} s each, no warm-up, on a fresh durable queue declared through node 1 (its master) and synchronised; clients on node 1 unless the row says otherwise; confirms in flight are per producer, --rate per producer. Rates per second over the run; latencies in ms; the backlog is what was published and not consumed when the run ended (no drain); CPU is all nodes' CPU over the whole run per consumed message.\n"
    )?;
    writeln!(
        t,
        "| workload | broker | published/s | confirmed/s | consumed/s | e2e p50 ms | e2e p99 ms | confirm p50 ms | confirm p99 ms | backlog | CPU of all nodes per message µs |"
    )?;
    writeln!(t, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let lapin = |o: &Outcome, w: usize| o.lapin.get(w).copied().flatten();
    for (w, workload) in CLIENT_WORKLOADS.iter().enumerate() {
        for o in outcomes {
            write!(t, "| {} | {} |", workload.name, o.broker)?;
            let Some(r) = lapin(o, w) else {
                writeln!(t, "{}", " – |".repeat(9))?;
                continue;
            };
            for (m, v) in r.iter().enumerate() {
                match m {
                    _ if !v.is_finite() => write!(t, " – |")?,
                    3..=6 => write!(t, " {} |", millis(*v))?,
                    8 => write!(t, " {v:.1} |")?,
                    _ => write!(t, " {} |", thousands(*v))?,
                }
            }
            writeln!(t)?;
        }
    }
    let Some(rabbit) = outcomes.iter().find(|o| o.broker.starts_with("RabbitMQ")) else {
        return Ok(());
    };
    let short = rabbit.broker.trim_end_matches(" mirrored");
    writeln!(t)?;
    for (w, workload) in CLIENT_WORKLOADS.iter().enumerate() {
        for o in outcomes.iter().filter(|o| o.broker.starts_with("Warren")) {
            let (Some(a), Some(b)) = (lapin(o, w), lapin(rabbit, w)) else {
                continue;
            };
            write!(
                t,
                "- {}: {} / {short} consumed/s = {:.2}×",
                workload.name,
                o.broker,
                a[2] / b[2].max(1.0)
            )?;
            if a[8].is_finite() && b[8].is_finite() {
                write!(
                    t,
                    "; CPU per message {short} / {} = {:.2}×",
                    o.broker,
                    b[8] / a[8].max(0.001)
                )?;
            }
            writeln!(t)?;
        }
    }
    Ok(())
}

/// Milliseconds with two significant decimals below 10 ms: 0.42, 12.3, 1,234.
fn millis(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        thousands(v)
    }
}

/// The publisher stalls table: one row per stall and broker.
fn stall_table(t: &mut String, outcomes: &[Outcome], mirrors: usize) -> anyhow::Result<()> {
    writeln!(
        t,
        "\nPublisher stalls: a producer on node 2 publishes 1 KiB persistent messages with 100 confirms in flight to a mirrored queue ({mirrors} synchronised mirrors); after 2 s a node is SIGKILLed; measured over the next {} s, each on a fresh cluster. Only acks count as confirms here: a nack tells the publisher to send again.\n",
        AFTER_KILL.as_secs()
    )?;
    writeln!(
        t,
        "| when | broker | longest pause in acks after the SIGKILL | pause began after | first ack of a publish made after the SIGKILL | acks in the {} s after | nacks |",
        AFTER_KILL.as_secs()
    )?;
    writeln!(t, "|---|---|---:|---:|---:|---:|---:|")?;
    for (k, (what, ..)) in STALLS.iter().enumerate() {
        for o in outcomes {
            match o.stalls.get(k).and_then(Option::as_ref) {
                Some(s) => writeln!(
                    t,
                    "| {what} | {} | {}{} | {} | {} | {} | {} |",
                    o.broker,
                    ms(s.longest_gap),
                    match (&s.error, s.stuck) {
                        (Some(e), _) => format!(" (the publisher failed: {e})"),
                        (None, true) => " (confirms still outstanding 10 s later)".to_owned(),
                        (None, false) => String::new(),
                    },
                    ms(s.gap_start),
                    s.first_new_confirm.map_or("none".to_owned(), ms),
                    thousands(s.confirms_after as f64),
                    s.nacks
                )?,
                None => writeln!(t, "| {what} | {} | – | – | – | – | – |", o.broker)?,
            }
        }
    }
    Ok(())
}

/// 12345.6 → "12,346".
fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Publisher and consumer connections of the many-queues load.
const LOAD_CONNECTIONS: usize = 4;

/// What the many-queues load generator reported for its measured window.
struct LoadResult {
    secs: f64,
    confirmed: f64,
    consumed: f64,
    nacked: u64,
    p50_ms: f64,
    p99_ms: f64,
}

impl LoadResult {
    /// Parses `result secs=… confirmed=… consumed=… nacked=… p50_ms=… p99_ms=…`.
    fn parse(line: &str) -> anyhow::Result<Self> {
        let field = |k: &str| crate::bench::result_field(line, k);
        Ok(Self {
            secs: field("secs")?,
            confirmed: field("confirmed")?,
            consumed: field("consumed")?,
            nacked: field("nacked")? as u64,
            p50_ms: field("p50_ms")?,
            p99_ms: field("p99_ms")?,
        })
    }
}

/// Seconds the many-queues bench measures the nodes with their queues and no
/// traffic.
const IDLE_SECS: u64 = 5;

/// What one node used during the many-queues run.
struct NodeUsage {
    name: String,
    /// CPU seconds per second while measuring.
    cpu: f64,
    /// CPU seconds per second with the queues declared and no traffic.
    idle_cpu: f64,
    /// Seconds per second the node's broker lock was held while measuring
    /// (`warren_broker_lock_held_seconds_total`; wall clock).
    lock: f64,
    /// RSS (KiB): idle before the queues, with the queues before the load, at the end.
    rss: [u64; 3],
}

/// `bench many-queues [--queues N] [--rate R] [--duration S] [--transport tcp|quic]`.
pub(crate) fn many_queues(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let n = number(rest, "--queues", 1000)?.max(1) as usize;
    let rate = number(rest, "--rate", 10)?.max(1) as f64;
    let duration = number(rest, "--duration", 30)?.max(1);
    let transport = flag(rest, "--transport").unwrap_or("tcp");
    if !["tcp", "quic"].contains(&transport) {
        bail!("--transport must be tcp or quic");
    }
    build()?;
    let out_dir = crate::bench::target_dir(root).join("bench-mirrored");
    let dir = out_dir.join(format!("many-queues-{transport}"));
    println!(
        "==> Warren {}: starting 3 nodes on 127.0.0.1 ({})",
        transport.to_uppercase(),
        dir.display()
    );
    let nodes = warren_cluster(root, &dir, transport, 3)?;
    let rt = runtime()?;
    std::thread::sleep(Duration::from_secs(2));
    let idle: Vec<(u64, u64)> = nodes
        .iter()
        .map(|n| crate::cpu::usage(n.pid()))
        .collect::<Result<_, _>>()?;

    let names: Vec<String> = (0..n).map(|i| format!("ha.q{i}")).collect();
    println!(
        "    declaring {n} durable queues ha.q0…ha.q{} on {}…",
        n - 1,
        nodes[0].name
    );
    let t = Instant::now();
    rt.block_on(declare(&nodes[0].url(), &names, 8))?;
    println!(
        "    declared in {:.1} s; waiting for 2 synchronised mirrors each…",
        t.elapsed().as_secs_f64()
    );
    let mut last_print = Instant::now();
    let synced_count = || -> anyhow::Result<usize> {
        Ok(http_json(&nodes[0].http, "/api/queues/%2F")?
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter(|q| {
                q["name"].as_str().is_some_and(|s| s.starts_with("ha.q"))
                    && list_len(q, "synchronised_slave_nodes") == 2
            })
            .count())
    };
    let synced = eventually("every queue synchronised", Duration::from_secs(120), || {
        let c = synced_count()?;
        if last_print.elapsed() > Duration::from_secs(5) {
            println!("      {c}/{n} synchronised");
            last_print = Instant::now();
        }
        Ok(c == n)
    });
    let sync_note = match synced {
        Ok(took) => format!(
            "all {n} queues had 2 synchronised mirrors {:.1} s after the declares",
            took.as_secs_f64()
        ),
        Err(_) => format!(
            "only {}/{n} queues had 2 synchronised mirrors 120 s after the declares (ran anyway)",
            synced_count().unwrap_or(0)
        ),
    };
    println!("    {sync_note}");
    // What the queues cost with no traffic: rings, detectors and ticks
    // should not grow with the number of queues.
    println!("    {IDLE_SECS} s with the queues and no traffic (after {IDLE_SECS} s to settle)…");
    std::thread::sleep(Duration::from_secs(IDLE_SECS));
    let quiet: Vec<(u64, u64)> = nodes
        .iter()
        .map(|n| crate::cpu::usage(n.pid()))
        .collect::<Result<_, _>>()?;
    let t_quiet = Instant::now();
    std::thread::sleep(Duration::from_secs(IDLE_SECS));
    let loaded: Vec<(u64, u64)> = nodes
        .iter()
        .map(|n| crate::cpu::usage(n.pid()))
        .collect::<Result<_, _>>()?;
    let quiet_secs = t_quiet.elapsed().as_secs_f64();

    println!(
        "    load: {n} queues × {rate} msg/s = {} msg/s, persistent 64 B with confirms, consumed with acks; 3 s warm-up, then {duration} s…",
        thousands(rate * n as f64)
    );
    let url = nodes[0].url();
    let mut child = Command::new(release_dir(root).join("examples/many_queues_load"))
        .args([
            "--url",
            &url,
            "--queues",
            &n.to_string(),
            "--prefix",
            "ha.q",
        ])
        .args(["--rate", &rate.to_string(), "--warmup", "3"])
        .args(["--duration", &duration.to_string()])
        .args(["--connections", &LOAD_CONNECTIONS.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .context("running many_queues_load")?;
    let stdout = child.stdout.take().context("many_queues_load stdout")?;
    let cpu_now = || -> anyhow::Result<Vec<u64>> {
        nodes
            .iter()
            .map(|n| crate::cpu::usage(n.pid()).map(|u| u.0))
            .collect()
    };
    let lock_now = || -> anyhow::Result<Vec<f64>> {
        nodes
            .iter()
            .map(|n| {
                metric(&n.metrics, "warren_broker_lock_held_seconds_total")?
                    .context("no warren_broker_lock_held_seconds_total")
            })
            .collect()
    };
    let (mut before, mut after, mut result) = (None, None, None);
    let (mut lock_before, mut lock_after) = (Vec::new(), Vec::new());
    let mut own = [0u64; 2];
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        match line.as_str() {
            "measuring" => {
                lock_before = lock_now()?;
                before = Some(cpu_now()?);
                own[0] = crate::cpu::usage(child.id())?.0;
            }
            "done" => {
                after = Some(cpu_now()?);
                lock_after = lock_now()?;
                own[1] = crate::cpu::usage(child.id())?.0;
            }
            l if l.starts_with("result ") => result = Some(LoadResult::parse(l)?),
            l => println!("      {l}"),
        }
    }
    let status = child.wait()?;
    let (Some(before), Some(after), Some(r)) = (before, after, result) else {
        bail!("the load generator ended ({status}) without a measured result");
    };
    let end: Vec<(u64, u64)> = nodes
        .iter()
        .map(|n| crate::cpu::usage(n.pid()))
        .collect::<Result<_, _>>()?;
    let hz = crate::cpu::clock_ticks();
    let secs = r.secs;
    let usages: Vec<NodeUsage> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| NodeUsage {
            name: node.name.clone(),
            cpu: (after[i] - before[i]) as f64 / hz / secs,
            idle_cpu: (loaded[i].0 - quiet[i].0) as f64 / hz / quiet_secs,
            lock: (lock_after[i] - lock_before[i]) / secs,
            rss: [idle[i].1, loaded[i].1, end[i].1],
        })
        .collect();
    let own_cpu = own[1].saturating_sub(own[0]);
    let pct = |ms: f64| {
        if ms.is_nan() {
            "–".to_owned()
        } else {
            format!("{ms:.1}")
        }
    };
    let target = rate * n as f64;
    let published = r.confirmed / secs;
    let consumed = r.consumed / secs;
    let nacked = r.nacked;
    let held = published >= 0.95 * target && consumed >= 0.95 * target;

    let mut t = String::new();
    writeln!(
        t,
        "{n} durable queues ha.q0… mirrored to all 3 Warren nodes ({} between nodes, 127.0.0.1), {rate} msg/s each: persistent 64 B messages with confirms, {LOAD_CONNECTIONS} publisher and {LOAD_CONNECTIONS} consumer connections (acks, prefetch 50) on {}, measured over {secs:.1} s after 3 s of warm-up; {sync_note}.\n",
        transport.to_uppercase(),
        nodes[0].name
    )?;
    writeln!(
        t,
        "| target msg/s | confirmed msg/s | consumed msg/s | held the rate | nacks | confirm p50 ms | confirm p99 ms |"
    )?;
    writeln!(t, "|---:|---:|---:|---|---:|---:|---:|")?;
    writeln!(
        t,
        "| {} | {} ({:.0} %) | {} ({:.0} %) | {} | {nacked} | {} | {} |\n",
        thousands(target),
        thousands(published),
        100.0 * published / target,
        thousands(consumed),
        100.0 * consumed / target,
        if held { "yes" } else { "no" },
        pct(r.p50_ms),
        pct(r.p99_ms)
    )?;
    writeln!(
        t,
        "| node | CPU (% of one core) | broker lock held (% of the time) | CPU per queue (µs/s) | CPU with the queues, no traffic (% of one core) | RSS idle MiB | RSS with queues MiB | RSS at end MiB | RSS per queue KiB |"
    )?;
    writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for u in &usages {
        writeln!(
            t,
            "| {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} | {:.1} |",
            u.name,
            u.cpu * 100.0,
            u.lock * 100.0,
            u.cpu * 1e6 / n as f64,
            u.idle_cpu * 100.0,
            u.rss[0] as f64 / 1024.0,
            u.rss[1] as f64 / 1024.0,
            u.rss[2] as f64 / 1024.0,
            u.rss[2].saturating_sub(u.rss[0]) as f64 / n as f64
        )?;
    }
    writeln!(
        t,
        "\nThe load generator (`crates/node/examples/many_queues_load.rs`, a release build, on the same machine) used {:.0} % of one core.",
        own_cpu as f64 / hz / secs * 100.0
    )?;
    writeln!(
        t,
        "Broker lock held: the share of the measured time during which the node's one broker lock was held (`warren_broker_lock_held_seconds_total`, wall clock: a holder waiting for a CPU still holds it). Beside the CPU column: how much of the node's work is serialised behind that lock."
    )?;
    drop(nodes);
    let out = out_dir.join("many-queues.md");
    std::fs::write(&out, &t)?;
    println!("\n{t}\n(written to {})", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(broker: &str, consumed: &[Option<f64>]) -> Outcome {
        Outcome {
            broker: broker.to_owned(),
            rates: consumed
                .iter()
                .map(|c| c.map(|c| [c, c, 1.0, 2.0, f64::NAN]))
                .collect(),
            lapin: consumed
                .iter()
                .map(|c| c.map(|c| [c, c, c, 0.5, 20.0, 1.0, 40.0, 7.0, 3.0]))
                .chain([None; CLIENT_WORKLOADS.len() - 2])
                .collect(),
            stalls: Vec::new(),
            note: String::new(),
        }
    }

    #[test]
    fn rounds_report_medians_and_each_rounds_ratio() {
        let rounds = vec![
            vec![
                outcome("Warren TCP", &[Some(300.0), Some(900.0)]),
                outcome("RabbitMQ 3.10.8 mirrored", &[Some(100.0), Some(100.0)]),
            ],
            vec![
                outcome("Warren TCP", &[Some(500.0), None]),
                outcome("RabbitMQ 3.10.8 mirrored", &[Some(100.0), Some(300.0)]),
            ],
            vec![
                outcome("Warren TCP", &[Some(400.0), Some(1000.0)]),
                outcome("RabbitMQ 3.10.8 mirrored", &[Some(50.0), Some(200.0)]),
            ],
        ];
        let m = medians(&rounds);
        assert_eq!(m.len(), 2);
        let consumed = |o: &Outcome, w: usize| o.rates[w].map(|r| r[1]);
        assert_eq!(consumed(&m[0], 0), Some(400.0));
        // A failed run is left out of the median, not counted as zero.
        assert_eq!(consumed(&m[0], 1), Some(950.0));
        assert_eq!(consumed(&m[1], 0), Some(100.0));
        assert!(m[0].rates[0].is_some_and(|r| r[4].is_nan()));
        let ratios = round_ratios(&rounds).expect("ratios");
        assert!(ratios.contains(": 3.00×, 5.00×, 8.00×"), "{ratios}");
        assert!(ratios.contains(": 9.00×, –, 5.00×"), "{ratios}");
        // The lapin rows too.
        assert_eq!(m[0].lapin[1].map(|r| r[2]), Some(950.0));
        let first = format!(
            "- {}, Warren TCP: 3.00×, 5.00×, 8.00×",
            CLIENT_WORKLOADS[0].name
        );
        assert!(ratios.contains(&first), "{ratios}");
        let none = format!("- {}, Warren TCP: –, –, –", CLIENT_WORKLOADS[2].name);
        assert!(ratios.contains(&none), "{ratios}");
    }

    #[test]
    fn lapin_table_gives_every_figure_and_the_ratios_to_rabbitmq() {
        let mut warren = outcome("Warren TCP", &[Some(3000.0), None]);
        if let Some(r) = warren.lapin[0].as_mut() {
            r[5] = f64::NAN;
            r[4] = 1234.0;
        }
        let rabbit = outcome("RabbitMQ 3.10.8 mirrored", &[Some(1000.0), Some(500.0)]);
        let mut t = String::new();
        lapin_table(&mut t, &[warren, rabbit], 3).expect("table");
        let name = CLIENT_WORKLOADS[0].name;
        assert!(
            t.contains(&format!(
                "| {name} | Warren TCP | 3,000 | 3,000 | 3,000 | 0.50 | 1,234 | – | 40.0 | 7 | 3.0 |"
            )),
            "{t}"
        );
        let failed = format!(
            "| {} | Warren TCP | – | – | – | – | – | – | – | – | – |",
            CLIENT_WORKLOADS[1].name
        );
        assert!(t.contains(&failed), "{t}");
        assert!(
            t.contains(&format!(
                "- {name}: Warren TCP / RabbitMQ 3.10.8 consumed/s = 3.00×; CPU per message RabbitMQ 3.10.8 / Warren TCP = 1.00×"
            )),
            "{t}"
        );
        // No ratio where either side failed.
        assert!(
            !t.contains(&format!("- {}:", CLIENT_WORKLOADS[1].name)),
            "{t}"
        );
    }
}
