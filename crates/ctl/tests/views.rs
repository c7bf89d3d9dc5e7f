//! What operators read is true: `warrenctl cluster_status` and
//! `/api/nodes` on a real three-node cluster with client connections open —
//! the protocols a listener serves, every member's peer listener, the links
//! a node has, its file descriptors, sockets and tasks; and nothing shown
//! for what a node cannot know of another (a queue on a stopped member is
//! "down", its counts not shown).

mod common;

use common::{Node, eventually};
use lapin::{Connection, ConnectionProperties};
use serde_json::Value;

/// The port of a `127.0.0.1:PORT` address.
fn port(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// `/api/nodes` as `n` answers it: the node itself first.
fn nodes(n: &Node) -> Vec<Value> {
    let (status, v) = n.http("GET", "/api/nodes", None);
    assert_eq!(status, 200, "{v}");
    v.as_array().expect("a list of nodes").clone()
}

/// The names in the asked node's `cluster_links`, sorted.
fn links(n: &Node) -> Vec<String> {
    let mut names: Vec<String> = nodes(n)[0]["cluster_links"]
        .as_array()
        .expect("cluster_links")
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// The soft open-files limit of process `pid`, as Linux reports it.
fn open_files_limit(pid: &str) -> u64 {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    line["Max open files".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn cluster_status_and_nodes_show_true_values() {
    let root = tempfile::tempdir().unwrap();
    let secret = root.path().join("secret");
    std::fs::write(&secret, "views-test-secret\n").unwrap();
    let a = Node::start_clustered("warren@a", &root.path().join("a"), &secret);
    let b = Node::start_joining("warren@b", &root.path().join("b"), &secret, &a.peers);
    let mut c = Node::start_joining("warren@c", &root.path().join("c"), &secret, &a.peers);

    eventually("a linked to b and c", || {
        links(&a) == ["warren@b", "warren@c"]
    });
    let me = &nodes(&a)[0];
    assert_eq!(me["name"], "warren@a");
    for (link, peers) in me["cluster_links"].as_array().unwrap().iter().zip([&b, &c]) {
        assert_eq!(link["peer_addr"], "127.0.0.1", "{link}");
        assert_eq!(link["peer_port"], port(&peers.peers), "{link}");
    }

    // cluster_status: AMQP 0-9-1 only, and every member's peer listener.
    let text = a.ctl(&["cluster_status"]).ok().to_owned();
    assert!(!text.contains("AMQP 1.0"), "{text}");
    assert!(
        text.contains(&format!(
            "Node: warren@a, interface: 127.0.0.1, port: {}, protocol: amqp, purpose: AMQP 0-9-1\n",
            a.amqp_port
        )),
        "{text}"
    );
    for (name, n) in [("warren@a", &a), ("warren@b", &b), ("warren@c", &c)] {
        let line = format!(
            "Node: {name}, interface: 127.0.0.1, port: {}, protocol: clustering, purpose: inter-node communication\n",
            port(&n.peers)
        );
        assert!(text.contains(&line), "{line:?} in {text}");
    }
    // The other members' client listeners, as they recorded them.
    for (name, n) in [("warren@b", &b), ("warren@c", &c)] {
        let lines = [
            format!(
                "Node: {name}, interface: 127.0.0.1, port: {}, protocol: amqp, purpose: AMQP 0-9-1\n",
                n.amqp_port
            ),
            format!(
                "Node: {name}, interface: 127.0.0.1, port: {}, protocol: http/prometheus, purpose: Prometheus exporter API over HTTP\n",
                port(&n.metrics)
            ),
        ];
        eventually("every member's listeners in cluster_status", || {
            let text = a.ctl(&["cluster_status"]).ok().to_owned();
            lines.iter().all(|l| text.contains(l.as_str()))
        });
    }
    let json: Value =
        serde_json::from_str(b.ctl(&["--formatter", "json", "cluster_status"]).ok()).unwrap();
    let clustering = json["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["protocol"] == "clustering")
        .count();
    assert_eq!(clustering, 3, "{json}");

    // Process and socket counts of the asked node, with clients connected.
    const CLIENTS: u64 = 5;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let conns: Vec<Connection> = rt.block_on(async {
        let mut conns = Vec::new();
        for _ in 0..CLIENTS {
            conns.push(
                Connection::connect(&a.amqp_url(), ConnectionProperties::default())
                    .await
                    .expect("connect to a"),
            );
        }
        conns
    });
    let me = nodes(&a)[0].clone();
    let pid = me["os_pid"].as_str().unwrap();
    let limit = open_files_limit(pid);
    let fds = me["fd_used"].as_u64().expect("fd_used");
    let sockets = me["sockets_used"].as_u64().expect("sockets_used");
    let tasks = me["proc_used"].as_u64().expect("proc_used");
    assert_eq!(me["fd_total"], limit, "{me}");
    assert!(fds > sockets && fds <= limit, "{me}");
    // Client connections only, as RabbitMQ counts them, against the
    // budget the open-files limit leaves them.
    assert!(sockets >= CLIENTS, "{me}");
    let budget = me["sockets_total"].as_u64().expect("sockets_total");
    assert!(sockets <= budget && budget < limit, "{me}");
    // A task per client connection at least.
    assert!(tasks >= CLIENTS, "{me}");
    let text = a.ctl(&["status"]).ok().to_owned();
    assert!(text.contains(&format!(", limit: {limit}\n")), "{text}");
    assert!(text.contains("\nSockets: "), "{text}");
    assert!(text.contains(&format!(", limit: {budget}\n")), "{text}");

    rt.block_on(async {
        for conn in conns {
            conn.close(200, "bye".into()).await.unwrap();
        }
    });
    eventually("the clients' sockets closed", || {
        nodes(&a)[0]["sockets_used"].as_u64().unwrap() <= sockets - CLIENTS
    });

    // Each other running node describes itself: what a shows of b is what
    // b shows of itself.
    let of_b = nodes(&b)[0].clone();
    for other in &nodes(&a)[1..] {
        for key in [
            "cluster_links",
            "partitions",
            "fd_used",
            "sockets_used",
            "proc_used",
            "os_pid",
        ] {
            assert!(other.get(key).is_some(), "{key} missing in {other}");
        }
        if other["name"] == "warren@b" {
            assert_eq!(other["os_pid"], of_b["os_pid"], "{other}");
        }
    }

    // A durable queue served by c, with a message in it.
    rt.block_on(async {
        let conn = Connection::connect(&c.amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect to c");
        let ch = conn.create_channel().await.unwrap();
        let durable = lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare("on.c".into(), durable, Default::default())
            .await
            .unwrap();
        ch.basic_publish(
            "".into(),
            "on.c".into(),
            Default::default(),
            b"m",
            lapin::BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    });
    eventually("a shows on.c running with its message", || {
        let (_, q) = a.http("GET", "/api/queues/%2F/on.c", None);
        q["state"] == "running" && q["messages"] == 1
    });

    // A member that is gone is no longer a link, and its queue is down:
    // what it holds is not known (RabbitMQ's `state` "down", no counts).
    c.terminate();
    eventually("a linked to b only", || links(&a) == ["warren@b"]);
    eventually("a shows on.c down", || {
        let (_, q) = a.http("GET", "/api/queues/%2F/on.c", None);
        q["state"] == "down"
    });
    let (_, q) = a.http("GET", "/api/queues/%2F/on.c", None);
    assert_eq!(q["node"], "warren@c", "{q}");
    assert!(q.get("messages").is_none(), "{q}");
    let rows = a.ctl(&["list_queues", "name", "state", "messages"]).rows();
    assert!(
        rows.contains(&vec!["on.c".to_owned(), "down".to_owned(), String::new()]),
        "{rows:?}"
    );
}
