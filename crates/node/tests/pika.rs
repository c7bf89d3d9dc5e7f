//! Runs the pika suite (`tests/python/test_pika.py`) against the built
//! `warren` binary when Python has `pika` (`pip install pika`). Without pika
//! it says so and passes, unless `WARREN_REQUIRE_PIKA=1` is set.

#![allow(clippy::print_stderr)]

mod common;

use std::process::Command;

#[test]
fn pika_suite() {
    if !common::has_pika("pika_suite") {
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/test_pika.py");
    let out = Command::new("python3")
        .arg(script)
        .env("WARREN_BIN", env!("CARGO_BIN_EXE_warren"))
        .env("PYTHONWARNINGS", "ignore")
        .output()
        .expect("run python3");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "pika suite failed:\n{stderr}");
    assert!(
        stderr.contains("OK"),
        "pika suite did not finish:\n{stderr}"
    );
}
