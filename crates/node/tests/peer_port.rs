//! A node's peer port against strangers, over real sockets: frames announced
//! before the handshake cost it nothing (its memory is read from
//! `/proc/PID/status`), and by default only TLS peers with a certificate
//! from the cluster CA (derived from the secret when no CA directory is
//! given) get as far as the handshake. Every path between nodes (Raft,
//! queue rings, forwarding links) goes over that one port.

// The flood's measurements are printed for runs with `--no-capture`.
#![allow(clippy::print_stderr)]

use std::collections::BTreeSet;
use std::io::Write as _;
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Barrier};

use serde_json::json;
use warren_transport::{ClusterSecret, NodeName, PeerAddr, Transport, TransportConfig};
use warren_transport_tcp::TcpTransport;

mod peers;

use peers::{Peer, declare_durable, eventually, has, names, set_ha_all, test_root, three_with};

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

/// The mirrored queue of [`every_path_between_nodes_uses_the_peer_port`].
const QUEUE: &str = "ha.port";

/// The ports `p` was configured with: AMQP, HTTP, metrics, and the peer
/// port over TCP (QUIC's is UDP).
fn configured_ports(p: &Peer, transport: &str) -> BTreeSet<u16> {
    let port = |addr: &str| -> u16 {
        addr.rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {addr:?}"))
    };
    let mut ports = BTreeSet::from([p.amqp, port(&p.http), port(&p.metrics)]);
    if transport == "tcp" {
        ports.insert(port(&p.peers));
    }
    ports
}

/// [`QUEUE`] as `p`'s management API shows it (null if it cannot).
fn queue(p: &Peer) -> serde_json::Value {
    let (status, q) = p.http("GET", &format!("/api/queues/%2F/{QUEUE}"), None);
    if status == 200 {
        q
    } else {
        serde_json::Value::Null
    }
}

/// The synchronised mirrors of [`QUEUE`] as `p` sees them.
fn synchronised(p: &Peer) -> Vec<String> {
    names(&queue(p), "synchronised_slave_nodes")
}

/// Publishes `bodies` persistently into [`QUEUE`] through `p`, each confirmed.
async fn publish(p: &Peer, bodies: &[String]) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let conn = lapin::Connection::connect(&p.amqp_url(), lapin::ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    for body in bodies {
        let confirm = ch
            .basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish");
        assert!(confirm.await.expect("a confirm").is_ack(), "{body} nacked");
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// Consumes [`QUEUE`] through `p` until `want` bodies came; returns them.
async fn consume(p: &Peer, want: usize) -> BTreeSet<String> {
    use futures::StreamExt as _;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions};
    let conn = lapin::Connection::connect(&p.amqp_url(), lapin::ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let mut consumer = ch
        .basic_consume(
            QUEUE.into(),
            "port-test".into(),
            BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut seen = BTreeSet::new();
    while seen.len() < want {
        let d = tokio::time::timeout(std::time::Duration::from_secs(60), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("nothing delivered for a minute after {seen:?}"))
            .expect("the consumer is open")
            .expect("a delivery");
        seen.insert(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    let _ = conn.close(200, "bye".into()).await;
    seen
}

/// Three members over TCP and over QUIC: each listens on its configured
/// ports only (the queue rings and the forwarding links share the peer
/// port with Raft), a mirrored queue mastered on A gets synchronised
/// mirrors and serves publishers on C and consumers on B, and after B is
/// SIGKILLed and started again on the same addresses, the rings reach it
/// (its mirror is synchronised again) and so do the links (a consumer
/// through it receives what was published while it was down).
#[test]
fn every_path_between_nodes_uses_the_peer_port() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    for transport in ["tcp", "quic"] {
        let root = test_root();
        let extra = ["--transport", transport];
        let (secret, mut nodes) = three_with(root.path(), &extra);
        set_ha_all(&nodes[0]);
        declare_durable(&rt, &nodes[0], QUEUE);
        eventually("two synchronised mirrors", || {
            synchronised(&nodes[0]).len() == 2
        });
        for n in &nodes {
            assert_eq!(
                n.listening_ports(),
                configured_ports(n, transport),
                "{transport}: the ports {} listens on",
                n.name
            );
        }
        let first: Vec<String> = (0..50).map(|i| format!("first-{i}")).collect();
        rt.block_on(publish(&nodes[2], &first));
        assert_eq!(
            rt.block_on(consume(&nodes[1], first.len())),
            first.iter().cloned().collect(),
            "{transport}: a consumer on B"
        );

        eventually("the master has every ack", || {
            queue(&nodes[0])["messages"] == 0
        });
        nodes[1].kill();
        eventually("B's mirror is dropped", || {
            !synchronised(&nodes[0]).contains(&"warren@b".to_owned())
        });
        let second: Vec<String> = (0..50).map(|i| format!("second-{i}")).collect();
        rt.block_on(publish(&nodes[2], &second));
        nodes[1] = nodes[1].restart(&secret, &extra);
        // Consumers start at once: B may register them with the master
        // before the master's node sees B up again; the master's first
        // dial back to B then fails, dropping them, and B asks again on
        // the master's first session to it.
        eventually("the restarted B's mirror is synchronised again", || {
            synchronised(&nodes[0]).contains(&"warren@b".to_owned())
        });
        assert_eq!(
            nodes[1].listening_ports(),
            configured_ports(&nodes[1], transport),
            "{transport}: the ports the restarted B listens on"
        );
        assert_eq!(
            rt.block_on(consume(&nodes[1], second.len())),
            second.iter().cloned().collect(),
            "{transport}: a consumer on the restarted B"
        );
    }
}
