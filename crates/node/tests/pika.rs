//! Runs the pika suite (`tests/python/test_pika.py`) against the built
//! `warren` binary when Python has `pika` (`pip install pika`). Without pika
//! it says so and passes, unless `WARREN_REQUIRE_PIKA=1` is set.

#![allow(clippy::print_stderr)]

mod common;

use std::process::Command;

#[test]
fn pika_suite() {
    run_suite("pika_suite", "");
}

/// The same suite against nodes of two shards (`--shards 2`): clients in
/// turn on each, each queue on its declarer's shard.
#[test]
fn pika_suite_on_two_shards() {
    run_suite("pika_suite_on_two_shards", "--shards 2");
}

fn run_suite(test: &str, extra_args: &str) {
    if !common::has_pika(test) {
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/test_pika.py");
    let out = Command::new("python3")
        .arg(script)
        .env("WARREN_BIN", env!("CARGO_BIN_EXE_warren"))
        .env("WARREN_EXTRA_ARGS", extra_args)
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
