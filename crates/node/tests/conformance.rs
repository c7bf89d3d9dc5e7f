//! Queue features as RabbitMQ has them: the scenarios of
//! `tests/conformance/scenarios.py` (pika, a real client) run against three
//! `warren` processes, and each outcome is compared with RabbitMQ 3.10's,
//! recorded from a real RabbitMQ cluster by `cargo xtask conformance
//! --record` (`tests/conformance/rabbitmq-3.10.json`). Expected results are
//! never written by hand. The same scenarios run on one node of two shards
//! too.
//!
//! Scenarios where Warren still differs are listed, with the issue that
//! covers them, in `tests/conformance/known-divergences.txt`: the test fails
//! if any other scenario differs. A listed one that agrees is reported (some
//! agree only sometimes: a mirror's count that has or has not caught up), and
//! is removed from the list once it always does. Without pika the test says
//! so and passes, unless `WARREN_REQUIRE_PIKA=1`.

#![allow(clippy::print_stderr)]

mod common;
mod peers;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Command, Stdio};

use peers::{Peer, eventually, names, three_with};
use serde_json::{Value, json};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/conformance");

/// `scenario/placement` keys that are known to differ from RabbitMQ.
fn known_divergences() -> Vec<String> {
    std::fs::read_to_string(format!("{DIR}/known-divergences.txt"))
        .expect("known-divergences.txt")
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// What `scenarios.py FLAG` prints (`--policies`, `--settings`).
fn scenarios_json(script: &str, flag: &str) -> BTreeMap<String, Value> {
    let out = Command::new("python3")
        .args([script, flag])
        .output()
        .expect("python3");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("scenarios.py {flag}: {e}"))
}

/// RabbitMQ's recorded outcomes.
fn recorded() -> BTreeMap<String, Value> {
    serde_json::from_str(
        &std::fs::read_to_string(format!("{DIR}/rabbitmq-3.10.json")).expect("recorded outcomes"),
    )
    .expect("recorded outcomes are JSON")
}

/// The scenarios' broker settings as a `warren.conf` in `dir`: its path.
fn settings_file(script: &str, dir: &std::path::Path) -> String {
    let conf = dir.join("warren.conf");
    let lines: String = scenarios_json(script, "--settings")
        .iter()
        .map(|(k, v)| format!("{k} = {v}\n"))
        .collect();
    std::fs::write(&conf, lines).expect("write warren.conf");
    conf.to_str().expect("a UTF-8 path").to_owned()
}

/// The scenarios' policies: each name and its management API body.
fn policies(script: &str) -> Vec<(String, Value)> {
    scenarios_json(script, "--policies")
        .into_iter()
        .map(|(name, p)| {
            let body = json!({
                "pattern": p["pattern"],
                "definition": p["definition"],
                "priority": p["priority"],
                "apply-to": "queues",
            });
            (name, body)
        })
        .collect()
}

/// `WARREN_CONFORMANCE_ONLY=a,b` runs those scenarios alone (to chase one).
fn only() -> Option<String> {
    std::env::var("WARREN_CONFORMANCE_ONLY").ok()
}

/// Runs the scenarios against `urls` (with the failover placement when
/// `fail_over` is given, called with each queue to fail over); their
/// outcomes.
fn run_scenarios(
    script: &str,
    urls: &[String],
    mut fail_over: Option<&mut dyn FnMut(&str)>,
) -> BTreeMap<String, Value> {
    let only = only();
    let mut child = Command::new("python3")
        .arg(script)
        .args(["--urls", &urls.join(",")])
        .args(fail_over.as_ref().map(|_| "--failover"))
        .args(only.iter().flat_map(|o| ["--only", o.as_str()]))
        .env("PYTHONWARNINGS", "ignore")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the scenarios");
    let mut answer = child.stdin.take().expect("stdin");
    let mut json = String::new();
    for line in BufReader::new(child.stdout.take().expect("stdout")).lines() {
        let line = line.expect("the scenarios' output");
        match (line.strip_prefix("FAILOVER "), fail_over.as_mut()) {
            (Some(queue), Some(f)) => {
                f(queue);
                writeln!(answer, "ok").expect("answer the scenarios");
            }
            _ => json.push_str(&line),
        }
    }
    assert!(
        child.wait().expect("scenarios").success(),
        "the scenarios failed"
    );
    serde_json::from_str(&json).expect("Warren's outcomes are JSON")
}

/// Compares Warren's outcomes with RabbitMQ's (the placements in
/// `placements`): the differences not listed as known divergences, each
/// as a line to show. Reports the agreements and the listed ones that
/// agreed this time.
fn differences(warren: &BTreeMap<String, Value>, placements: &[&str]) -> Vec<String> {
    let only = only();
    let known = known_divergences();
    let recorded: BTreeMap<String, Value> = recorded()
        .into_iter()
        .filter(|(key, _)| {
            let (scenario, placement) = key.split_once('/').unwrap_or_default();
            placements.contains(&placement)
                && only
                    .as_deref()
                    .is_none_or(|o| o.split(',').any(|s| s == scenario))
        })
        .collect();
    let mut unexpected = Vec::new();
    let mut fixed = Vec::new();
    for (key, want) in &recorded {
        let got = warren.get(key).unwrap_or(&Value::Null);
        let same = got == want;
        let listed = known.contains(key);
        if !same && !listed {
            unexpected.push(format!("{key}:\n  RabbitMQ: {want}\n  Warren:   {got}"));
        }
        if same && listed {
            fixed.push(key.clone());
        }
    }
    let agree = recorded
        .iter()
        .filter(|(k, want)| warren.get(*k) == Some(*want))
        .count();
    eprintln!(
        "{agree} of {} scenario placements as in RabbitMQ 3.10 ({} listed as known divergences)",
        recorded.len(),
        known.len()
    );
    if !fixed.is_empty() {
        eprintln!("listed as known divergences but as in RabbitMQ this time: {fixed:?}");
    }
    unexpected
}

