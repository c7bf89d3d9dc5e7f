//! The management web page in headless Chromium
//! (`tests/python/web_check.py`, over the DevTools protocol), when
//! `chromium` and Python's `websocket-client` are installed
//! (`apt-get install chromium`, `pip install websocket-client`). Without
//! them it says so and passes, unless `WARREN_REQUIRE_CHROMIUM=1` is set.

#![allow(clippy::print_stderr)]

mod common;

use std::process::Command;

use serde_json::json;

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
    let node = common::Node::start(dir.path());
    let (status, _) = node.http(
        "PUT",
        "/api/queues/%2F/hello.world",
        Some(&json!({"durable": true})),
    );
    assert_eq!(status, 201);
    let shots = tempfile::tempdir().unwrap();
    let out_dir = std::env::var("WARREN_SCREENSHOTS")
        .unwrap_or_else(|_| shots.path().to_string_lossy().into_owned());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/web_check.py");
    let out = Command::new("timeout")
        .args(["300", "python3", script, &node.http, &out_dir])
        .output()
        .expect("run python3");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "web check failed:\n{stderr}");
    assert!(stderr.contains("OK"), "web check did not finish:\n{stderr}");
    // The policy the form created is the seed's, stored and applied.
    let (_, p) = node.http("GET", "/api/policies/%2F/hello-ha", None);
    assert_eq!(
        p["definition"],
        json!({"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})
    );
    assert_eq!(p["apply-to"], "queues");
}
