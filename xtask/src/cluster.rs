//! `cargo xtask cluster up|down`: a local cluster of `warren` processes.
//!
//! Node *i* (1-based) listens on 127.0.0.*i* with the standard ports (AMQP
//! 5672, management 15672, metrics 15692, peers 25672) and keeps its data in
//! `target/cluster/node<i>`. Nodes 2… join node 1. Once the cluster is formed
//! an example policy mirrors every queue whose name starts with `ha.` to all
//! nodes. `up` keeps running until Ctrl-C (which stops every node) or
//! `cargo xtask cluster down` (run from another terminal).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::node::{NodeArgs, wait_ready};

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
            let log = std::fs::File::create(dir.join(format!("node{i}.log")))?;
            cmd.stdout(Stdio::piped()).stderr(log);
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
                wait_ready(stdout, &name, Duration::from_secs(120))?;
                println!("      {name} ready");
            }
        }
        for (stdout, name) in waiting.drain(..) {
            wait_ready(stdout, &name, Duration::from_secs(120))?;
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
        http_put(
            "127.0.0.1:15672",
            "/api/policies/%2F/ha-all",
            EXAMPLE_POLICY,
        )?;
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
        for n in &mut started {
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
        return Err(e.context(format!("node logs are in {}", dir.display())));
    }
    for n in &mut started {
        let status = n.child.wait()?;
        println!("{} exited: {status}", n.name);
    }
    let _ = std::fs::remove_file(dir.join("pids"));
    Ok(())
}

/// PUT `body` to a node's management API as guest.
fn http_put(addr: &str, path: &str, body: &str) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "PUT {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    s.read_to_string(&mut response)?;
    let status = response.lines().next().unwrap_or_default();
    if !(status.contains(" 201") || status.contains(" 204") || status.contains(" 200")) {
        bail!("PUT {path} on {addr} answered {status}: {response}");
    }
    Ok(())
}

fn down(root: &Path) -> anyhow::Result<()> {
    let pids_file = cluster_dir(root).join("pids");
    let text = std::fs::read_to_string(&pids_file)
        .with_context(|| format!("no running cluster ({} missing)", pids_file.display()))?;
    let pids: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
    for pid in &pids {
        println!("stopping node process {pid} (SIGTERM)");
        let _ = Command::new("kill").args(["-TERM", pid]).status();
    }
    // A node hands its Raft vote over before it exits (up to the command
    // timeout when the others are stopping too): wait, so that a `cluster
    // up` right after finds the ports free.
    let alive = |pid: &str| {
        Command::new("kill")
            .args(["-0", pid])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while pids.iter().any(|p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let left: Vec<&&str> = pids.iter().filter(|p| alive(p)).collect();
    if !left.is_empty() {
        bail!("node processes {left:?} still running 60 s after SIGTERM");
    }
    println!("every node stopped");
    let _ = std::fs::remove_file(pids_file);
    Ok(())
}
