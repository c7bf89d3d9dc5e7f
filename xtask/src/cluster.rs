//! `cargo xtask cluster up|down`: a local cluster of `warren` processes.
//!
//! Node *i* (1-based) listens on 127.0.0.*i* with the standard ports (AMQP
//! 5672, management 15672, metrics 15692, peers 25672) and keeps its data in
//! `target/cluster/node<i>`. Nodes 2… join node 1. Once the cluster is formed
//! an example policy mirrors every queue whose name starts with `ha.` to all
//! nodes. `up` keeps running until Ctrl-C or `cargo xtask cluster down`
//! (run from another terminal): either stops the nodes one at a time.
//! Each node's log, `target/cluster/node<i>.log`, is appended to, a line
//! marking every start.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::node::{NodeArgs, http, http_json, wait_ready};

/// The example mirroring policy `up` sets: queues named `ha.*` on every node.
const EXAMPLE_POLICY: &str = r#"{"pattern":"^ha\\.","definition":{"ha-mode":"all","ha-sync-mode":"automatic"},"apply-to":"queues"}"#;

/// Runs `cluster up|down`.
pub(crate) fn run(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    match rest {
        ["up", flags @ ..] => up(root, flags),
        ["down", ..] => down(root),
        _ => {
            bail!("usage: cargo xtask cluster up [--nodes N] [--transport tcp|quic] | cluster down")
        }
    }
}

fn flag<'a>(flags: &[&'a str], name: &str) -> Option<&'a str> {
    flags
        .iter()
        .position(|f| *f == name)
        .and_then(|i| flags.get(i + 1).copied())
}

fn cluster_dir(root: &Path) -> PathBuf {
    root.join("target/cluster")
}

/// One started node.
struct Node {
    index: usize,
    name: String,
    ip: String,
    child: Child,
}

