//! `cargo xtask scenario N|all`: the six recovery scenarios of a two-node
//! mirrored queue from the seed article (section 2.5), run against real
//! `warren` processes on 127.0.0.1.
//!
//! Every scenario forms a cluster of `warren@a` (A) and `warren@b` (B), sets
//! the policy `ha-all` (`ha-mode: all`, `ha-sync-mode: automatic`), declares
//! the durable queue `ha.seed` on A, publishes persistent messages with
//! confirms (remembering which were confirmed), stops, kills and starts the
//! nodes as the scenario says, then consumes the queue and compares what it
//! got with what was confirmed. Data directories and node logs
//! (`RUST_LOG=info`, one `<node>.log` per node) are in
//! `target/scenarios/N/`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::{Value, json};

use crate::chaos::netns::exec_in;
use crate::node::{NodeArgs, ready_signal};

/// The mirrored queue every scenario uses.
const QUEUE: &str = "ha.seed";
/// Messages per publishing round.
const BATCH: usize = 100;
/// `--boot-wait` of every node: how long a restarted node waits for the other.
const BOOT_WAIT_SECS: u64 = 60;
/// How long a poll of the management API waits for a condition.
const POLL: Duration = Duration::from_secs(45);
/// `guest:guest` in HTTP basic authentication.
const AUTH: &str = "Basic Z3Vlc3Q6Z3Vlc3Q=";

/// The `warren` and `warrenctl` binaries a run uses.
pub(crate) struct Bins {
    /// The node binary.
    pub(crate) warren: PathBuf,
    /// The control tool.
    pub(crate) ctl: PathBuf,
}

impl Bins {
    /// Builds both (debug profile) into the target directory `target` and
    /// returns their paths there.
    pub(crate) fn build(root: &Path, target: &Path) -> anyhow::Result<Self> {
        let status = crate::cargo()
            .args(["build", "-p", "warren-node", "-p", "warren-ctl", "--bins"])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(root)
            .status()
            .context("running cargo build")?;
        if !status.success() {
            bail!("building warren and warrenctl failed ({status})");
        }
        Ok(Self {
            warren: target.join("debug/warren"),
            ctl: target.join("debug/warrenctl"),
        })
    }
}

/// What one scenario run found.
#[derive(Debug)]
pub(crate) struct Report {
    /// The scenario's number (1–6).
    pub(crate) scenario: u32,
    /// Whether the scenario's claim held.
    pub(crate) pass: bool,
    /// Messages confirmed by the broker.
    pub(crate) confirmed: usize,
    /// Confirmed messages that had to come back, and did (once or more).
    pub(crate) recovered: usize,
    /// Confirmed messages that had to come back and did not.
    pub(crate) lost: usize,
    /// Confirmed messages the scenario says are lost (scenarios 4 and 6),
    /// and were.
    pub(crate) expected_lost: usize,
    /// Deliveries beyond the first of a message.
    pub(crate) duplicated: usize,
    /// What the run observed, in words.
    pub(crate) notes: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "scenario {}: {} (confirmed {}, recovered {}, lost {}, expected lost {}, duplicated {})",
            self.scenario,
            if self.pass { "PASS" } else { "FAIL" },
            self.confirmed,
            self.recovered,
            self.lost,
            self.expected_lost,
            self.duplicated
        )?;
        for n in &self.notes {
            write!(f, "\n    {n}")?;
        }
        Ok(())
    }
}

