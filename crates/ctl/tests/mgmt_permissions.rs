//! The management permission model against a running `warren`: real AMQP
//! clients (lapin) open connections and consumers as three users, and each
//! user's tag decides what the HTTP API and `warrenctl` show of them.

mod common;

use std::time::Duration;

use common::{Node, ctl};
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde_json::{Value, json};

/// The `field` (a `/`-separated path) of every item of a list, sorted.
fn column(list: &Value, field: &str) -> Vec<String> {
    let mut v: Vec<String> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|i| {
            field
                .split('/')
                .fold(i, |v, k| &v[k])
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    v.sort();
    v
}

/// What keeps a consumer open: its connection, channel and consumer.
type Open = (Connection, lapin::Channel, lapin::Consumer);

/// Connects as `user` (password `pw`, `guest` for guest) to `vhost` and
/// consumes `queue` with tag `tag`.
async fn consume(port: u16, user: &str, vhost: &str, queue: &str, tag: &str) -> Open {
    let password = if user == "guest" { "guest" } else { "pw" };
    let url = format!("amqp://{user}:{password}@127.0.0.1:{port}/{vhost}");
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("{user} connects to {vhost}: {e}"));
    let ch = conn.create_channel().await.unwrap();
    let consumer = ch
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (conn, ch, consumer)
}

#[test]
fn each_tag_sees_the_connections_consumers_and_vhosts_rabbitmq_shows_it() {
    let dir = tempfile::tempdir().unwrap();
    let n = Node::start(dir.path());
    let put = |path: &str, body: Value| {
        let (status, v) = n.http("PUT", path, Some(&body));
        assert!(status == 201 || status == 204, "PUT {path}: {status} {v}");
    };
    put("/api/vhosts/a", json!({}));
    for (user, tags) in [
        ("alice", "management"),
        ("bob", "management"),
        ("mona", "monitoring"),
    ] {
        put(
            &format!("/api/users/{user}"),
            json!({"password": "pw", "tags": tags}),
        );
        put(
            &format!("/api/permissions/a/{user}"),
            json!({"configure": ".*", "write": ".*", "read": ".*"}),
        );
    }
    for q in [
        "/api/queues/a/qa",
        "/api/queues/a/qb",
        "/api/queues/%2F/secret",
    ] {
        put(q, json!({}));
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _conns = rt.block_on(async {
        [
            consume(n.amqp_port, "alice", "a", "qa", "alice-c").await,
            consume(n.amqp_port, "bob", "a", "qb", "bob-c").await,
            consume(n.amqp_port, "guest", "%2f", "secret", "guest-c").await,
        ]
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while n
        .http("GET", "/api/consumers", None)
        .1
        .as_array()
        .map(Vec::len)
        != Some(3)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "three consumers: {}",
            n.http("GET", "/api/consumers", None).1
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A management user: its own connection and consumer, its vhost's
    // queues, nothing of `/`, no users.
    let alice = |path: &str| n.http_as("alice", "pw", "GET", path, None);
    let (status, cs) = alice("/api/connections");
    assert_eq!(status, 200);
    assert_eq!(column(&cs, "user"), ["alice"]);
    assert_eq!(column(&alice("/api/channels").1, "user"), ["alice"]);
    // Another user's channel and its connection's channels: refused.
    let all = n.http("GET", "/api/channels", None).1;
    let bobs = all
        .as_array()
        .and_then(|a| a.iter().find(|c| c["user"] == "bob"))
        .and_then(|c| c["name"].as_str())
        .expect("bob's channel")
        .to_owned();
    let enc = |s: &str| s.replace(' ', "%20").replace('>', "%3E");
    assert_eq!(alice(&format!("/api/channels/{}", enc(&bobs))).0, 401);
    assert_eq!(
        column(&alice("/api/consumers").1, "consumer_tag"),
        ["alice-c"]
    );
    assert_eq!(
        column(&alice("/api/consumers/a").1, "consumer_tag"),
        ["alice-c"]
    );
    assert_eq!(column(&alice("/api/queues").1, "name"), ["qa", "qb"]);
    assert_eq!(column(&alice("/api/vhosts").1, "name"), ["a"]);
    let o = alice("/api/overview").1;
    assert_eq!(o["object_totals"]["connections"], 1, "{o}");
    assert_eq!(o["object_totals"]["channels"], 1, "{o}");
    assert_eq!(o["object_totals"]["queues"], 2, "{o}");
    let (status, v) = alice("/api/queues/%2F");
    assert_eq!(status, 401);
    assert_eq!(v["reason"], "User not authorised to access virtual host");
    for path in ["/api/users", "/api/definitions", "/api/nodes"] {
        let (status, v) = alice(path);
        assert_eq!(status, 401, "{path}: {v}");
        assert!(!v.to_string().contains("password_hash"), "{v}");
    }
    // warrenctl, logged in as alice, shows the same.
    let as_alice = |args: &[&str]| {
        ctl(&[
            &["--node", &n.http, "--username", "alice", "--password", "pw"],
            args,
        ]
        .concat())
    };
    let rows = as_alice(&["-q", "list_connections", "user", "vhost"]).rows();
    assert_eq!(rows, [["user", "vhost"], ["alice", "a"]]);
    let rows = as_alice(&["-q", "list_vhosts"]).rows();
    assert_eq!(rows, [["name"], ["a"]]);
    let r = as_alice(&["list_users"]);
    assert_eq!(r.code, 64, "{r:?}");

    // A monitoring user: every connection, consumer and vhost name, the
    // node; still only its own vhosts' queues, and never the users.
    let mona = |path: &str| n.http_as("mona", "pw", "GET", path, None);
    assert_eq!(
        column(&mona("/api/connections").1, "user"),
        ["alice", "bob", "guest"]
    );
    assert_eq!(
        column(&mona("/api/channels").1, "user"),
        ["alice", "bob", "guest"]
    );
    assert_eq!(
        column(&mona("/api/consumers").1, "channel_details/user"),
        ["alice", "bob", "guest"]
    );
    assert_eq!(column(&mona("/api/vhosts").1, "name"), ["/", "a"]);
    assert_eq!(column(&mona("/api/queues").1, "name"), ["qa", "qb"]);
    let o = mona("/api/overview").1;
    assert_eq!(o["object_totals"]["connections"], 3, "{o}");
    assert_eq!(o["object_totals"]["consumers"], 3, "{o}");
    assert_eq!(mona("/api/nodes").0, 200);
    for path in ["/api/users", "/api/permissions", "/api/definitions"] {
        let (status, v) = mona(path);
        assert_eq!(status, 401, "{path}: {v}");
        assert_eq!(v["reason"], "Not administrator user");
    }

    // The administrator: everything.
    assert_eq!(
        column(&n.http("GET", "/api/queues", None).1, "name"),
        ["qa", "qb", "secret"]
    );
}