fn up(root: &Path, flags: &[&str]) -> anyhow::Result<()> {
    let nodes: usize = flag(flags, "--nodes")
        .unwrap_or("3")
        .parse()
        .context("--nodes takes a number")?;
    if !(1..=9).contains(&nodes) {
        bail!("--nodes must be between 1 and 9");
    }
    let transport = flag(flags, "--transport").unwrap_or("tcp");
    if !["tcp", "quic"].contains(&transport) {
        bail!(
            "--transport must be tcp or quic (the in-memory transport runs inside one process: see the cluster crate's tests)"
        );
    }
    println!("[1/4] building warren and warrenctl (release)…");
    crate::cargo_step(
        "build",
        &[
            "build",
            "--release",
            "-p",
            "warren-node",
            "-p",
            "warren-ctl",
            "--bins",
        ],
    )?;
    let bin = root.join("target/release/warren");

    let dir = cluster_dir(root);
    std::fs::create_dir_all(&dir)?;
    let secret = dir.join("cluster-secret");
    if !secret.exists() {
        let nonce = format!(
            "{:x}{:x}",
            std::process::id(),
            Instant::now().elapsed().as_nanos()
        );
        std::fs::write(&secret, format!("warren-local-{nonce}-{}\n", dir.display()))?;
    }

    // From here a signal stops the nodes (in their own process group, they
    // do not get the terminal's Ctrl-C) one at a time.
    let stop = stop_signal()?;
    println!("[2/4] starting {nodes} node(s) over {transport}…");
    // A cluster started before restarts from its data directories: each
    // node waits for a majority before it is ready, so all are started
    // before any is waited for. A new cluster forms one node at a time.
    let restart = dir.join("node1").join("raft").exists();
    let mut started: Vec<Node> = Vec::new();
    let mut waiting = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        for i in 1..=nodes {
            let ip = format!("127.0.0.{i}");
            let name = format!("warren@{ip}");
            let data = dir.join(format!("node{i}"));
            let ca = dir.join("ca");
            let mut cmd = Command::new(&bin);
            NodeArgs {
                name: &name,
                amqp: format!("{ip}:5672"),
                http: format!("{ip}:15672"),
                metrics: format!("{ip}:15692"),
                peer: format!("{ip}:25672"),
                transport: Some(transport),
                secret: &secret,
                data: &data,
                // The first node creates the cluster CA here; the others use it.
                ca_dir: (transport == "quic").then_some(ca.as_path()),
                join: (i > 1).then(|| "127.0.0.1:25672".to_owned()),
            }
            .apply(&mut cmd);
            let log = open_log(&dir.join(format!("node{i}.log")), &name)?;
            // A process group of its own: Ctrl-C reaches the xtask alone,
            // which stops the nodes one at a time (see `stop_in_order`).
            cmd.stdout(Stdio::piped()).stderr(log).process_group(0);
            let mut child = cmd
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            let stdout = child.stdout.take().context("node stdout")?;
            started.push(Node {
                index: i,
                name: name.clone(),
                ip: ip.clone(),
                child,
            });
            if restart {
                waiting.push((stdout, name));
            } else {
                wait_ready(stdout, &name, Duration::from_secs(120), Some(&stop))?;
                println!("      {name} ready");
            }
        }
        for (stdout, name) in waiting.drain(..) {
            wait_ready(stdout, &name, Duration::from_secs(120), Some(&stop))?;
            println!("      {name} ready (restarted from its data directory)");
        }
        std::fs::write(
            dir.join("pids"),
            started
                .iter()
                .map(|n| format!("{}\n", n.child.id()))
                .collect::<String>(),
        )?;
        println!(
            "[3/4] setting the example policy ha-all (queues named ha.* mirrored to all nodes)…"
        );
        let (status, answer) = http(
            "127.0.0.1:15672",
            "PUT",
            "/api/policies/%2F/ha-all",
            Some(EXAMPLE_POLICY),
        )?;
        if !(200..300).contains(&status) {
            bail!("setting the policy ha-all answered {status}: {answer}");
        }
        println!("[4/4] cluster up:");
        for n in &started {
            println!(
                "      {}  AMQP amqp://guest:guest@{ip}:5672/  management http://{ip}:15672/  metrics http://{ip}:15692/metrics  (log {})",
                n.name,
                dir.join(format!("node{}.log", n.index)).display(),
                ip = n.ip
            );
        }
        println!(
            "      try: target/release/warrenctl --node 127.0.0.1:15672 list_queues name pid slave_pids synchronised_slave_pids"
        );
        println!("      Ctrl-C (or `cargo xtask cluster down`) stops every node.");
        Ok(())
    })();
    if let Err(e) = result {
        stop_all(&mut started);
        return Err(e.context(format!("node logs are in {}", dir.display())));
    }
    let mut exited = vec![false; started.len()];
    while exited.contains(&false) {
        if stop.recv_timeout(Duration::from_millis(200)).is_ok() {
            stop_all(&mut started);
        }
        for (n, exited) in started.iter_mut().zip(&mut exited) {
            if !*exited && let Some(status) = n.child.try_wait()? {
                println!("{} exited: {status}", n.name);
                *exited = true;
            }
        }
    }
    let _ = std::fs::remove_file(dir.join("pids"));
    Ok(())
}

