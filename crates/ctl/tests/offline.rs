//! `warrenctl forget_cluster_node --offline` (seed scenario 4): two clustered
//! `warren` processes are killed; the other node is gone for good; the
//! survivor's data directory is rewritten offline and it starts alone.

mod common;

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::{ctl, warren_bin};

/// A clustered node; returns the process and its (HTTP, peer) addresses.
fn start(name: &str, dir: &Path, secret: &Path, join: Option<&str>) -> (Child, String, String) {
    let mut cmd = Command::new(warren_bin());
    cmd.args(["--node-name", name, "--peer-addr", "127.0.0.1:0"])
        .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--prometheus-addr", "127.0.0.1:0", "--boot-wait", "30"])
        .arg("--cluster-secret-file")
        .arg(secret)
        .arg("--data-dir")
        .arg(dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(seed) = join {
        cmd.args(["--join", seed]);
    }
    let mut child = cmd.spawn().expect("start warren");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the ready line");
    let after = |key: &str| {
        line.split(key)
            .nth(1)
            .and_then(|s| s.split(',').next())
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|| panic!("no {key:?} in {line:?}"))
    };
    (child, after("HTTP on "), after("peers on "))
}

fn kill(mut child: Child) {
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
}

#[test]
fn offline_forget_lets_the_survivor_start_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "offline-forget-test-secret\n").unwrap();
    let (dir_a, dir_b) = (tmp.path().join("a"), tmp.path().join("b"));

    let (a, http_a, peer_a) = start("warren@a", &dir_a, &secret, None);
    let (b, _, _) = start("warren@b", &dir_b, &secret, Some(&peer_a));
    let status = ctl(&["--node", &http_a, "cluster_status"]);
    assert!(status.ok().contains("warren@b"), "{}", status.ok());
    kill(b);
    kill(a);

    // Usage errors are clear and change nothing.
    let missing = ctl(&["forget_cluster_node", "--offline", "warren@b"]);
    assert_eq!(missing.code, 64, "{}", missing.err);
    let bad = ctl(&[
        "forget_cluster_node",
        "--offline",
        "warren@zz",
        "--data-dir",
        dir_a.to_str().unwrap(),
        "--local-node",
        "warren@a",
    ]);
    assert_eq!(bad.code, 65, "{}", bad.err);
    assert!(bad.err.contains("warren@zz"), "{}", bad.err);

    let done = ctl(&[
        "forget_cluster_node",
        "--offline",
        "warren@b",
        "--data-dir",
        dir_a.to_str().unwrap(),
        "--local-node",
        "warren@a",
    ]);
    assert!(done.ok().contains("voters now warren@a"), "{}", done.ok());

    // A starts alone (without the edit it would wait for B's vote) and serves.
    let (a, http_a, _) = start("warren@a", &dir_a, &secret, None);
    let status = ctl(&["--node", &http_a, "cluster_status"]);
    assert!(!status.ok().contains("warren@b"), "{}", status.ok());
    let vhost = ctl(&["--node", &http_a, "add_vhost", "after-forget"]);
    vhost.ok();
    kill(a);
}