/// Runs `cargo xtask scenario N|all`.
pub(crate) fn main(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let which: Vec<u32> = match rest {
        ["all"] => (1..=6).collect(),
        [n] => match n.parse() {
            Ok(n @ 1..=6) => vec![n],
            _ => bail!("usage: cargo xtask scenario 1..6|all"),
        },
        _ => bail!("usage: cargo xtask scenario 1..6|all"),
    };
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |t| root.join(t));
    println!("building warren and warrenctl (debug)…");
    let bins = Bins::build(root, &target)?;
    let mut reports = Vec::new();
    for n in which {
        let work = root.join("target/scenarios").join(n.to_string());
        let report = run(n, &bins, &work).unwrap_or_else(|e| Report {
            scenario: n,
            pass: false,
            confirmed: 0,
            recovered: 0,
            lost: 0,
            expected_lost: 0,
            duplicated: 0,
            notes: vec![format!("error: {e:#} (logs in {})", work.display())],
        });
        println!("{report}");
        reports.push(report);
    }
    println!("== summary");
    for r in &reports {
        println!("{r}");
    }
    if reports.iter().any(|r| !r.pass) {
        bail!("some scenarios failed");
    }
    Ok(())
}

/// Runs scenario `n` (1–6) with `bins`, its data directories and logs under
/// `work` (emptied first).
pub(crate) fn run(n: u32, bins: &Bins, work: &Path) -> anyhow::Result<Report> {
    if work.exists() {
        std::fs::remove_dir_all(work).with_context(|| format!("emptying {}", work.display()))?;
    }
    std::fs::create_dir_all(work)?;
    let secret = work.join("secret");
    std::fs::write(&secret, format!("scenario-{n}-secret\n"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut s = Scenario {
        n,
        bins,
        work,
        secret,
        rt,
        confirmed: BTreeSet::new(),
        notes: Vec::new(),
        // Consecutive runs start at different ports.
        next_port: u16::try_from(std::process::id() % 500)?,
    };
    let result = match n {
        1 => s.one(),
        2 => s.two(),
        3 => s.three(),
        4 => s.four(),
        5 => s.five(),
        6 => s.six(),
        _ => bail!("there are six scenarios"),
    };
    // A step that failed fails the scenario, with what was confirmed so far.
    Ok(result.unwrap_or_else(|e| {
        let mut notes = std::mem::take(&mut s.notes);
        notes.push(format!("error: {e:#} (logs in {})", work.display()));
        Report {
            scenario: n,
            pass: false,
            confirmed: s.confirmed.len(),
            recovered: 0,
            lost: 0,
            expected_lost: 0,
            duplicated: 0,
            notes,
        }
    }))
}

/// Where a node listens and keeps its data; kept across restarts.
#[derive(Clone)]
pub(crate) struct Spec {
    /// The node name (`warren@…`).
    pub(crate) name: String,
    /// The data directory.
    pub(crate) dir: PathBuf,
    /// The log file (the node's stderr).
    pub(crate) log: PathBuf,
    /// The AMQP port.
    pub(crate) amqp: u16,
    /// The management API port.
    pub(crate) http: u16,
    /// The Prometheus port.
    pub(crate) metrics: u16,
    /// The peer (cluster) port.
    pub(crate) peer: u16,
    /// The node's own loopback address: every listener binds it, and so do
    /// its outgoing peer connections.
    pub(crate) ip: String,
    /// The network namespace the node runs in (`ip netns exec`), if any.
    pub(crate) netns: Option<String>,
}

impl Spec {
    pub(crate) fn http_addr(&self) -> String {
        format!("{}:{}", self.ip, self.http)
    }

    pub(crate) fn peer_addr(&self) -> String {
        format!("{}:{}", self.ip, self.peer)
    }

    /// The AMQP URL of the node as guest, default vhost.
    pub(crate) fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}:{}/%2f", self.ip, self.amqp)
    }
}

/// A started process that has not printed its ready line yet.
pub(crate) struct Pending {
    spec: Spec,
    child: Option<Child>,
    ready: mpsc::Receiver<()>,
}