/// Stops the started `nodes` (node 1 first) one at a time
/// ([`stop_in_order`]); kills what is left if one does not stop.
fn stop_all(nodes: &mut [Node]) {
    let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    let stopped = stop_in_order(&pids, |i| {
        nodes[i]
            .child
            .try_wait()
            .map_or(true, |status| status.is_some())
    });
    if let Err(e) = stopped {
        eprintln!("{e:#}; killing the nodes left");
        for n in nodes.iter_mut() {
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
    }
}

/// Opens a node's log for appending — the log of an earlier run, a crash's
/// last lines with it, stays — and marks the start of this run in it.
fn open_log(path: &Path, node: &str) -> anyhow::Result<File> {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let now = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    writeln!(
        log,
        "===== {now} {node} starting (cargo xtask cluster up) ====="
    )?;
    Ok(log)
}

/// A receiver that gets `()` when the xtask is asked to stop (SIGINT from
/// Ctrl-C, SIGTERM, or SIGHUP when its terminal closes).
fn stop_signal() -> anyhow::Result<mpsc::Receiver<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Registered here, before `up` waits, so that no signal is missed.
    let mut signals = rt.block_on(async {
        Ok::<_, std::io::Error>([
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
            signal(SignalKind::hangup())?,
        ])
    })?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        rt.block_on(async move {
            let [int, term, hup] = &mut signals;
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
                if tx.send(()).is_err() {
                    break;
                }
            }
        });
    });
    Ok(rx)
}

fn down(root: &Path) -> anyhow::Result<()> {
    let pids_file = cluster_dir(root).join("pids");
    let text = std::fs::read_to_string(&pids_file)
        .with_context(|| format!("no running cluster ({} missing)", pids_file.display()))?;
    let pids: Vec<u32> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {}", pids_file.display()))?;
    let alive = |pid: u32| {
        Command::new("kill")
            .args(["-0", &pid.to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    stop_in_order(&pids, |i| !alive(pids[i]))?;
    println!("every node stopped");
    let _ = std::fs::remove_file(pids_file);
    Ok(())
}

/// Stops the nodes `pids` (node 1 first) one at a time, each once the one
/// before has exited (`exited(i)` tells whether `pids[i]` has): the last
/// started first, the Raft leader last.
///
/// A node stopping gracefully first hands its Raft vote over, which needs a
/// majority of the voters still running: stopped all at once, the last ones
/// find none and wait out the command timeout with a warning. One at a
/// time, every hand-off finds a majority; the leader, stopping last as the
/// last voter, hands nothing over (no election), and is the node to start
/// first again. Waiting also leaves the ports free for a `cluster up` right
/// after.
fn stop_in_order(pids: &[u32], mut exited: impl FnMut(usize) -> bool) -> anyhow::Result<()> {
    for i in stop_order(pids.len(), leader(pids.len())) {
        if exited(i) {
            continue;
        }
        let pid = pids[i];
        println!("stopping node {} (process {pid}, SIGTERM)", i + 1);
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !exited(i) {
            if Instant::now() > deadline {
                bail!("node process {pid} still running 60 s after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// The order to stop `nodes` nodes in (indices from 0): the last started
/// first, `leader` (an index) last.
fn stop_order(nodes: usize, leader: Option<usize>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..nodes).rev().filter(|i| Some(*i) != leader).collect();
    order.extend(leader.filter(|l| *l < nodes));
    order
}

/// The index (from 0) of the metadata store's leader among `nodes` nodes,
/// as the first node to answer `GET /api/cluster` knows it.
fn leader(nodes: usize) -> Option<usize> {
    (1..=nodes).find_map(|i| {
        let v = http_json(&format!("127.0.0.{i}:15672"), "/api/cluster").ok()??;
        let name = v.get("leader")?.as_str()?;
        let k: usize = name.strip_prefix("warren@127.0.0.")?.parse().ok()?;
        (1..=nodes).contains(&k).then(|| k - 1)
    })
}

#[cfg(test)]
mod tests {
    use super::stop_order;

    #[test]
    fn the_last_started_stop_first_and_the_leader_last() {
        assert_eq!(stop_order(3, None), [2, 1, 0]);
        assert_eq!(stop_order(3, Some(0)), [2, 1, 0]);
        assert_eq!(stop_order(3, Some(1)), [2, 0, 1]);
        assert_eq!(stop_order(5, Some(4)), [3, 2, 1, 0, 4]);
        assert_eq!(stop_order(1, Some(0)), [0]);
        // A leader index out of range (a stale answer) changes nothing.
        assert_eq!(stop_order(2, Some(7)), [1, 0]);
    }
}
