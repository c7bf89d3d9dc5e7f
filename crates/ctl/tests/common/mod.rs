//! Starts the real `warren` binary and runs the real `warrenctl` binary.
//!
//! `warrenctl` comes from `CARGO_BIN_EXE_warrenctl`. `warren` belongs to
//! another package (warren-node), so it is taken from the same target
//! directory (`cargo nextest run --workspace` and `cargo test --workspace`
//! build it); when it is missing (`cargo test -p warren-ctl` alone) it is
//! built once with `cargo build -p warren-node --bin warren`.

#![allow(dead_code)]

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::Value;

/// The `warren` binary next to `warrenctl`, built if missing.
pub fn warren_bin() -> PathBuf {
    if let Ok(p) = std::env::var("WARREN_BIN") {
        return PathBuf::from(p);
    }
    let ctl = PathBuf::from(env!("CARGO_BIN_EXE_warrenctl"));
    let dir = ctl.parent().expect("warrenctl has a directory");
    let bin = dir.join("warren");
    if !bin.exists() {
        // <target>/<profile>/warrenctl: build warren into the same target dir.
        let target = dir.parent().expect("a target directory");
        let profile = dir.file_name().and_then(|p| p.to_str()).unwrap_or("debug");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "-p", "warren-node", "--bin", "warren"])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile == "release" {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building warren failed");
    }
    bin
}

/// A running `warren` process.
pub struct Node {
    child: Child,
    /// The AMQP port.
    pub amqp_port: u16,
    /// The management HTTP address (`127.0.0.1:PORT`).
    pub http: String,
    /// The Prometheus address (`127.0.0.1:PORT`).
    pub metrics: String,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// The peer (cluster) address; empty for a node running alone.
    pub peers: String,
}

fn addr_after<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(key)
        .nth(1)
        .and_then(|s| s.split(',').next())
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {key:?} in the ready line {line:?}"))
}

impl Node {
    /// Starts a node on free ports with data in `data_dir`.
    pub fn start(data_dir: &Path) -> Self {
        Self::start_with_env(data_dir, &[])
    }

    /// Starts a node as [`Node::start`] does, with the environment
    /// variables `env` set (`WARREN_*` settings).
    pub fn start_with_env(data_dir: &Path, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(warren_bin());
        cmd.args(["--node-name", "warren@testhost"])
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stderr(Stdio::null());
        Self::spawn(cmd, data_dir)
    }

    /// Starts `name`, a one-node cluster (its peer listener on a free port)
    /// with the cluster secret in `secret`; its log goes next to
    /// `data_dir` (`<data_dir>.log`).
    pub fn start_clustered(name: &str, data_dir: &Path, secret: &Path) -> Self {
        Self::clustered(name, data_dir, secret, None)
    }

    /// Starts `name` as [`Node::start_clustered`] does, joining the cluster
    /// of the member whose peer address is `seed`.
    pub fn start_joining(name: &str, data_dir: &Path, secret: &Path, seed: &str) -> Self {
        Self::clustered(name, data_dir, secret, Some(seed))
    }

    fn clustered(name: &str, data_dir: &Path, secret: &Path, join: Option<&str>) -> Self {
        let log = std::fs::File::create(data_dir.with_extension("log")).expect("log file");
        let mut cmd = Command::new(warren_bin());
        cmd.args(["--node-name", name, "--peer-addr", "127.0.0.1:0"])
            .arg("--cluster-secret-file")
            .arg(secret)
            .env("RUST_LOG", "info,openraft=error")
            .stderr(log);
        if let Some(seed) = join {
            cmd.args(["--join", seed]);
        }
        Self::spawn(cmd, data_dir)
    }

    /// Runs `cmd` on free ports with data in `data_dir`, until its ready line.
    fn spawn(mut cmd: Command, data_dir: &Path) -> Self {
        let mut child = cmd
            .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(["--prometheus-addr", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(data_dir)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start warren");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the ready line");
        let amqp_port = addr_after(&line, "AMQP on ")
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("AMQP port");
        let http = addr_after(&line, "HTTP on ").to_owned();
        let metrics = addr_after(&line, "metrics on ").to_owned();
        let peers = line
            .split("peers on ")
            .nth(1)
            .map_or("", str::trim)
            .to_owned();
        Self {
            child,
            amqp_port,
            http,
            metrics,
            data_dir: data_dir.to_owned(),
            peers,
        }
    }

    /// The guest AMQP URL of vhost `/`.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// Runs `warrenctl --node <this node> args…`.
    pub fn ctl(&self, args: &[&str]) -> Ctl {
        ctl(&[&["--node", &self.http], args].concat())
    }

    /// An HTTP request as `user`; the status and the parsed body (Null if empty).
    pub fn http_as(
        &self,
        user: &str,
        password: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(30))
            .build();
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
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
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, v)
    }

    /// A plain GET without credentials: status, content type and body.
    pub fn get_plain(&self, addr: &str, path: &str) -> (u16, String, String) {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(30))
            .build();
        let resp = match agent.get(&format!("http://{addr}{path}")).call() {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("GET {path}: {e}"),
        };
        let status = resp.status();
        let ctype = resp.content_type().to_owned();
        (status, ctype, resp.into_string().expect("read body"))
    }

    /// An HTTP request as guest.
    pub fn http(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.http_as("guest", "guest", method, path, body)
    }

    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn terminate(&mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        self.child.wait().expect("wait for warren");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a `warrenctl` run gave.
#[derive(Debug)]
pub struct Ctl {
    /// Exit code.
    pub code: i32,
    /// Standard output.
    pub out: String,
    /// Standard error.
    pub err: String,
}

impl Ctl {
    /// Asserts success and returns standard output.
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "warrenctl failed: {self:?}");
        &self.out
    }

    /// The tab-separated rows of a `-q` listing (header included).
    pub fn rows(&self) -> Vec<Vec<String>> {
        self.ok()
            .lines()
            .map(|l| l.split('\t').map(str::to_owned).collect())
            .collect()
    }
}

/// Runs `warrenctl args…`.
pub fn ctl(args: &[&str]) -> Ctl {
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(env!("CARGO_BIN_EXE_warrenctl"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run warrenctl");
    Ctl {
        code: status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&stdout).into_owned(),
        err: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

/// Polls `check` until it holds (at most 60 s).
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