/// A node that printed its ready line.
pub(crate) struct Node {
    /// Where it listens.
    pub(crate) spec: Spec,
    child: Option<Child>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Pending {
    /// Waits for the ready line (the boot wait plus half a minute at most).
    pub(crate) fn ready(mut self) -> anyhow::Result<Node> {
        let limit = Duration::from_secs(BOOT_WAIT_SECS + 30);
        let deadline = Instant::now() + limit;
        loop {
            match self.ready.recv_timeout(Duration::from_millis(200)) {
                Ok(()) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = match &mut self.child {
                        Some(c) => c.wait()?,
                        None => bail!("{} has no process", self.spec.name),
                    };
                    bail!(
                        "{} exited before it was ready ({status}); log {}:\n{}",
                        self.spec.name,
                        self.spec.log.display(),
                        tail(&self.spec.log)
                    );
                }
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() > deadline => {
                    bail!(
                        "{} not ready within {limit:?}; log {}:\n{}",
                        self.spec.name,
                        self.spec.log.display(),
                        tail(&self.spec.log)
                    );
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
        Ok(Node {
            spec: self.spec.clone(),
            child: self.child.take(),
        })
    }
}

impl Node {
    /// SIGTERM, then waits (a minute at most) for the exit.
    pub(crate) fn stop(mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM {} failed", child.id());
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    bail!("{} exited with {status} on SIGTERM", self.spec.name);
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{} did not exit within 60 s of SIGTERM", self.spec.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL (like a power loss).
    pub(crate) fn kill(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One management API call as guest: the status and the JSON body
    /// (`Null` when there is none).
    pub(crate) fn http(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(30))
            .build();
        let req = agent
            .request(method, &format!("http://{}{path}", self.spec.http_addr()))
            .set("Authorization", AUTH);
        let r = match body {
            Some(b) => req
                .set("Content-Type", "application/json")
                .send_string(&b.to_string()),
            None => req.call(),
        };
        let resp = match r {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => bail!("{method} {path} on {}: {e}", self.spec.name),
        };
        let status = resp.status();
        let text = resp.into_string()?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    /// The queue as `GET /api/queues/%2F/ha.seed` shows it (`Null` if absent).
    fn queue(&self) -> Value {
        match self.http("GET", &format!("/api/queues/%2F/{QUEUE}"), None) {
            Ok((200, v)) => v,
            _ => Value::Null,
        }
    }

    /// Polls the queue on this node until `check` holds.
    fn wait_queue(&self, what: &str, check: impl Fn(&Value) -> bool) -> anyhow::Result<Value> {
        let deadline = Instant::now() + POLL;
        loop {
            let q = self.queue();
            if check(&q) {
                return Ok(q);
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out after {POLL:?} waiting for {what} on {}; the queue: {q}",
                    self.spec.name
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The process id (`None` once it was stopped or killed).
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(crate) fn amqp_url(&self) -> String {
        self.spec.amqp_url()
    }
}

/// The last lines of a log file.
pub(crate) fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// The names in the array `key` of a queue's JSON.
pub(crate) fn names(q: &Value, key: &str) -> Vec<String> {
    q.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect()
}

/// Starts a `warren` process for `spec` (joining `join` on its first
/// start) with the cluster secret in `secret`, its stderr appended to
/// `spec.log` after a header naming `label`; does not wait for it.
pub(crate) fn spawn(
    bins: &Bins,
    secret: &Path,
    label: &str,
    spec: &Spec,
    join: Option<&Spec>,
) -> anyhow::Result<Pending> {
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)?;
    writeln!(log, "==== xtask {}: starting {}", label, spec.name)?;
    let mut cmd = exec_in(spec.netns.as_deref(), &bins.warren);
    NodeArgs {
        name: &spec.name,
        amqp: format!("{}:{}", spec.ip, spec.amqp),
        http: spec.http_addr(),
        metrics: format!("{}:{}", spec.ip, spec.metrics),
        peer: spec.peer_addr(),
        transport: None,
        secret,
        data: &spec.dir,
        ca_dir: None,
        join: join.map(Spec::peer_addr),
    }
    .apply(&mut cmd);
    cmd.args(["--boot-wait", &BOOT_WAIT_SECS.to_string()])
        .env(
            "RUST_LOG",
            std::env::var("WARREN_NODE_LOG").unwrap_or_else(|_| "info,openraft=warn".to_owned()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bins.warren.display()))?;
    let stdout = child.stdout.take().context("the node's stdout")?;
    Ok(Pending {
        spec: spec.clone(),
        child: Some(child),
        ready: ready_signal(stdout),
    })
}

/// One run's state: the cluster's secret, the runtime driving lapin, and
/// every message confirmed so far.
struct Scenario<'a> {
    n: u32,
    bins: &'a Bins,
    work: &'a Path,
    secret: PathBuf,
    rt: tokio::runtime::Runtime,
    confirmed: BTreeSet<String>,
    notes: Vec<String>,
    /// The next port to try, as an offset in this scenario's port range.
    next_port: u16,
}

impl Scenario<'_> {
    fn say(&self, what: &str) {
        println!("[scenario {}] {what}", self.n);
    }

    /// A port on 127.0.0.1 that is free now, from this scenario's own range
    /// (10000 + 1000 N … + 999, below the kernel's ephemeral ports): a
    /// stopped node's ports stay free for its restart even while other
    /// scenarios (or outgoing connections) pick ports at the same time.
    fn free_port(&mut self) -> anyhow::Result<u16> {
        let base = 10_000 + 1_000 * u16::try_from(self.n)?;
        for _ in 0..1_000 {
            let port = base + self.next_port % 1_000;
            self.next_port = self.next_port.wrapping_add(1);
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
        bail!("no free port in {base}..{}", base + 999)
    }

    /// A node's name, data directory and fresh ports.
    fn spec(&mut self, short: &str) -> anyhow::Result<Spec> {
        Ok(Spec {
            name: format!("warren@{short}"),
            dir: self.work.join(short),
            log: self.work.join(format!("{short}.log")),
            amqp: self.free_port()?,
            http: self.free_port()?,
            metrics: self.free_port()?,
            peer: self.free_port()?,
            ip: "127.0.0.1".to_owned(),
            netns: None,
        })
    }

    /// Starts `spec` (joining `join` on its first start) without waiting.
    fn spawn(&self, spec: &Spec, join: Option<&Spec>) -> anyhow::Result<Pending> {
        let pending = spawn(
            self.bins,
            &self.secret,
            &format!("scenario {}", self.n),
            spec,
            join,
        )?;
        if let Some(c) = &pending.child {
            self.say(&format!("started {} (pid {})", spec.name, c.id()));
        }
        Ok(pending)
    }

    /// Starts `spec` and waits until it is ready.
    fn start(&self, spec: &Spec, join: Option<&Spec>) -> anyhow::Result<Node> {
        let node = self.spawn(spec, join)?.ready()?;
        self.say(&format!("{} is ready", spec.name));
        Ok(node)
    }

    fn stop(&self, node: Node) -> anyhow::Result<()> {
        let name = node.spec.name.clone();
        node.stop()?;
        self.say(&format!("{name} stopped (SIGTERM)"));
        Ok(())
    }

    /// A and B clustered, the policy set, `ha.seed` declared on A and
    /// mirrored, synchronised, on B.
    fn pair(&mut self) -> anyhow::Result<(Spec, Node, Spec, Node)> {
        let (sa, sb) = (self.spec("a")?, self.spec("b")?);
        let a = self.start(&sa, None)?;
        let b = self.start(&sb, Some(&sa))?;
        let (status, v) = a.http(
            "PUT",
            "/api/policies/%2F/ha-all",
            Some(&json!({
                "pattern": "^ha\\.",
                "apply-to": "queues",
                "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
            })),
        )?;
        if status != 201 && status != 204 {
            bail!("setting the policy ha-all: {status} {v}");
        }
        self.say("policy ha-all set (ha-mode all, ha-sync-mode automatic)");
        self.rt.block_on(async {
            let conn = Connection::connect(&a.amqp_url(), ConnectionProperties::default()).await?;
            let ch = conn.create_channel().await?;
            let opts = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            ch.queue_declare(QUEUE.into(), opts, FieldTable::default())
                .await?;
            let _ = conn.close(200, "bye".into()).await;
            anyhow::Ok(())
        })?;
        a.wait_queue("B as a synchronised mirror", |q| {
            q["node"] == "warren@a" && names(q, "synchronised_slave_nodes").contains(&sb.name)
        })?;
        self.say("ha.seed declared on A, master A, synchronised mirror on B");
        Ok((sa, a, sb, b))
    }

    /// Publishes `BATCH` persistent messages tagged `tag` through `node`,
    /// republishing the unconfirmed ones (with new bodies) until all are
    /// confirmed or ten rounds have passed; returns the confirmed bodies.
    fn publish(&mut self, node: &Node, tag: &str) -> anyhow::Result<BTreeSet<String>> {
        let mut acked = BTreeSet::new();
        let mut wanted: Vec<usize> = (0..BATCH).collect();
        for round in 0..10 {
            let bodies: Vec<(usize, String)> = wanted
                .iter()
                .map(|i| (*i, format!("s{}-{tag}-m{i}-r{round}", self.n)))
                .collect();
            let got = self
                .rt
                .block_on(publish_confirmed(&node.amqp_url(), &bodies));
            let ok: BTreeSet<usize> = match got {
                Ok(ok) => ok,
                Err(e) => {
                    self.say(&format!("publishing through {}: {e:#}", node.spec.name));
                    BTreeSet::new()
                }
            };
            for (i, b) in &bodies {
                if ok.contains(i) {
                    acked.insert(b.clone());
                }
            }
            wanted.retain(|i| !ok.contains(i));
            if wanted.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        self.say(&format!(
            "published {BATCH} persistent messages ({tag}) through {}: {} confirmed",
            node.spec.name,
            acked.len()
        ));
        if acked.len() < BATCH {
            self.notes.push(format!(
                "{} of {BATCH} publishes ({tag}) never confirmed",
                BATCH - acked.len()
            ));
        }
        self.confirmed.extend(acked.iter().cloned());
        Ok(acked)
    }

    /// Consumes the queue through `node` (acking) and compares it with
    /// `must` (confirmed messages that must come back) and `may_be_lost`
    /// (confirmed messages the scenario says are lost); returns the report.
    fn check(
        &mut self,
        node: &Node,
        must: &BTreeSet<String>,
        may_be_lost: &BTreeSet<String>,
    ) -> anyhow::Result<Report> {
        let want = must.len();
        // Give recovery a moment: the queue exists with everything it must hold.
        if let Err(e) = node.wait_queue("the queue to hold every confirmed message", |q| {
            q["messages"].as_u64().is_some_and(|m| m >= want as u64)
        }) {
            self.say(&format!("{e:#}"));
            self.notes.push(format!(
                "after recovery, GET /api/queues/%2F/{QUEUE} on {}: messages {}, master {}",
                node.spec.name,
                node.queue()["messages"],
                node.queue()["node"]
            ));
        }
        let q = node.queue();
        self.say(&format!(
            "before consuming, {} reports: messages {}, master {}, synchronised mirrors {:?}",
            node.spec.name,
            q["messages"],
            q["node"],
            names(&q, "synchronised_slave_nodes")
        ));
        let seen = self.rt.block_on(consume_all(&node.amqp_url(), must))?;
        let mut count: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &seen {
            *count.entry(s.as_str()).or_default() += 1;
        }
        let lost = must
            .iter()
            .filter(|m| !count.contains_key(m.as_str()))
            .count();
        let expected_lost = may_be_lost
            .iter()
            .filter(|m| !count.contains_key(m.as_str()))
            .count();
        let duplicated = count.values().map(|c| c - 1).sum();
        let unconfirmed = count
            .keys()
            .filter(|k| !self.confirmed.contains(**k))
            .count();
        self.say(&format!(
            "consumed {} deliveries through {}: {} of {} confirmed messages that must survive, lost {lost}, duplicated {duplicated}, unconfirmed extras {unconfirmed}",
            seen.len(),
            node.spec.name,
            want - lost,
            want
        ));
        if !may_be_lost.is_empty() {
            self.notes.push(format!(
                "{expected_lost} of {} messages confirmed after A stopped were lost, as the seed says they must be",
                may_be_lost.len()
            ));
        }
        Ok(Report {
            scenario: self.n,
            pass: lost == 0 && duplicated == 0,
            confirmed: self.confirmed.len(),
            recovered: want - lost,
            lost,
            expected_lost,
            duplicated,
            notes: std::mem::take(&mut self.notes),
        })
    }

    /// Runs `warrenctl ARGS`; returns stdout, fails on a non-zero exit.
    fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(&self.bins.ctl).args(args).output()?;
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        self.say(&format!("warrenctl {}: {stdout} {stderr}", args.join(" ")));
        if !out.status.success() {
            bail!(
                "warrenctl {} failed ({}): {stderr}",
                args.join(" "),
                out.status
            );
        }
        Ok(stdout)
    }

    /// Scenario 1: A stops, then B; start B then A (messages published while only B
    /// ran included). Then, separately, A stops, then B; start A, and B
    /// within the boot wait.
    fn one(&mut self) -> anyhow::Result<Report> {
        let (sa, a, sb, b) = self.pair()?;
        self.publish(&a, "both")?;
        self.stop(a)?;
        self.publish(&b, "b-alone")?;
        self.stop(b)?;
        self.say("start B (stopped last), then A");
        let b = self.start(&sb, None)?;
        let a = self.start(&sa, None)?;
        let all = self.confirmed.clone();
        let first = self.check(&b, &all, &BTreeSet::new())?;
        self.say(&format!("first half: {first}"));
        // The second half starts from an empty queue.
        b.wait_queue("B as a synchronised mirror again", |q| {
            names(q, "synchronised_slave_nodes").len() == 1
        })?;
        let second_batch = self.publish(&a, "round2")?;
        self.stop(a)?;
        self.stop(b)?;
        self.say("start A first, then B within the boot wait");
        let pa = self.spawn(&sa, None)?;
        std::thread::sleep(Duration::from_secs(2));
        let pb = self.spawn(&sb, None)?;
        let a = pa.ready()?;
        let _b = pb.ready()?;
        self.say("both ready");
        let mut second = self.check(&a, &second_batch, &BTreeSet::new())?;
        second
            .notes
            .insert(0, format!("first half (B then A): {}", first.summary()));
        second.pass &= first.pass;
        second.lost += first.lost;
        second.duplicated += first.duplicated;
        second.recovered += first.recovered;
        Ok(second)
    }

    /// Scenario 2: A and B SIGKILLed together; both start.
    fn two(&mut self) -> anyhow::Result<Report> {
        let (sa, a, sb, b) = self.pair()?;
        self.publish(&a, "both")?;
        a.kill();
        b.kill();
        self.say("A and B SIGKILLed");
        let pa = self.spawn(&sa, None)?;
        let pb = self.spawn(&sb, None)?;
        let a = pa.ready()?;
        let _b = pb.ready()?;
        self.say("both ready");
        let all = self.confirmed.clone();
        self.check(&a, &all, &BTreeSet::new())
    }

    /// Scenario 3: A stops, then B; A is gone for good: B starts, forgets A, serves
    /// the queue, and a new node C joins as a synchronised mirror.
    fn three(&mut self) -> anyhow::Result<Report> {
        let (sa, a, sb, b) = self.pair()?;
        self.publish(&a, "both")?;
        self.stop(a)?;
        self.stop(b)?;
        std::fs::remove_dir_all(&sa.dir)?;
        self.say("A's data directory deleted: A is gone for good");
        let b = self.start(&sb, None)?;
        self.ctl(&["--node", &sb.http_addr(), "forget_cluster_node", &sa.name])?;
        let all = self.confirmed.clone();
        b.wait_queue("B to master the queue with every message", |q| {
            q["node"] == "warren@b" && q["messages"].as_u64() == Some(all.len() as u64)
        })?;
        self.say("B masters ha.seed with every confirmed message");
        let sc = self.spec("c")?;
        let _c = self.start(&sc, Some(&sb))?;
        let q = b.wait_queue("C as a synchronised mirror", |q| {
            names(q, "synchronised_slave_nodes").contains(&sc.name)
        })?;
        self.say(&format!(
            "C joined: master {}, synchronised mirrors {:?}",
            q["node"],
            names(&q, "synchronised_slave_nodes")
        ));
        self.notes
            .push("C joined B and became a synchronised mirror".to_owned());
        self.check(&b, &all, &BTreeSet::new())
    }

    /// Scenario 4: A stops, then B; B is gone for good: `forget_cluster_node
    /// --offline` on stopped A, A starts with what it held.
    fn four(&mut self) -> anyhow::Result<Report> {
        let (sa, a, sb, b) = self.pair()?;
        let held = self.publish(&a, "both")?;
        self.stop(a)?;
        let after = self.publish(&b, "b-alone")?;
        self.stop(b)?;
        std::fs::remove_dir_all(&sb.dir)?;
        self.say("B's data directory deleted: B is gone for good");
        let dir = sa.dir.to_string_lossy().into_owned();
        self.ctl(&[
            "forget_cluster_node",
            "--offline",
            &sb.name,
            "--data-dir",
            &dir,
            "--local-node",
            &sa.name,
        ])?;
        let a = self.start(&sa, None)?;
        self.check(&a, &held, &after)
    }

    /// Scenario 5: Both gone, B's data directory survives: a new process takes B's
    /// name, data directory and peer address; the queue comes back.
    fn five(&mut self) -> anyhow::Result<Report> {
        let (sa, a, sb, b) = self.pair()?;
        self.publish(&a, "both")?;
        self.stop(a)?;
        self.publish(&b, "b-alone")?;
        self.stop(b)?;
        std::fs::remove_dir_all(&sa.dir)?;
        let mut host = self.spec("b-new-host")?;
        copy_dir(&sb.dir, &host.dir)?;
        std::fs::remove_dir_all(&sb.dir)?;
        host.name.clone_from(&sb.name);
        host.peer = sb.peer;
        self.say(&format!(
            "A and B gone; B's data directory copied to {}, started as {} on B's peer address",
            host.dir.display(),
            host.name
        ));
        let b = self.start(&host, None)?;
        self.ctl(&["--node", &host.http_addr(), "forget_cluster_node", &sa.name])?;
        let all = self.confirmed.clone();
        self.check(&b, &all, &BTreeSet::new())
    }

    /// Scenario 6: Both gone with their disks: a fresh node knows nothing of the
    /// queue, and says so.
    fn six(&mut self) -> anyhow::Result<Report> {
        let (sa, a, sb, b) = self.pair()?;
        self.publish(&a, "both")?;
        self.stop(a)?;
        self.stop(b)?;
        std::fs::remove_dir_all(&sa.dir)?;
        std::fs::remove_dir_all(&sb.dir)?;
        self.say("A and B gone with their data directories; starting a fresh node");
        let fresh = self.spec("fresh")?;
        let node = self.start(&fresh, None)?;
        let (status, _) = node.http("GET", &format!("/api/queues/%2F/{QUEUE}"), None)?;
        self.say(&format!(
            "GET /api/queues/%2F/{QUEUE} on the fresh node: {status}"
        ));
        let passive = self.rt.block_on(async {
            let conn =
                Connection::connect(&node.amqp_url(), ConnectionProperties::default()).await?;
            let ch = conn.create_channel().await?;
            let opts = QueueDeclareOptions {
                passive: true,
                durable: true,
                ..QueueDeclareOptions::default()
            };
            let r = ch
                .queue_declare(QUEUE.into(), opts, FieldTable::default())
                .await;
            let _ = conn.close(200, "bye".into()).await;
            anyhow::Ok(r.map(|_| ()))
        })?;
        let message = match passive {
            Ok(()) => bail!("a fresh node claims to have {QUEUE}"),
            Err(e) => e.to_string(),
        };
        self.say(&format!("passive queue.declare {QUEUE}: {message}"));
        let clear = message.contains("404") || message.contains("NOT_FOUND");
        let lost = self.confirmed.len();
        self.notes.push(format!(
            "what a user sees: passive declare of {QUEUE} -> {message}; HTTP GET -> {status}; all {lost} confirmed messages are gone, as the seed says"
        ));
        Ok(Report {
            scenario: 6,
            pass: clear && status == 404,
            confirmed: lost,
            recovered: 0,
            lost: 0,
            expected_lost: lost,
            duplicated: 0,
            notes: std::mem::take(&mut self.notes),
        })
    }
}

impl Report {
    /// The counts in one line.
    fn summary(&self) -> String {
        format!(
            "{} (recovered {}, lost {}, duplicated {})",
            if self.pass { "PASS" } else { "FAIL" },
            self.recovered,
            self.lost,
            self.duplicated
        )
    }
}

/// Copies a directory tree.
fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// Publishes `bodies` (persistent, confirm mode); returns the indices acked.
async fn publish_confirmed(
    url: &str,
    bodies: &[(usize, String)],
) -> anyhow::Result<BTreeSet<usize>> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = Vec::new();
    for (i, body) in bodies {
        match ch
            .basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
        {
            Ok(confirm) => pending.push((*i, confirm)),
            Err(_) => break,
        }
    }
    let mut acked = BTreeSet::new();
    for (i, confirm) in pending {
        if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(30), confirm).await
            && c.is_ack()
        {
            acked.insert(i);
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(acked)
}

/// Consumes (acking) until every body of `want` was seen and nothing more
/// came for 0.5 s, or nothing came for 5 s; returns every body delivered.
async fn consume_all(url: &str, want: &BTreeSet<String>) -> anyhow::Result<Vec<String>> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(100, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            QUEUE.into(),
            "scenario-check".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| anyhow!("basic.consume {QUEUE}: {e}"))?;
    let mut seen = Vec::new();
    let mut missing: BTreeSet<&str> = want.iter().map(String::as_str).collect();
    loop {
        let wait = if missing.is_empty() {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(5)
        };
        match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(Ok(d))) => {
                let body = String::from_utf8_lossy(&d.data).into_owned();
                missing.remove(body.as_str());
                seen.push(body);
                d.ack(BasicAckOptions::default()).await?;
            }
            _ => break,
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(seen)
}

#[cfg(test)]
mod tests {
    //! The six scenarios with the debug binaries of the target directory
    //! this test was built into (built first if missing or stale).

    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    use super::{Bins, run};

    fn bins() -> &'static Bins {
        static BINS: OnceLock<Bins> = OnceLock::new();
        BINS.get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("the workspace root")
                .to_path_buf();
            // <target>/debug/deps/xtask-HASH
            let exe = std::env::current_exe().expect("the test binary");
            let target: PathBuf = exe
                .ancestors()
                .nth(3)
                .expect("a target directory")
                .to_path_buf();
            Bins::build(&root, &target).expect("building warren and warrenctl")
        })
    }

    fn scenario(n: u32) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/scenarios");
        let report = run(n, bins(), &root.join(n.to_string())).expect("the scenario ran");
        println!("{report}");
        assert!(report.pass, "{report}");
    }

    #[test]
    fn scenario_1_a_stops_then_b_both_restart_in_either_order() {
        scenario(1);
    }

    #[test]
    fn scenario_2_both_killed_together_both_restart() {
        scenario(2);
    }

    #[test]
    fn scenario_3_a_gone_for_good_forget_it_and_join_c() {
        scenario(3);
    }

    #[test]
    fn scenario_4_b_gone_for_good_offline_forget_on_a() {
        scenario(4);
    }

    #[test]
    fn scenario_5_b_data_directory_moves_to_a_new_host() {
        scenario(5);
    }

    #[test]
    fn scenario_6_both_gone_with_their_disks() {
        scenario(6);
    }
}
