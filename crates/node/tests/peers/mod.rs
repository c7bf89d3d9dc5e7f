//! Clustered `warren` processes for end-to-end tests: start, stop, kill,
//! the management API, and a three-node cluster on 127.0.0.1.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde_json::{Value, json};

/// A running clustered `warren` process.
pub struct Peer {
    child: Child,
    /// The node name.
    pub name: String,
    /// The address every listener of the node binds (and its outgoing peer
    /// connections too).
    pub ip: String,
    /// The AMQP port.
    pub amqp: u16,
    /// The management HTTP address.
    pub http: String,
    /// The Prometheus metrics address.
    pub metrics: String,
    /// The peer (cluster) address.
    pub peers: String,
    /// The data directory.
    pub dir: PathBuf,
}

pub fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(key)
        .nth(1)
        .and_then(|s| s.split(',').next())
        .map_or("", str::trim)
}

impl Peer {
    pub fn start(name: &str, dir: &Path, secret: &Path, join: Option<&str>) -> Self {
        Self::start_with(name, dir, secret, join, &[])
    }

    pub fn start_with(
        name: &str,
        dir: &Path,
        secret: &Path,
        join: Option<&str>,
        extra: &[&str],
    ) -> Self {
        Self::start_on("127.0.0.1", name, dir, secret, join, extra)
    }

    /// Starts a node whose listeners bind `ip` (free ports), as
    /// [`Peer::start_with`] does on 127.0.0.1.
    pub fn start_on(
        ip: &str,
        name: &str,
        dir: &Path,
        secret: &Path,
        join: Option<&str>,
        extra: &[&str],
    ) -> Self {
        let any_port = format!("{ip}:0");
        let addrs = [any_port.as_str(); 4];
        Self::start_at(ip, addrs, name, dir, secret, join, extra)
    }

    /// Starts this node again (after a kill) with the same data directory,
    /// on the same AMQP and peer addresses (the cluster knows the node by
    /// its peer address) and on fresh HTTP and metrics ports: a port freed
    /// by the kill can be taken meanwhile as another connection's ephemeral
    /// port, and the node then serves no API (a CI run failed so).
    pub fn restart(&self, secret: &Path, extra: &[&str]) -> Self {
        let amqp = format!("{}:{}", self.ip, self.amqp);
        let any_port = format!("{}:0", self.ip);
        let addrs = [
            amqp.as_str(),
            any_port.as_str(),
            any_port.as_str(),
            self.peers.as_str(),
        ];
        Self::start_at(&self.ip, addrs, &self.name, &self.dir, secret, None, extra)
    }

    /// Starts a node listening at `addrs`: AMQP, HTTP, metrics, peers.
    fn start_at(
        ip: &str,
        addrs: [&str; 4],
        name: &str,
        dir: &Path,
        secret: &Path,
        join: Option<&str>,
        extra: &[&str],
    ) -> Self {
        let [amqp, http, metrics, peers] = addrs;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_warren"));
        cmd.args(["--amqp-addr", amqp, "--http-addr", http])
            .args(["--prometheus-addr", metrics])
            .args(["--node-name", name, "--peer-addr", peers])
            .arg("--data-dir")
            .arg(dir)
            .arg("--cluster-secret-file")
            .arg(secret)
            .stdout(Stdio::piped())
            .stderr(log_file(dir));
        if let Some(j) = join {
            cmd.args(["--join", j]);
        }
        if DEFAULT_LOGS.load(Ordering::SeqCst) {
            cmd.env_remove("RUST_LOG");
        } else {
            cmd.env("RUST_LOG", "info,openraft=error");
        }
        cmd.args(extra);
        let mut child = cmd.spawn().expect("start warren");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read ready line");
        let amqp = field(&line, "AMQP on ")
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no ready line from {name}: {line:?}"));
        Self {
            child,
            name: name.to_owned(),
            ip: ip.to_owned(),
            amqp,
            http: field(&line, "HTTP on ").to_owned(),
            metrics: field(&line, "metrics on ").to_owned(),
            peers: field(&line, "peers on ").to_owned(),
            dir: dir.to_owned(),
        }
    }

