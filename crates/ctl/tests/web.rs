//! The management web page in headless Chromium
//! (`tests/python/web_check.py`, over the DevTools protocol), when
//! `chromium` and Python's `websocket-client` are installed
//! (`apt-get install chromium`, `pip install websocket-client`). Without
//! them it says so and passes, unless `WARREN_REQUIRE_CHROMIUM=1` is set.
//! A lapin client publishes, gets and acks while the page is looked at, so
//! that its connection, channel and rates are there to see; the page
//! closes that connection at the end.

#![allow(clippy::print_stderr)]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::json;

/// Publishes with confirms into `rated`, gets and acks, until `stop` or
/// until the connection is closed under it; the error that ended it.
async fn traffic(url: String, stop: Arc<AtomicBool>) -> Option<lapin::Error> {
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let opts = QueueDeclareOptions::default();
    ch.queue_declare("rated".into(), opts, FieldTable::default())
        .await
        .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for _ in 0..100_000 {
        if stop.load(Ordering::SeqCst) {
            return None;
        }
        let step = async {
            ch.basic_publish(
                "".into(),
                "rated".into(),
                BasicPublishOptions::default(),
                b"hello",
                BasicProperties::default(),
            )
            .await?
            .await?;
            if let Some(m) = ch
                .basic_get("rated".into(), BasicGetOptions::default())
                .await?
            {
                m.ack(BasicAckOptions::default()).await?;
            }
            Ok::<_, lapin::Error>(())
        };
        if let Err(e) = step.await {
            return Some(e);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[test]
fn web_page_in_headless_chromium() {
    let has_chromium = ["chromium", "chromium-browser"].iter().any(|b| {
        Command::new("sh")
            .args(["-c", &format!("command -v {b}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let has_ws = Command::new("python3")
        .args(["-c", "import websocket"])
        .status()
        .is_ok_and(|s| s.success());
    if !(has_chromium && has_ws) {
        assert!(
            std::env::var("WARREN_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "WARREN_REQUIRE_CHROMIUM=1 but chromium or python3's websocket-client is missing"
        );
        eprintln!(
            "web_page_in_headless_chromium skipped: needs chromium and python3 websocket-client"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Samples every second, so that the page's rates and charts fill in
    // while it is looked at.
    let env = [("WARREN_COLLECT_STATISTICS_INTERVAL", "1000")];
    let node = common::Node::start_with_env(dir.path(), &env);
    let (status, _) = node.http(
        "PUT",
        "/api/queues/%2F/hello.world",
        Some(&json!({"durable": true})),
    );
    assert_eq!(status, 201);
    let x = json!({"type": "topic", "durable": true});
    assert_eq!(
        node.http("PUT", "/api/exchanges/%2F/hello.x", Some(&x)).0,
        201
    );
    let bind = json!({"routing_key": "hello.#"});
    let path = "/api/bindings/%2F/e/hello.x/q/hello.world";
    assert_eq!(node.http("POST", path, Some(&bind)).0, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let (url, stop) = (node.amqp_url(), stop.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(traffic(url, stop))
        })
    };
    let shots = tempfile::tempdir().unwrap();
    let out_dir = std::env::var("WARREN_SCREENSHOTS")
        .unwrap_or_else(|_| shots.path().to_string_lossy().into_owned());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/web_check.py");
    let out = Command::new("timeout")
        .args(["300", "python3", script, &node.http, &out_dir])
        .output()
        .expect("run python3");
    let stderr = String::from_utf8_lossy(&out.stderr);
    stop.store(true, Ordering::SeqCst);
    let ended = client.join().unwrap();
    assert!(out.status.success(), "web check failed:\n{stderr}");
    assert!(stderr.contains("OK"), "web check did not finish:\n{stderr}");
    // The page's Force close button closed the client's connection.
    assert!(ended.is_some(), "the client's connection was not closed");
    let (_, conns) = node.http("GET", "/api/connections", None);
    assert_eq!(conns, json!([]));
    // The policy the form created is the seed's, stored and applied.
    let (_, p) = node.http("GET", "/api/policies/%2F/hello-ha", None);
    assert_eq!(
        p["definition"],
        json!({"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})
    );
    assert_eq!(p["apply-to"], "queues");
}
