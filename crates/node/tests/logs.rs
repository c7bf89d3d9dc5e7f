//! The node's log as an operator keeps it: written to a file, it reads as
//! plain lines, without terminal colour codes.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};

#[test]
fn a_log_written_to_a_file_has_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("warren.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--prometheus-addr", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start warren");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains(" ready, AMQP on "), "{line}");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(child.wait().unwrap().success());

    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains(" INFO warren: ready node=warren@localhost")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains(" INFO warren: stopped, everything on disk")),
        "{text}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "colour codes in the log: {text:?}"
    );
}
