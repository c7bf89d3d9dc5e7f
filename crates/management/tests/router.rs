//! The router over an in-process broker, with a stand-in [`MirrorSource`]
//! showing that mirror data from the mirroring layer drops into the queue
//! fields, the metrics and the sync actions.

mod common;

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use warren_broker::meta::MemoryStore;
use warren_broker::{Broker, BrokerConfig};
use warren_management::{Management, MirrorSource, NodeControl, QueueMirrors};

/// Reports two mirrors (one synchronised) and a sync in progress for
/// every queue, and records the actions it is asked for.
#[derive(Debug, Default)]
struct FakeMirrors {
    actions: Mutex<Vec<String>>,
}

impl MirrorSource for FakeMirrors {
    fn mirrors(&self, _vhost: &str, _queue: &str) -> Option<QueueMirrors> {
        Some(QueueMirrors {
            node: "warren@a".into(),
            slave_nodes: vec!["warren@b".into(), "warren@c".into()],
            synchronised_slave_nodes: vec!["warren@b".into()],
            syncing: Some(4),
        })
    }

    fn sync(&self, vhost: &str, queue: &str) -> Result<(), String> {
        self.actions
            .lock()
            .unwrap()
            .push(format!("sync {vhost} {queue}"));
        Ok(())
    }

    fn cancel_sync(&self, _vhost: &str, queue: &str) -> Result<(), String> {
        if queue == "stuck" {
            return Err("no sync to cancel".into());
        }
        Ok(())
    }
}

async fn request(addr: &str, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    common::request_as(addr, ("guest", "guest"), method, path, body).await
}

#[tokio::test]
async fn mirror_source_feeds_queue_fields_metrics_and_actions() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMirrors::default());
    let state = Management::new(common::broker(dir.path())).mirrors(fake.clone());
    let addr = common::serve(state.clone()).await;

    let (status, _) = request(
        &addr,
        "PUT",
        "/api/queues/%2F/q",
        Some(json!({"durable": false})),
    )
    .await;
    assert_eq!(status, 201);
    let (status, body) = request(&addr, "GET", "/api/queues/%2F/q", None).await;
    assert_eq!(status, 200);
    let q: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(q["node"], "warren@a");
    assert_eq!(q["slave_nodes"], json!(["warren@b", "warren@c"]));
    assert_eq!(q["synchronised_slave_nodes"], json!(["warren@b"]));
    assert_eq!(q["state"], "syncing");
    assert_eq!(q["sync_messages"], 4);
    assert_eq!(q["durable"], false);

    let (status, _) = request(
        &addr,
        "POST",
        "/api/queues/%2F/q/actions",
        Some(json!({"action": "sync"})),
    )
    .await;
    assert_eq!(status, 204);
    assert_eq!(*fake.actions.lock().unwrap(), ["sync / q"]);
    let (status, _) = request(&addr, "PUT", "/api/queues/%2F/stuck", Some(json!({}))).await;
    assert_eq!(status, 201);
    let (status, body) = request(
        &addr,
        "POST",
        "/api/queues/%2F/stuck/actions",
        Some(json!({"action": "cancel_sync"})),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"error": "bad_request", "reason": "no sync to cancel"})
    );

    let text = warren_management::render_metrics(&state);
    assert!(
        text.contains("warren_queue_ring_members{vhost=\"/\",queue=\"q\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("warren_queue_synchronised_mirrors{vhost=\"/\",queue=\"q\"} 1"),
        "{text}"
    );

    // The OpenAPI document is served and lists the actions endpoint.
    let doc = warren_management::openapi_document();
    assert!(doc["paths"]["/api/queues/{vhost}/{name}/actions"]["post"].is_object());
}

#[test]
fn import_definitions_at_boot() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = Broker::open(
        BrokerConfig::new(dir.path()),
        Box::new(MemoryStore::default()),
    )
    .unwrap();
    let bad = json!({
        "vhosts": [{"name": "never"}],
        "policies": [{"vhost": "/", "name": "p", "pattern": "^x", "definition": {"ha-mode": "exactly"}}],
    });
    let e = warren_management::import_definitions(&mut b, &bad).unwrap_err();
    assert!(e.to_string().contains("ha-params"), "{e}");
    assert!(!b.has_vhost("never"), "a refused import changes nothing");
    let good = json!({
        "vhosts": [{"name": "v"}],
        "policies": [{"vhost": "v", "name": "hello-ha", "pattern": "^hello",
                      "definition": {"ha-mode": "exactly", "ha-params": 2}}],
        "queues": [{"name": "hello", "vhost": "v", "durable": false, "auto_delete": false, "arguments": {}}],
    });
    warren_management::import_definitions(&mut b, &good).unwrap();
    assert_eq!(b.policies()[0].name, "hello-ha");
    assert_eq!(b.queues(Some("v"))[0].name, "hello");
}

