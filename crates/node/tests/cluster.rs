//! Clustered `warren` processes on 127.0.0.1: forming a cluster with
//! `--join`, metadata declared on one node visible on every node, cluster
//! status, `forget_cluster_node` after a SIGKILL, a graceful stop and
//! restart, each node's metrics and listeners, and the command line's
//! refusals.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};

use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use serde_json::{Value, json};

mod peers;

use peers::{Peer, declare_durable, eventually, field, has, names, set_ha_all, three};

#[test]
fn metadata_declared_anywhere_is_seen_everywhere() {
    let root = tempfile::tempdir().unwrap();
    let (secret, mut nodes) = three(root.path());
    let st = nodes[2].get("/api/cluster");
    assert_eq!(
        names(&st, "disk_nodes"),
        vec!["warren@a", "warren@b", "warren@c"]
    );

    // Through the management API of b.
    let b = &nodes[1];
    assert_eq!(b.http("PUT", "/api/vhosts/v2", Some(&json!({}))).0, 201);
    let user = json!({"password": "s3cret", "tags": "management"});
    assert!((200..300).contains(&b.http("PUT", "/api/users/alice", Some(&user)).0));
    let perms = json!({"configure": ".*", "write": ".*", "read": ".*"});
    assert!((200..300).contains(&b.http("PUT", "/api/permissions/%2F/alice", Some(&perms)).0));
    let policy = json!({"pattern": "^ha\\.", "definition": {"ha-mode": "all"}});
    assert!((200..300).contains(&b.http("PUT", "/api/policies/%2F/ha-all", Some(&policy)).0));

    // Through AMQP on c.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", nodes[2].amqp);
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("connect to c");
        let ch = conn.create_channel().await.unwrap();
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        ch.exchange_declare(
            "x".into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap();
        let q = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare("ha.q".into(), q, FieldTable::default())
            .await
            .unwrap();
        ch.queue_bind(
            "ha.q".into(),
            "x".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    });

    for n in &nodes {
        eventually("the metadata everywhere", || {
            let vhosts = n.get("/api/vhosts");
            let users = n.get("/api/users");
            let policies = n.get("/api/policies");
            let queues = n.get("/api/queues");
            let exchanges = n.get("/api/exchanges");
            let bindings = n.get("/api/bindings");
            has(&vhosts, |v| v["name"] == "v2")
                && has(&users, |u| u["name"] == "alice")
                && has(&policies, |p| p["name"] == "ha-all")
                && has(&queues, |q| {
                    q["name"] == "ha.q" && q["node"] == "warren@c" && q["policy"] == "ha-all"
                })
                && has(&exchanges, |x| x["name"] == "x" && x["durable"] == true)
                && has(&bindings, |bd| {
                    bd["source"] == "x" && bd["destination"] == "ha.q" && bd["routing_key"] == "k"
                })
        });
    }
    // alice, created on b, logs in on a.
    rt.block_on(async {
        let url = format!("amqp://alice:s3cret@127.0.0.1:{}/%2f", nodes[0].amqp);
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("alice connects to a");
        conn.close(200, "bye".into()).await.unwrap();
    });

    // Unbound and deleted on a: gone everywhere.
    rt.block_on(async {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", nodes[0].amqp);
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("connect to a");
        let ch = conn.create_channel().await.unwrap();
        ch.queue_unbind("ha.q".into(), "x".into(), "k".into(), FieldTable::default())
            .await
            .unwrap();
        ch.exchange_delete("x".into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    });
    for n in &nodes {
        eventually("the unbind and exchange delete everywhere", || {
            !has(&n.get("/api/bindings"), |bd| bd["source"] == "x")
                && !has(&n.get("/api/exchanges"), |x| x["name"] == "x")
        });
    }
    assert_eq!(nodes[0].http("DELETE", "/api/queues/%2F/ha.q", None).0, 204);
    assert_eq!(nodes[0].http("DELETE", "/api/vhosts/v2", None).0, 204);
    for n in &nodes {
        eventually("the deletes everywhere", || {
            !has(&n.get("/api/queues"), |q| q["name"] == "ha.q")
                && !has(&n.get("/api/vhosts"), |v| v["name"] == "v2")
        });
    }

    // c dies: a sees it down, then forgets it.
    nodes[2].kill();
    eventually("c reported down", || {
        names(&nodes[0].get("/api/cluster"), "running_nodes") == vec!["warren@a", "warren@b"]
    });
    let (status, v) = nodes[0].http("DELETE", "/api/cluster/nodes/warren@c", None);
    assert_eq!(status, 204, "{v}");
    for n in &nodes[..2] {
        eventually("c forgotten", || {
            names(&n.get("/api/cluster"), "disk_nodes") == vec!["warren@a", "warren@b"]
        });
    }
    // A running node cannot be forgotten.
    let (status, _) = nodes[0].http("DELETE", "/api/cluster/nodes/warren@b", None);
    assert_eq!(status, 400);

    // b stops gracefully and starts again from its data directory.
    nodes[1].terminate();
    let dir = nodes[1].dir.clone();
    nodes[1] = Peer::start("warren@b", &dir, &secret, None);
    eventually("b back as a voter", || {
        let st = nodes[0].get("/api/cluster");
        names(&st, "running_nodes") == vec!["warren@a", "warren@b"]
            && has(&st["members"], |m| {
                m["name"] == "warren@b" && m["voter"] == true
            })
    });
    // And b still has the metadata.
    assert!(has(&nodes[1].get("/api/users"), |u| u["name"] == "alice"));
}

/// The series of `queue` itself on a node's `/metrics` (not those of a
/// replica's view of its ring, which carry the node).
fn queue_series(p: &Peer, queue: &str) -> Vec<String> {
    let text = ureq::get(&format!("http://{}/metrics", p.metrics))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let label = format!("queue=\"{queue}\"}}");
    text.lines()
        .filter(|l| l.contains(&label))
        .map(str::to_owned)
        .collect()
}

#[test]
fn each_node_exports_the_queues_it_serves_and_lists_every_listener() {
    let root = tempfile::tempdir().unwrap();
    let (_secret, nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // ha.q mirrored everywhere with its master on a; plain on b alone.
    declare_durable(&rt, &nodes[0], "ha.q");
    declare_durable(&rt, &nodes[1], "plain");
    // Five messages into each through c, which serves neither.
    rt.block_on(async {
        let conn = Connection::connect(&nodes[2].amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for q in ["ha.q", "plain"] {
            for _ in 0..5 {
                ch.basic_publish(
                    "".into(),
                    q.into(),
                    BasicPublishOptions::default(),
                    b"m",
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            }
        }
        conn.close(200, "bye".into()).await.unwrap();
    });
    let published =
        |q: &str| format!("rabbitmq_queue_messages_published_total{{vhost=\"/\",queue=\"{q}\"}}");
    eventually("the masters count the publishes", || {
        nodes[0].metric(&published("ha.q")) == Some(5)
            && nodes[1].metric(&published("plain")) == Some(5)
    });
    // Each queue once in the cluster: on its master's node only.
    for (q, master) in [("ha.q", 0), ("plain", 1)] {
        for (i, n) in nodes.iter().enumerate() {
            let series = queue_series(n, q);
            assert_eq!(
                !series.is_empty(),
                i == master,
                "{q} on {}: {series:?}",
                n.name
            );
        }
    }
    // Each replica of ha.q reports its own view of the ring, with its node.
    for n in &nodes {
        let ring = format!(
            "warren_queue_ring_view{{vhost=\"/\",queue=\"ha.q\",node=\"{}\"}}",
            n.name
        );
        eventually("every replica's ring view", || n.metric(&ring).is_some());
    }
    // Persistent messages in durable queues: every node holding a replica
    // of ha.q ran group commits, timed, and shows them as rabbitmq_prometheus
    // and the management API do.
    for n in &nodes {
        let syncs = n.metric("rabbitmq_io_sync_ops_total").unwrap_or(0);
        let logs = n.metric("warren_io_synced_logs_total").unwrap_or(0);
        assert!(
            syncs > 0 && logs >= syncs,
            "{}: {syncs} syncs, {logs} logs",
            n.name
        );
        let text = ureq::get(&format!("http://{}/metrics", n.metrics))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        let secs: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("rabbitmq_io_sync_time_seconds_total "))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!(secs > 0.0, "{}: group commits took no time", n.name);
        let listed = n.get("/api/nodes");
        let me = listed
            .as_array()
            .and_then(|a| a.iter().find(|x| x["name"] == n.name.as_str()))
            .cloned()
            .unwrap();
        assert!(me["io_sync_count"].as_u64().unwrap() > 0, "{me}");
    }
    let queues: Vec<Option<u64>> = nodes.iter().map(|n| n.metric("rabbitmq_queues")).collect();
    assert_eq!(queues, vec![Some(1), Some(1), Some(0)]);
    let exchanges = |n: &Peer| n.metric(&format!("rabbitmq_exchanges{{node=\"{}\"}}", n.name));
    assert!(nodes.iter().all(|n| exchanges(n).is_some()));
    // The API shows a queue's message stats where it is served.
    assert_eq!(
        nodes[1].get("/api/queues/%2F/plain")["message_stats"]["publish"],
        5
    );
    assert!(
        nodes[2]
            .get("/api/queues/%2F/plain")
            .get("message_stats")
            .is_none()
    );

    // Every node's overview lists every node's listeners.
    for n in &nodes {
        let listed = |o: &Value, node: &str, protocol: &str| -> Option<String> {
            o["listeners"].as_array()?.iter().find_map(|l| {
                let ip = l["ip_address"].as_str()?;
                (l["node"] == node && l["protocol"] == protocol)
                    .then(|| format!("{ip}:{}", l["port"]))
            })
        };
        eventually("every member's listeners in the overview", || {
            let o = n.get("/api/overview");
            nodes.iter().all(|m| {
                listed(&o, &m.name, "amqp") == Some(format!("{}:{}", m.ip, m.amqp))
                    && listed(&o, &m.name, "http").as_deref() == Some(m.http.as_str())
                    && listed(&o, &m.name, "http/prometheus").as_deref() == Some(m.metrics.as_str())
                    && listed(&o, &m.name, "clustering").as_deref() == Some(m.peers.as_str())
            })
        });
    }
}

#[test]
fn forms_a_cluster_over_quic_and_sees_a_sigkilled_member_down_at_once() {
    let root = tempfile::tempdir().unwrap();
    let secret = root.path().join("secret");
    std::fs::write(&secret, "quic-secret").unwrap();
    let ca = root.path().join("ca");
    let ca_arg = ca.to_str().unwrap();
    // A silent member would be down only after 120 s: a SIGKILLed one must
    // be seen down by its refusing address.
    let quic = [
        "--transport",
        "quic",
        "--cluster-ca-dir",
        ca_arg,
        "--net-ticktime",
        "120",
    ];
    let a = Peer::start_with("warren@qa", &root.path().join("a"), &secret, None, &quic);
    let seed = a.peers.clone();
    let b = Peer::start_with(
        "warren@qb",
        &root.path().join("b"),
        &secret,
        Some(&seed),
        &quic,
    );
    assert!(ca.join("ca.crt").exists() && ca.join("ca.key").exists());
    eventually("two running members", || {
        names(&b.get("/api/cluster"), "running_nodes") == vec!["warren@qa", "warren@qb"]
    });
    assert_eq!(
        b.http("PUT", "/api/vhosts/over-quic", Some(&json!({}))).0,
        201
    );
    eventually("the vhost on a", || {
        has(&a.get("/api/vhosts"), |v| v["name"] == "over-quic")
    });

    // A third node, SIGKILLed: its UDP port answers ICMP port unreachable,
    // so the others see it down long before the 120 s tick time.
    let mut c = Peer::start_with(
        "warren@qc",
        &root.path().join("c"),
        &secret,
        Some(&seed),
        &quic,
    );
    eventually("three running members", || {
        names(&a.get("/api/cluster"), "running_nodes").len() == 3
    });
    c.kill();
    for n in [&a, &b] {
        eventually("qc down within 30 s of its SIGKILL", || {
            names(&n.get("/api/cluster"), "running_nodes") == vec!["warren@qa", "warren@qb"]
        });
    }
}

#[test]
fn a_single_node_becomes_the_first_cluster_member_with_its_queues() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("solo");
    let mut solo = Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args([
            "--prometheus-addr",
            "127.0.0.1:0",
            "--node-name",
            "warren@solo",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start warren");
    let mut line = String::new();
    BufReader::new(solo.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = field(&line, "AMQP on ")
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("ready line");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let q = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare("kept".into(), q, FieldTable::default())
            .await
            .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let props = BasicProperties::default().with_delivery_mode(2);
        ch.basic_publish(
            "".into(),
            "kept".into(),
            BasicPublishOptions::default(),
            b"still here",
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    });
    let status = Command::new("kill")
        .args(["-TERM", &solo.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    solo.wait().unwrap();

    let secret = root.path().join("secret");
    std::fs::write(&secret, "s").unwrap();
    let node = Peer::start("warren@solo", &dir, &secret, None);
    let queues = node.get("/api/queues");
    assert!(
        has(&queues, |q| q["name"] == "kept"
            && q["messages"] == 1
            && q["node"] == "warren@solo"),
        "{queues}"
    );
}

/// Runs a clustered node with data in `root` and `extra` flags, for a
/// command line it refuses (so it exits).
fn run_refused(root: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args([
            "--prometheus-addr",
            "127.0.0.1:0",
            "--peer-addr",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(root.join("d"))
        .args(extra)
        .env("RUST_LOG", "error")
        .output()
        .expect("run warren")
}

#[test]
fn refuses_a_missing_or_empty_secret() {
    let root = tempfile::tempdir().unwrap();
    let empty = root.path().join("empty");
    std::fs::write(&empty, "  \n").unwrap();
    let run = |extra: &[&str]| run_refused(root.path(), extra);
    let out = run(&["--cluster-secret-file", empty.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is empty"), "{err}");
    let missing = root.path().join("nope");
    let out = run(&["--cluster-secret-file", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read the cluster secret file"), "{err}");
    let out = run(&[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--cluster-secret-file"), "{err}");
}

/// `--peer-tls off` is for TCP: a QUIC node refuses to start with it.
#[test]
fn refuses_peer_tls_off_with_quic() {
    let root = tempfile::tempdir().unwrap();
    let secret = root.path().join("secret");
    std::fs::write(&secret, "s").unwrap();
    let secret = secret.to_str().unwrap();
    let out = run_refused(
        root.path(),
        &[
            "--transport",
            "quic",
            "--peer-tls",
            "off",
            "--cluster-secret-file",
            secret,
        ],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("QUIC between nodes is always TLS"), "{err}");
}

#[test]
fn a_declare_waiting_for_the_majority_holds_up_no_other_client() {
    // The other two nodes stopped (not down: the failure detector waits
    // for --net-ticktime), a durable declare on A waits for the Raft
    // majority; A's other clients go on meanwhile (before, the broker's
    // lock was held through the commit and every client of A froze).
    let root = tempfile::tempdir().unwrap();
    let (_secret, nodes) = three(root.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], "plain.fast");
    let signal = |sig: &str| {
        for n in &nodes[1..] {
            n.signal(sig);
        }
    };
    signal("-STOP");
    let body = json!({"durable": true});
    let (declared_meanwhile, fast, declared) = std::thread::scope(|scope| {
        rt.block_on(async {
            let url = nodes[0].amqp_url();
            let declaring = tokio::spawn(async move {
                let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
                let ch = conn.create_channel().await?;
                ch.queue_declare(
                    "plain.late".into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(|_| conn)
            });
            // An operator's declare through the management API waits too.
            let http = scope.spawn(|| {
                nodes[0]
                    .http("PUT", "/api/queues/%2F/plain.http", Some(&body))
                    .0
            });
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            let conn = Connection::connect(&nodes[0].amqp_url(), ConnectionProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            // One persistent publish at a time into a queue of A alone.
            let fast = tokio::time::timeout(std::time::Duration::from_secs(20), async {
                let mut acked = 0;
                for _ in 0..5 {
                    let confirm = ch
                        .basic_publish(
                            "".into(),
                            "plain.fast".into(),
                            BasicPublishOptions::default(),
                            b"fast",
                            BasicProperties::default().with_delivery_mode(2),
                        )
                        .await
                        .unwrap();
                    if confirm.await.is_ok_and(|c| c.is_ack()) {
                        acked += 1;
                    }
                }
                acked
            })
            .await;
            let meanwhile = declaring.is_finished() || http.is_finished();
            signal("-CONT");
            let declared = declaring.await.unwrap();
            let put = http.join().unwrap();
            (meanwhile, fast, declared.map(|_| put))
        })
    });
    signal("-CONT");
    assert_eq!(fast, Ok(5), "a publisher of A got no confirms");
    assert!(
        !declared_meanwhile,
        "the other client got its confirms only once the declare was answered: {declared:?}"
    );
    let put = declared.expect("the declare went through once the majority was back");
    assert_eq!(put, 201, "the management API's declare");
    eventually("both queues on every node", || {
        nodes.iter().all(|n| {
            ["plain.late", "plain.http"]
                .iter()
                .all(|q| n.http("GET", &format!("/api/queues/%2F/{q}"), None).0 == 200)
        })
    });
}

#[test]
fn every_node_lists_and_closes_the_clients_of_every_node() {
    // RabbitMQ's management API lists every node's connections, channels
    // and consumers through any node, and closes any of them.
    let root = tempfile::tempdir().unwrap();
    let (_secret, nodes) = three(root.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[1], "plain.b");
    let (b_conn, _b_ch, _consumer, _c_conn, _c_ch) = rt.block_on(async {
        let b_conn = Connection::connect(&nodes[1].amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let b_ch = b_conn.create_channel().await.unwrap();
        let consumer = b_ch
            .basic_consume(
                "plain.b".into(),
                "on-b".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let c_conn = Connection::connect(&nodes[2].amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let c_ch = c_conn.create_channel().await.unwrap();
        (b_conn, b_ch, consumer, c_conn, c_ch)
    });
    let on = |list: &Value, node: &str| {
        list.as_array()
            .map_or(0, |a| a.iter().filter(|x| x["node"] == node).count())
    };
    let mut b_name = String::new();
    eventually("a lists the connections and channels of b and c", || {
        let conns = nodes[0].get("/api/connections");
        let chans = nodes[0].get("/api/channels");
        b_name = conns
            .as_array()
            .and_then(|a| a.iter().find(|x| x["node"] == "warren@b"))
            .and_then(|x| x["name"].as_str())
            .unwrap_or_default()
            .to_owned();
        on(&conns, "warren@b") == 1
            && on(&conns, "warren@c") == 1
            && on(&chans, "warren@b") == 1
            && on(&chans, "warren@c") == 1
    });
    // Paged as one list.
    let page = nodes[0].get("/api/connections?page=1&page_size=1");
    assert_eq!(page["total_count"], 2, "{page}");
    assert_eq!(page["items"].as_array().map(Vec::len), Some(1), "{page}");
    let consumers = nodes[0].get("/api/consumers/%2F");
    assert!(
        has(&consumers, |c| c["consumer_tag"] == "on-b"
            && c["channel_details"]["node"] == "warren@b"),
        "{consumers}"
    );
    // The overview counts them too, as RabbitMQ's object totals do.
    let totals = &nodes[0].get("/api/overview")["object_totals"];
    assert_eq!(
        (
            &totals["connections"],
            &totals["channels"],
            &totals["consumers"]
        ),
        (&json!(2), &json!(2), &json!(1)),
        "{totals}"
    );
    // Every node describes itself in a's /api/nodes: its own process.
    let listed = nodes[0].get("/api/nodes");
    for n in &nodes {
        let entry = listed
            .as_array()
            .and_then(|a| a.iter().find(|x| x["name"] == n.name.as_str()))
            .unwrap_or_else(|| panic!("{} not listed: {listed}", n.name));
        assert_eq!(
            entry["os_pid"].to_string().trim_matches('"'),
            n.pid().to_string(),
            "{entry}"
        );
        assert!(entry["mem_used"].as_u64().is_some_and(|m| m > 0), "{entry}");
    }
    let one = nodes[0].get("/api/nodes/warren@c");
    assert_eq!(
        one["os_pid"].to_string().trim_matches('"'),
        nodes[2].pid().to_string()
    );
    // One connection, asked of a, answered by its node.
    let path = format!(
        "/api/connections/{}",
        b_name.replace(' ', "%20").replace('>', "%3E")
    );
    let one = nodes[0].get(&path);
    assert_eq!(one["node"], "warren@b", "{one}");
    assert_eq!(one["name"], b_name.as_str());
    let channels = nodes[0].get(&format!("{path}/channels"));
    assert_eq!(channels.as_array().map(Vec::len), Some(1), "{channels}");
    // Closed through a: the client on b gets connection.close.
    let (status, _) = nodes[0].http("DELETE", &path, None);
    assert_eq!(status, 204);
    eventually("b's client closed", || !b_conn.status().connected());
    eventually("b's connection gone from every list", || {
        nodes
            .iter()
            .all(|n| on(&n.get("/api/connections"), "warren@b") == 0)
    });
    let (status, _) = nodes[0].http("GET", &path, None);
    assert_eq!(status, 404);
}

#[test]
fn consumers_show_which_one_a_single_active_consumer_queue_serves() {
    // RabbitMQ's consumer views: `activity_status` single_active or
    // waiting, `active`, and the consumer's arguments (its x-priority).
    let root = tempfile::tempdir().unwrap();
    let (_secret, nodes) = three(root.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    // lapin cancels a consumer it drops: they are kept.
    let (_conn, ch, _consumers) = rt.block_on(async {
        let conn = Connection::connect(&nodes[0].amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        ch.queue_declare("plain.sac".into(), QueueDeclareOptions::default(), args)
            .await
            .unwrap();
        let mut consumers = Vec::new();
        for (tag, priority) in [("first", None), ("second", Some(3))] {
            let mut args = FieldTable::default();
            if let Some(p) = priority {
                args.insert("x-priority".into(), AMQPValue::LongInt(p));
            }
            let c = ch
                .basic_consume(
                    "plain.sac".into(),
                    tag.into(),
                    BasicConsumeOptions::default(),
                    args,
                )
                .await
                .unwrap();
            consumers.push(c);
        }
        (conn, ch, consumers)
    });
    // Listed through another node once its view of a's clients has them.
    let status = |tag: &str| {
        let list = nodes[1].get("/api/consumers/%2F");
        list.as_array()
            .and_then(|a| a.iter().find(|c| c["consumer_tag"] == tag).cloned())
            .map(|c| {
                (
                    c["activity_status"].clone(),
                    c["active"].clone(),
                    c["arguments"].clone(),
                )
            })
    };
    let first = (json!("single_active"), json!(true), json!({}));
    let waiting = (json!("waiting"), json!(false), json!({"x-priority": 3}));
    eventually("both consumers listed", || {
        status("first").is_some() && status("second").is_some()
    });
    assert_eq!(status("first"), Some(first));
    assert_eq!(status("second"), Some(waiting));
    rt.block_on(ch.basic_cancel("first".into(), BasicCancelOptions::default()))
        .unwrap();
    let took_over = (
        json!("single_active"),
        json!(true),
        json!({"x-priority": 3}),
    );
    eventually("the second consumer listed as the active one", || {
        status("first").is_none() && status("second") == Some(took_over.clone())
    });
}

/// Declares and binds (to `amq.direct`) from many connections at once,
/// which a node commits together (one log entry for the changes pending
/// together): each client gets its declare-ok and bind-ok, and when it has
/// one, the queue is already on every node, as when each was committed
/// alone. (Written on 2026-12-04, this test found binds to the built-in
/// `amq.*` exchanges refused in a cluster with 541 INTERNAL_ERROR: the
/// cluster's metadata had no record of them.)
#[test]
fn declares_from_many_connections_at_once_are_on_every_node_when_answered() {
    let root = tempfile::tempdir().unwrap();
    let (_secret, nodes) = three(root.path());
    let on = |i: usize| format!("amqp://guest:guest@127.0.0.1:{}/%2f", nodes[i].amqp);
    let (a, c) = (on(0), on(2));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..8 {
            let (a, c) = (a.clone(), c.clone());
            tasks.spawn(async move {
                let here = Connection::connect(&a, ConnectionProperties::default())
                    .await
                    .unwrap();
                let there = Connection::connect(&c, ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = here.create_channel().await.unwrap();
                let far = there.create_channel().await.unwrap();
                let durable = QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                };
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                for i in 0..15 {
                    let name = format!("together.{k}.{i}");
                    ch.queue_declare(name.as_str().into(), durable, FieldTable::default())
                        .await
                        .unwrap();
                    ch.queue_bind(
                        name.as_str().into(),
                        "amq.direct".into(),
                        name.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                    // Answered: node c has it already (a passive declare
                    // of a missing queue would close the channel).
                    far.queue_declare(name.as_str().into(), passive, FieldTable::default())
                        .await
                        .unwrap_or_else(|e| panic!("{name} not on c when declared: {e}"));
                }
                here.close(200, "bye".into()).await.unwrap();
                there.close(200, "bye".into()).await.unwrap();
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
    });
    for n in &nodes {
        let queues = n.get("/api/queues");
        let bindings = n.get("/api/bindings");
        for k in 0..8 {
            for i in 0..15 {
                let name = format!("together.{k}.{i}");
                assert!(has(&queues, |q| q["name"] == name.as_str()), "{name}");
                assert!(
                    has(&bindings, |b| b["source"] == "amq.direct"
                        && b["destination"] == name.as_str()),
                    "binding of {name}"
                );
            }
        }
    }
}

#[test]
fn an_exclusive_queue_is_refused_everywhere_and_goes_with_its_node() {
    // As RabbitMQ: another node's clients are refused an exclusive queue
    // (405) and their publishes reach it; when its node goes down, so does
    // the queue, and a client that reconnects elsewhere declares it again.
    let root = tempfile::tempdir().unwrap();
    let (_secret, mut nodes) = three(root.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..QueueDeclareOptions::default()
    };
    let (owner, owner_ch, a_conn) = rt.block_on(async {
        let owner = Connection::connect(&nodes[1].amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let owner_ch = owner.create_channel().await.unwrap();
        owner_ch
            .queue_declare("reply.q".into(), exclusive, FieldTable::default())
            .await
            .unwrap();
        let a_conn = Connection::connect(&nodes[0].amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        (owner, owner_ch, a_conn)
    });
    let declare_on_a = |opts: QueueDeclareOptions| {
        rt.block_on(async {
            let ch = a_conn.create_channel().await.unwrap();
            ch.queue_declare("reply.q".into(), opts, FieldTable::default())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let refused = declare_on_a(passive).expect_err("locked on another node");
    assert!(refused.contains("RESOURCE_LOCKED"), "{refused}");
    rt.block_on(async {
        let ch = a_conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let confirm = ch
            .basic_publish(
                "".into(),
                "reply.q".into(),
                BasicPublishOptions::default(),
                b"pong",
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{confirm:?}");
    });
    eventually("the reply from node a in the owner's queue on b", || {
        rt.block_on(async {
            owner_ch
                .basic_get(
                    "reply.q".into(),
                    lapin::options::BasicGetOptions { no_ack: true },
                )
                .await
                .unwrap()
                .is_some_and(|m| m.delivery.data == b"pong")
        })
    });
    nodes[1].kill();
    drop((owner_ch, owner));
    eventually("the queue gone with its node: declared again on a", || {
        declare_on_a(exclusive).is_ok()
    });
}
