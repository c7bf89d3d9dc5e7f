//! Runs the pika suite (`tests/python/test_pika.py`) against the built
//! `warren` binary when Python has `pika` (`pip install pika`). Without pika
//! it says so and passes, unless `WARREN_REQUIRE_PIKA=1` is set.

#![allow(clippy::print_stderr)]

use std::process::Command;

#[test]
fn pika_suite() {
    let has_pika = Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_pika {
        assert!(
            std::env::var("WARREN_REQUIRE_PIKA").as_deref() != Ok("1"),
            "WARREN_REQUIRE_PIKA=1 but python3 cannot import pika (pip install pika)"
        );
        eprintln!("pika_suite skipped: python3 cannot import pika (pip install pika)");
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
