//! In-process clusters over the in-memory transport.

use std::collections::BTreeMap;

use std::sync::Arc;
use std::time::Duration;
use warren_cluster::offline::read_log_commands;

use tempfile::TempDir;
use warren_cluster::{Cluster, ClusterConfig, ClusterError, Command, Metadata, NodeEvent};
use warren_transport::conformance::config;
use warren_transport::mem::MemNetwork;
use warren_transport::{NodeName, PeerAddr, TransportError};

/// The longest any single wait in a test may take before it counts as a hang.
pub const LIMIT: Duration = Duration::from_secs(40);

pub fn n(s: &str) -> NodeName {
    NodeName::new(s).unwrap()
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Test timings: fast elections and failure detection, short bounded waits.
pub fn short_timeouts(c: &mut ClusterConfig) {
    c.raft_heartbeat_interval = Duration::from_millis(50);
    c.election_timeout_min = Duration::from_millis(400);
    c.election_timeout_max = Duration::from_millis(800);
    c.command_timeout = Duration::from_secs(3);
    c.heartbeat_interval = Duration::from_millis(100);
    c.failure_timeout = Duration::from_millis(600);
    c.boot_wait_timeout = Duration::from_secs(2);
    // 30 s for a restarted node to find a majority: a loaded CI machine
    // took over 10 s while the others elected and caught it up by snapshot.
    c.boot_wait_retries = 15;
    c.boot_log_interval = Duration::from_millis(500);
}

pub struct TestCluster {
    pub net: MemNetwork,
    dirs: BTreeMap<String, TempDir>,
    pub nodes: BTreeMap<String, Cluster>,
    pub snapshot_every: u64,
    pub boot_wait_timeout: Duration,
    pub boot_wait_retries: u32,
}

impl TestCluster {
    pub fn new(seed: u64) -> Self {
        init_tracing();
        Self {
            net: MemNetwork::new(seed),
            dirs: BTreeMap::new(),
            nodes: BTreeMap::new(),
            snapshot_every: 10_000,
            boot_wait_timeout: Duration::from_secs(2),
            boot_wait_retries: 15,
        }
    }

    pub fn data_dir(&mut self, name: &str) -> std::path::PathBuf {
        self.dirs
            .entry(name.to_owned())
            .or_insert_with(|| tempfile::tempdir().unwrap())
            .path()
            .to_owned()
    }

    pub fn config(&mut self, name: &str, join: Option<&str>) -> ClusterConfig {
        let transport = Arc::new(self.net.transport(config(name, "cluster-secret", 1 << 20)));
        let dir = self.data_dir(name);
        let mut c = ClusterConfig::new(n(name), PeerAddr::new(name), dir, transport);
        c.join = join.map(PeerAddr::new);
        short_timeouts(&mut c);
        c.boot_wait_timeout = self.boot_wait_timeout;
        c.boot_wait_retries = self.boot_wait_retries;
        c.snapshot_every = self.snapshot_every;
        c
    }

    /// Starts a node (retrying while its old listener is still registered).
    pub async fn start_with(&mut self, cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        let name = cfg.node.to_string();
        let mut tries = 0;
        let c = loop {
            match Cluster::start(cfg.clone()).await {
                Err(ClusterError::Transport(TransportError::Listen { .. })) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => break other?,
            }
        };
        self.nodes.insert(name, c.clone());
        Ok(c)
    }

    pub async fn start(&mut self, name: &str, join: Option<&str>) -> Cluster {
        let cfg = self.config(name, join);
        tokio::time::timeout(LIMIT, self.start_with(cfg))
            .await
            .expect("start hung")
            .unwrap_or_else(|e| panic!("start {name}: {e}"))
    }

    /// A cluster of `names`: the first bootstraps, the others join it.
    pub async fn form(&mut self, names: &[&str]) {
        self.start(names[0], None).await;
        for name in &names[1..] {
            self.start(name, Some(names[0])).await;
        }
    }

    pub fn node(&self, name: &str) -> Cluster {
        self.nodes[name].clone()
    }

    /// Stops a node abruptly (no hand-off), like a crash.
    pub async fn kill(&mut self, name: &str) {
        if let Some(c) = self.nodes.remove(name) {
            c.shutdown().await;
        }
        self.net.disconnect(&n(name));
    }

    pub async fn shutdown_all(&mut self) {
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            self.kill(&name).await;
        }
    }

    /// Waits until one of `names` leads and all of them agree; returns it.
    pub async fn leader(&self, names: &[&str]) -> String {
        let deadline = tokio::time::Instant::now() + LIMIT;
        loop {
            let leaders: Vec<Option<String>> = names
                .iter()
                .map(|n| self.nodes[*n].cluster_status().leader)
                .collect();
            if let Some(Some(l)) = leaders.first()
                && leaders.iter().all(|x| x.as_ref() == Some(l))
                && names.contains(&l.as_str())
                && self.nodes[l.as_str()].is_leader()
            {
                return l.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no agreed leader among {names:?}: {leaders:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Waits until `node`'s local metadata satisfies `pred`.
pub async fn eventually(node: &Cluster, what: &str, pred: impl Fn(&Metadata) -> bool) {
    let mut changes = node.metadata_changes();
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        if pred(&node.local()) {
            return;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "{}: never saw {what}", node.node());
        let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), changes.changed()).await;
    }
}

/// Retries an idempotent write until it commits (for use right after a
/// failure, while a new leader is elected).
pub async fn write_eventually(node: &Cluster, cmd: Command) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        match node.write(cmd.clone()).await {
            Ok(_) => return,
            Err(ClusterError::NoMajority { .. } | ClusterError::Remote(_))
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{}: write failed: {e}", node.node()),
        }
    }
}

pub fn vhost(name: &str) -> Command {
    Command::PutVhost { name: name.into() }
}

/// Waits for `want` on a failure-detector subscription.
pub async fn wait_event(events: &mut tokio::sync::broadcast::Receiver<NodeEvent>, want: NodeEvent) {
    let seen = tokio::time::timeout(LIMIT, async {
        loop {
            match events.recv().await {
                Ok(e) if e == want => return,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("event stream ended: {e}"),
            }
        }
    })
    .await;
    assert!(seen.is_ok(), "never saw {want:?}");
}

/// The end of a faulty run: commits `"last"` through `via` (retrying, so it
/// may be in the logs more than once), waits until every node has it and
/// every `acked` write, stops the cluster, then checks that no node's log
/// holds any other vhost command twice (and, if the logs were never
/// compacted, that each holds every acknowledged one).
pub async fn check_every_ack_applied_once(
    tc: &mut TestCluster,
    names: &[&str],
    acked: &[String],
    via: &str,
    context: &str,
) {
    write_eventually(&tc.node(via), vhost("last")).await;
    for name in names {
        eventually(&tc.node(name), "every acknowledged write", |m| {
            m.vhosts.contains("last") && acked.iter().all(|v| m.vhosts.contains(v))
        })
        .await;
    }
    tc.shutdown_all().await;
    for name in names {
        let mut seen: BTreeMap<String, u64> = BTreeMap::new();
        for (index, cmd) in read_log_commands(&tc.data_dir(name)).unwrap() {
            if let Command::PutVhost { name: v } = cmd
                && v != "last"
                && let Some(prev) = seen.insert(v.clone(), index)
            {
                panic!("{context}, {name}: {v} committed twice (indexes {prev} and {index})");
            }
        }
        for v in acked.iter().filter(|_| tc.snapshot_every >= 10_000) {
            assert!(
                seen.contains_key(v),
                "{context}, {name}: acknowledged {v} missing from the log"
            );
        }
    }
}
