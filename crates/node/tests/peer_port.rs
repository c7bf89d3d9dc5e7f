//! A node's peer port against strangers, over real sockets: frames announced
//! before the handshake cost it nothing (its memory is read from
//! `/proc/PID/status`), and by default only TLS peers with a certificate
//! from the cluster CA (derived from the secret when no CA directory is
//! given) get as far as the handshake.

// The flood's measurements are printed for runs with `--no-capture`.
#![allow(clippy::print_stderr)]

use std::io::Write as _;
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Barrier};

use serde_json::json;
use warren_transport::{ClusterSecret, NodeName, PeerAddr, Transport, TransportConfig};
use warren_transport_tcp::TcpTransport;

mod peers;

use peers::{Peer, eventually, has, names, test_root};

const SECRET: &str = "peer-port-secret";

/// A `VmRSS`/`VmHWM`-style line of `/proc/PID/status`, in MiB.
fn vm_mib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"));
    kib / 1024
}

/// `n` strangers at once each announce a 16 MiB frame on `addr` and send
/// all of it but its last byte (so that a node buffering frames before the
/// handshake would hold every one), then hold their sockets until all are done.
fn flood(addr: &str, n: usize) {
    const FRAME: usize = 16 << 20;
    let done = Arc::new(Barrier::new(n));
    let strangers: Vec<_> = (0..n)
        .map(|_| {
            let (addr, done) = (addr.to_owned(), done.clone());
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).expect("connect to the peer port");
                let chunk = vec![0x5a; 1 << 20];
                let sent = s.write_all(&(FRAME as u32).to_be_bytes()).is_ok()
                    && (0..FRAME / chunk.len() - 1).all(|_| s.write_all(&chunk).is_ok())
                    && s.write_all(&chunk[1..]).is_ok();
                done.wait();
                sent
            })
        })
        .collect();
    let sent = strangers
        .into_iter()
        .map(|t| t.join().expect("a stranger"))
        .filter(|&sent| sent)
        .count();
    eprintln!("{sent} of {n} strangers got all but the last byte of their 16 MiB frame written");
}

fn start(root: &Path, name: &str, join: Option<&str>, peer_tls: &str) -> Peer {
    let secret = root.join("secret");
    std::fs::write(&secret, SECRET).expect("secret file");
    let dir = root.join(name.trim_start_matches("warren@"));
    Peer::start_with(name, &dir, &secret, join, &["--peer-tls", peer_tls])
}

/// 100 strangers announcing (and sending) 16 MiB frames on a member's peer
/// port before any handshake: the member refuses each at its length prefix
/// (plain TCP) or at its first TLS record, its peak memory barely moves,
/// and it goes on serving its cluster: metadata replicates and a new member
/// joins through that very port.
#[test]
fn huge_frames_before_the_handshake_are_refused_without_buffering() {
    for peer_tls in ["off", "on"] {
        let root = test_root();
        let a = start(root.path(), "warren@a", None, peer_tls);
        let b = start(root.path(), "warren@b", Some(&a.peers), peer_tls);
        eventually("two running members", || {
            names(&a.get("/api/cluster"), "running_nodes").len() == 2
        });

        let before = vm_mib(a.pid(), "VmRSS");
        flood(&a.peers, 100);
        let peak = vm_mib(a.pid(), "VmHWM");
        eprintln!("--peer-tls {peer_tls}: VmRSS before {before} MiB, VmHWM after {peak} MiB");
        assert!(
            peak < before + 100,
            "--peer-tls {peer_tls}: the flood took the node from {before} MiB to a peak of {peak} MiB"
        );

        assert_eq!(
            b.http("PUT", "/api/vhosts/after-flood", Some(&json!({}))).0,
            201
        );
        eventually("the vhost replicated to the flooded node", || {
            has(&a.get("/api/vhosts"), |v| v["name"] == "after-flood")
        });
        let c = start(root.path(), "warren@c", Some(&a.peers), peer_tls);
        eventually("a member joined through the flooded port", || {
            names(&c.get("/api/cluster"), "running_nodes").len() == 3
        });
    }
}

/// A Warren dialer that knows the secret but speaks plain TCP: refused by a
/// node's peer port by default, accepted only with `--peer-tls off`.
#[test]
fn plaintext_dialers_are_refused_unless_peer_tls_is_off() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut cfg = TransportConfig::new(
        NodeName::new("warren@plaintext").expect("name"),
        ClusterSecret::new(SECRET),
    );
    cfg.handshake_timeout = std::time::Duration::from_secs(30);
    let plain = TcpTransport::new(cfg);
    let root = test_root();

    let default = start(root.path(), "warren@tls", None, "on");
    let refused = rt.block_on(plain.connect(&PeerAddr::new(&default.peers)));
    assert!(
        refused.is_err(),
        "a default node accepted plain TCP: {refused:?}"
    );

    let trusting = start(root.path(), "warren@plain", None, "off");
    let conn = rt
        .block_on(plain.connect(&PeerAddr::new(&trusting.peers)))
        .expect("a --peer-tls off node accepts plain TCP");
    assert_eq!(conn.peer_node().as_str(), "warren@plain");
}

/// Without `--cluster-ca-dir` every node derives the cluster CA from the
/// secret, over QUIC as over TCP: two QUIC members form a cluster with
/// nothing but the secret file in common.
#[test]
fn quic_members_share_the_ca_derived_from_the_secret() {
    let root = test_root();
    let secret = root.path().join("secret");
    std::fs::write(&secret, SECRET).expect("secret file");
    let quic = ["--transport", "quic"];
    let a = Peer::start_with("warren@qa", &root.path().join("qa"), &secret, None, &quic);
    let b = Peer::start_with(
        "warren@qb",
        &root.path().join("qb"),
        &secret,
        Some(&a.peers),
        &quic,
    );
    eventually("two running QUIC members", || {
        names(&b.get("/api/cluster"), "running_nodes").len() == 2
    });
}