    pub fn http(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(30))
            .build();
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("guest:guest")
        );
        let req = agent
            .request(method, &format!("http://{}{path}", self.http))
            .set("Authorization", &auth);
        let r = match body {
            Some(b) => req
                .set("Content-Type", "application/json")
                .send_string(&b.to_string()),
            None => req.call(),
        };
        let resp = match r {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().expect("read body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The value of the metric line `name{labels}` on `/metrics`, if present.
    pub fn metric(&self, series: &str) -> Option<u64> {
        let text = ureq::get(&format!("http://{}/metrics", self.metrics))
            .timeout(Duration::from_secs(30))
            .call()
            .ok()?
            .into_string()
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// The node's AMQP URL as guest, default vhost.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}:{}/%2f", self.ip, self.amqp)
    }

    pub fn get(&self, path: &str) -> Value {
        let (status, v) = self.http("GET", path, None);
        assert_eq!(status, 200, "GET {path} on {}: {v}", self.name);
        v
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The TCP ports the process listens on, read from `/proc` (its sockets
    /// in `/proc/PID/fd`, their states in `/proc/PID/net/tcp{,6}`).
    pub fn listening_ports(&self) -> BTreeSet<u16> {
        let pid = self.pid();
        let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("the process's descriptors")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter_map(|l| {
                let l = l.to_string_lossy().into_owned();
                Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
            })
            .collect();
        let mut ports = BTreeSet::new();
        for table in ["tcp", "tcp6"] {
            let text =
                std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
            for line in text.lines().skip(1) {
                let f: Vec<&str> = line.split_whitespace().collect();
                // sl, local address, remote address, state (0A: listening), …, inode.
                if f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]) {
                    let port = f[1].rsplit(':').next().expect("a port");
                    ports.insert(u16::from_str_radix(port, 16).expect("a hex port"));
                }
            }
        }
        ports
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// How the process ended, if it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends the process signal `sig` (`-STOP`, `-CONT`, …).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    pub fn terminate(&mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Set by [`use_default_logs`].
static DEFAULT_LOGS: AtomicBool = AtomicBool::new(false);

/// Nodes started from now on log what a node logs by default (no
/// `RUST_LOG`), as an operator sees it.
pub fn use_default_logs() {
    DEFAULT_LOGS.store(true, Ordering::SeqCst);
}

/// The lines of node `p`'s log at WARN or ERROR level.
pub fn warnings(p: &Peer) -> Vec<String> {
    std::fs::read_to_string(p.dir.with_extension("log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .map(str::to_owned)
        .collect()
}

/// The last `n` lines of each node's log, each headed by its name: for a
/// failure message, since a test's directory goes with the test.
pub fn log_tails(nodes: &[&Peer], n: usize) -> String {
    let mut out = String::new();
    for p in nodes {
        let log = std::fs::read_to_string(p.dir.with_extension("log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        out.push_str(&format!("--- {} (last {n} log lines)\n", p.name));
        for l in &lines[lines.len().saturating_sub(n)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// SIGKILLs process `pid` (a node started by the test).
pub fn sigkill(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}

/// A test's root directory; kept (and named on stderr) when
/// `WARREN_KEEP_TEST_DIRS` is set, to read the nodes' logs after a failure.
pub fn test_root() -> tempfile::TempDir {
    let mut d = tempfile::tempdir().expect("temp dir");
    if std::env::var_os("WARREN_KEEP_TEST_DIRS").is_some() {
        d.disable_cleanup(true);
        #[allow(clippy::print_stderr)]
        {
            eprintln!("test dir kept: {}", d.path().display());
        }
    }
    d
}

/// The node's log: next to its data directory, kept when a test fails.
fn log_file(dir: &Path) -> Stdio {
    let _ = std::fs::create_dir_all(dir.parent().unwrap_or(dir));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.with_extension("log"))
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

/// Polls `check` until it holds (at most 30 s).
pub fn eventually(what: &str, check: impl FnMut() -> bool) {
    eventually_within(what, Duration::from_secs(30), check);
}

/// As [`eventually`], for work whose size sets the wait (`limit`).
pub fn eventually_within(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn names(v: &Value, key: &str) -> Vec<String> {
    v.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect()
}

pub fn has(list: &Value, pred: impl Fn(&Value) -> bool) -> bool {
    list.as_array().is_some_and(|a| a.iter().any(pred))
}

/// Sets the policy `ha-all` through `p`: queues named `ha.*` mirrored to
/// every node, synchronised automatically.
pub fn set_ha_all(p: &Peer) {
    let (status, v) = p.http(
        "PUT",
        "/api/policies/%2F/ha-all",
        Some(&json!({
            "pattern": "^ha\\.",
            "apply-to": "queues",
            "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
        })),
    );
    assert!(status == 201 || status == 204, "set policy: {status} {v}");
}

/// Declares the durable queue `name` through node `p` (its master is `p`).
pub fn declare_durable(rt: &tokio::runtime::Runtime, p: &Peer, name: &str) {
    rt.block_on(async {
        let conn = Connection::connect(&p.amqp_url(), ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        let opts = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare(name.into(), opts, FieldTable::default())
            .await?;
        conn.close(200, "bye".into()).await
    })
    .unwrap_or_else(|e| panic!("declaring {name} on {}: {e}", p.name));
}

/// Three nodes on 127.0.0.1 joined through the first one.
pub fn three(root: &Path) -> (PathBuf, Vec<Peer>) {
    three_with(root, &[])
}

/// [`three`], each node started with the `extra` arguments.
pub fn three_with(root: &Path, extra: &[&str]) -> (PathBuf, Vec<Peer>) {
    let secret = root.join("secret");
    std::fs::write(&secret, "cluster-test-secret\n").unwrap();
    let first = Peer::start_with("warren@a", &root.join("a"), &secret, None, extra);
    let seed = first.peers.clone();
    assert!(!seed.is_empty(), "the ready line names the peer address");
    let mut nodes = vec![first];
    for n in ["b", "c"] {
        nodes.push(Peer::start_with(
            &format!("warren@{n}"),
            &root.join(n),
            &secret,
            Some(&seed),
            extra,
        ));
    }
    for n in &nodes {
        eventually("three running members", || {
            names(&n.get("/api/cluster"), "running_nodes").len() == 3
        });
    }
    (secret, nodes)
}
