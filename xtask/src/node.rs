//! Starting `warren` processes: the flags every xtask that runs a cluster
//! gives a node, the wait for the node's "ready" line on its stdout, and
//! calls to its management API.

use std::io::{BufRead as _, BufReader, Read, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::Value;

/// Where one node listens, keeps its data and finds its cluster.
pub(crate) struct NodeArgs<'a> {
    /// The node name (`warren@…`).
    pub(crate) name: &'a str,
    /// The listeners, `ip:port` each.
    pub(crate) amqp: String,
    pub(crate) http: String,
    pub(crate) metrics: String,
    pub(crate) peer: String,
    /// `tcp` or `quic`; `None` leaves the node's default.
    pub(crate) transport: Option<&'a str>,
    /// The cluster secret file.
    pub(crate) secret: &'a Path,
    /// The data directory.
    pub(crate) data: &'a Path,
    /// The cluster CA directory (QUIC): the first node creates it.
    pub(crate) ca_dir: Option<&'a Path>,
    /// A member's peer address to join on first start.
    pub(crate) join: Option<String>,
}

impl NodeArgs<'_> {
    /// Adds the node's flags to `cmd`, a `warren` command (run directly or
    /// in a network namespace).
    pub(crate) fn apply(&self, cmd: &mut Command) {
        cmd.args(["--node-name", self.name])
            .args(["--amqp-addr", &self.amqp])
            .args(["--http-addr", &self.http])
            .args(["--prometheus-addr", &self.metrics])
            .args(["--peer-addr", &self.peer])
            .arg("--cluster-secret-file")
            .arg(self.secret)
            .arg("--data-dir")
            .arg(self.data);
        if let Some(t) = self.transport {
            cmd.args(["--transport", t]);
        }
        if let Some(ca) = self.ca_dir {
            cmd.arg("--cluster-ca-dir").arg(ca);
        }
        if let Some(j) = &self.join {
            cmd.args(["--join", j]);
        }
    }
}

/// Reads a node's stdout on a thread of its own: the receiver gets `()` at
/// the "ready" line, and is disconnected if the node exits first. The
/// thread keeps draining the stdout after.
pub(crate) fn ready_signal(stdout: impl Read + Send + 'static) -> mpsc::Receiver<()> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if line.contains("ready") {
                let _ = tx.send(());
                break;
            }
        }
        for _ in lines {}
    });
    rx
}

/// Waits for a node's "ready" line (see [`ready_signal`]), at most `limit`;
/// gives up early when `stop` receives.
pub(crate) fn wait_ready(
    stdout: impl Read + Send + 'static,
    name: &str,
    limit: Duration,
    stop: Option<&mpsc::Receiver<()>>,
) -> anyhow::Result<()> {
    let ready = ready_signal(stdout);
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match ready.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(()) => return Ok(()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!("{name} exited before it was ready")
            }
            Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => {
                bail!("{name} did not become ready within {limit:?}")
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if stop.is_some_and(|s| s.try_recv().is_ok()) {
            bail!("stopped while waiting for {name} to be ready");
        }
    }
}

/// One HTTP/1.1 request as guest; returns the status and the (de-chunked) body.
pub(crate) fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = Vec::new();
    s.read_to_end(&mut response)?;
    let response = String::from_utf8_lossy(&response);
    let (head, rest) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{method} {path} on {addr}: no status in {head:?}"))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let mut text = String::new();
    if chunked {
        let mut rest = rest;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if size == 0 || after.len() < size {
                break;
            }
            text.push_str(&after[..size]);
            rest = after[size..].trim_start_matches("\r\n");
        }
    } else {
        text.push_str(rest);
    }
    Ok((status, text))
}

/// The value of the unlabelled series `name` on the Prometheus page at
/// `addr` (`None`: the page or the series is not there).
pub(crate) fn metric(addr: &str, name: &str) -> anyhow::Result<Option<f64>> {
    let (status, text) = http(addr, "GET", "/metrics", None)?;
    if status != 200 {
        return Ok(None);
    }
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()))
}

/// `GET path` as guest: the JSON body if the answer is 200 OK.
pub(crate) fn http_json(addr: &str, path: &str) -> anyhow::Result<Option<Value>> {
    let (status, text) = http(addr, "GET", path, None)?;
    if status != 200 {
        return Ok(None);
    }
    Ok(Some(serde_json::from_str(&text)?))
}
