//! Starting `warren` processes: the flags every xtask that runs a cluster
//! gives a node, and the wait for the node's "ready" line on its stdout.

use std::io::{BufRead as _, BufReader, Read};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

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

/// Waits for a node's "ready" line (see [`ready_signal`]).
pub(crate) fn wait_ready(
    stdout: impl Read + Send + 'static,
    name: &str,
    limit: Duration,
) -> anyhow::Result<()> {
    ready_signal(stdout)
        .recv_timeout(limit)
        .map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => {
                anyhow::anyhow!("{name} did not become ready within {limit:?}")
            }
            mpsc::RecvTimeoutError::Disconnected => {
                anyhow::anyhow!("{name} exited before it was ready")
            }
        })
}