#[test]
fn queue_features_behave_as_in_rabbitmq() {
    if !common::has_pika("conformance") {
        return;
    }
    let script = format!("{DIR}/scenarios.py");
    let root = peers::test_root();
    let conf = settings_file(&script, root.path());
    let extra = ["--config", conf.as_str()];
    let (secret, mut nodes) = three_with(root.path(), &extra);
    for (name, body) in policies(&script) {
        let (status, v) = nodes[0].http("PUT", &format!("/api/policies/%2F/{name}"), Some(&body));
        assert!(
            status == 201 || status == 204,
            "policy {name}: {status} {v}"
        );
    }
    let urls: Vec<String> = nodes.iter().map(Peer::amqp_url).collect();
    let mut step = |queue: &str| fail_over(&mut nodes, &secret, queue, &extra);
    let warren = run_scenarios(&script, &urls, Some(&mut step));
    let unexpected = differences(&warren, &["plain", "master", "mirror", "failover"]);
    if !unexpected.is_empty() {
        // The nodes' logs go with the test's directory: their warnings
        // and errors are what a failed run leaves to go on.
        for n in &nodes {
            let log = std::fs::read_to_string(n.dir.with_extension("log")).unwrap_or_default();
            for line in log
                .lines()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            {
                eprintln!("{}: {line}", n.name);
            }
        }
    }
    assert!(
        unexpected.is_empty(),
        "differs from RabbitMQ 3.10:\n{}",
        unexpected.join("\n")
    );
}

/// The same scenarios on one node of two shards (`--shards 2`), its URL
/// given for all three nodes: the clients of a placement go to the shards
/// in turn, so a queue is used from the other shard (over the in-process
/// link, or after its client moved) as often as from its own. No failover
/// placement (one node has nothing to fail over to), and no mirrors, which
/// none of the other placements' outcomes shows.
#[test]
fn queue_features_behave_as_in_rabbitmq_on_a_node_of_two_shards() {
    if !common::has_pika("conformance on two shards") {
        return;
    }
    let script = format!("{DIR}/scenarios.py");
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = settings_file(&script, dir.path());
    let node = common::Node::start(
        &dir.path().join("data"),
        &["--shards", "2", "--config", &conf],
    );
    for (name, body) in policies(&script) {
        node.api_send("PUT", &format!("/api/policies/%2F/{name}"), &body);
    }
    let urls = vec![node.url(); 3];
    let warren = run_scenarios(&script, &urls, None);
    let unexpected = differences(&warren, &["plain", "master", "mirror"]);
    assert!(
        unexpected.is_empty(),
        "differs from RabbitMQ 3.10 on two shards:\n{}",
        unexpected.join("\n")
    );
}

/// The failover placement's step: once `queue` has its two synchronised
/// mirrors, SIGKILLs node 1 (its master), waits for a mirror to take over
/// and starts node 1 again.
fn fail_over(nodes: &mut [Peer], secret: &std::path::Path, queue: &str, extra: &[&str]) {
    let path = format!("/api/queues/%2F/{queue}");
    let info = |p: &Peer| {
        let (status, v) = p.http("GET", &path, None);
        if status == 200 { v } else { Value::Null }
    };
    // Synchronised first, unless it is gone (an x-expires queue may expire).
    eventually("two synchronised mirrors before the failover", || {
        let q = info(&nodes[0]);
        q.is_null() || names(&q, "synchronised_slave_nodes").len() == 2
    });
    nodes[0].kill();
    // Taken over, or gone (an x-expires queue may expire meanwhile).
    eventually("a mirror takes over", || {
        info(&nodes[1])["node"] != "warren@a"
    });
    nodes[0] = nodes[0].restart(secret, extra);
    // Back once the others see it (as RabbitMQ's `await_startup`).
    eventually("the other nodes see node 1 again", || {
        nodes[1..].iter().all(|n| {
            n.get("/api/nodes").as_array().is_some_and(|a| {
                a.iter()
                    .any(|m| m["name"] == "warren@a" && m["running"] == true)
            })
        })
    });
    forwarding_to_node_1_works(nodes);
}

/// Waits until a publish through each other node to a queue node 1 serves
/// is confirmed, not returned: their forwarding links to its new run are up
/// (a publish forwarded while a node's dial of the new run fails is nacked),
/// so a scenario records the feature it is about. RabbitMQ's node serves
/// once `await_startup` returns.
fn forwarding_to_node_1_works(nodes: &[Peer]) {
    use lapin::options::{
        BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    const PROBE: &str = "conformance.probe";
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    rt.block_on(async {
        let on_a = Connection::connect(&nodes[0].amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect to node 1");
        let admin = on_a.create_channel().await.expect("a channel");
        admin
            .queue_declare(
                PROBE.into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare the probe queue");
        for n in &nodes[1..] {
            let conn = Connection::connect(&n.amqp_url(), ConnectionProperties::default())
                .await
                .expect("connect");
            let ch = conn.create_channel().await.expect("a channel");
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("confirm.select");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        PROBE.into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        b"probe",
                        BasicProperties::default(),
                    )
                    .await
                    .expect("publish")
                    .await
                    .expect("its confirm");
                if matches!(confirm, lapin::Confirmation::Ack(None)) {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "a publish through {} to node 1 not confirmed for 30 s: {confirm:?}",
                    n.name
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        admin
            .queue_delete(PROBE.into(), QueueDeleteOptions::default())
            .await
            .expect("delete the probe queue");
    });
}