/// Records the verbs it is asked for; `stop` fails.
#[derive(Debug, Default)]
struct FakeNode {
    verbs: Mutex<Vec<&'static str>>,
    running: std::sync::atomic::AtomicBool,
}

impl FakeNode {
    fn record(&self, verb: &'static str) -> warren_management::ClusterFuture {
        self.verbs.lock().unwrap().push(verb);
        let running = verb == "start_app";
        self.running
            .store(running, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            if verb == "stop" {
                Err("already stopping".to_owned())
            } else {
                Ok(())
            }
        })
    }
}

impl NodeControl for FakeNode {
    fn stop(&self) -> warren_management::ClusterFuture {
        self.record("stop")
    }

    fn stop_app(&self) -> warren_management::ClusterFuture {
        self.record("stop_app")
    }

    fn start_app(&self) -> warren_management::ClusterFuture {
        self.record("start_app")
    }

    fn app_running(&self) -> bool {
        self.running.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test]
async fn node_control_serves_stop_stop_app_and_start_app() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::broker(dir.path());
    let fake = Arc::new(FakeNode::default());
    let without = common::serve(Management::new(broker.clone())).await;
    let (status, body) = request(&without, "POST", "/api/nodes/warren@a/stop_app", None).await;
    assert_eq!(status, 400, "{body}");
    let (_, body) = request(&without, "GET", "/api/nodes/warren@a", None).await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["app_running"],
        true
    );

    let addr = common::serve(Management::new(broker).node_control(fake.clone())).await;
    let (status, _) = request(&addr, "POST", "/api/nodes/warren%40a/stop_app", None).await;
    assert_eq!(status, 204);
    let (_, body) = request(&addr, "GET", "/api/nodes/warren@a", None).await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["app_running"],
        false
    );
    let (status, _) = request(&addr, "POST", "/api/nodes/warren@a/start_app", None).await;
    assert_eq!(status, 204);
    let (status, _) = request(&addr, "POST", "/api/nodes/warren@b/stop", None).await;
    assert_eq!(status, 404, "another node's name");
    let (status, body) = request(&addr, "POST", "/api/nodes/warren@a/stop", None).await;
    assert_eq!(status, 400);
    assert!(body.contains("already stopping"), "{body}");
    assert_eq!(
        *fake.verbs.lock().unwrap(),
        ["stop_app", "start_app", "stop"]
    );

    let doc = warren_management::openapi_document();
    for verb in ["stop", "stop_app", "start_app"] {
        assert!(doc["paths"][format!("/api/nodes/{{name}}/{verb}")]["post"].is_object());
    }
}

/// A client that starts a request and never finishes its headers is
/// disconnected (after the idle timeout, 60 s by default, 2 s here:
/// `axum::serve` set none, and 3,000 such connections sat open for good,
/// on the way to the node's descriptor limit); others are served meanwhile.
#[tokio::test]
async fn a_request_whose_headers_never_end_is_dropped() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let dir = tempfile::tempdir().unwrap();
    let state = Management::new(common::broker(dir.path()))
        .http_idle_timeout(std::time::Duration::from_secs(2));
    let addr = common::serve(state).await;
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /api/overview HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (status, _) = request(&addr, "GET", "/api/overview", None).await;
    assert_eq!(status, 200);
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        slow.read_to_end(&mut rest),
    )
    .await;
    assert!(ended.is_ok(), "the slow request's connection is still open");
}

/// A request whose body comes after its headers (as Python's requests
/// writes a DELETE with a JSON body), to a handler that has no use for the
/// body, leaves the kept-alive connection open for the next request (hyper
/// closed one whose body was not read: AMQPStorm's next call met
/// `RemoteDisconnected`).
#[tokio::test]
async fn a_body_no_handler_reads_leaves_the_connection_usable() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let dir = tempfile::tempdir().unwrap();
    let addr = common::serve(Management::new(common::broker(dir.path()))).await;
    let auth = "Authorization: Basic Z3Vlc3Q6Z3Vlc3Q=";
    let (status, _) = request(
        &addr,
        "PUT",
        "/api/queues/%2F/q",
        Some(serde_json::json!({})),
    )
    .await;
    assert_eq!(status, 201);
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = br#"{"vhost":"/","name":"q","mode":"delete"}"#;
    let head = format!(
        "DELETE /api/queues/%2F/q HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    s.write_all(body).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the DELETE's answer");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 204"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let next = format!("GET /api/overview HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n");
    s.write_all(next.as_bytes()).await.unwrap();
    let n = s.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "the next request on the connection: {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
}
