//! RabbitMQ's own Java client (Debian's `librabbitmq-client-java`, the
//! client PerfTest and most JVM applications use) against Warren: the
//! scenarios of `tests/java/Scenarios.java` (handshake capabilities, every
//! header field type, confirms, returns, channel errors, consumer
//! cancellation, transactions, prefetch, consumer priorities, RPC, direct
//! reply-to, a 3 MiB message, exclusive queues, heartbeats, automatic
//! recovery after the operator closes the connection) print what the client
//! saw, and the transcript must be the one recorded from a 3-node RabbitMQ
//! 3.10 cluster with the scenarios' queues mirrored (`cargo xtask
//! conformance --record-java`, `tests/java/rabbitmq-3.10.txt`). They run on
//! one node, on a mirrored 3-node cluster (the client on node 2) and on a
//! node of two shards. Without a JDK and the client the tests say so and
//! pass, unless `WARREN_REQUIRE_JAVA=1`.

#![allow(clippy::print_stderr)]

mod common;
mod peers;

use std::path::Path;
use std::process::Command;

use serde_json::json;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/java");
/// The Java client and the logging API it needs (Debian's paths).
const CLASSPATH: &str = "/usr/share/java/amqp-client.jar:/usr/share/java/slf4j-api.jar";

/// Whether `javac` and the Java client are installed; without them `test`
/// says so and passes, unless `WARREN_REQUIRE_JAVA=1`.
fn has_java(test: &str) -> bool {
    let ok = Path::new("/usr/share/java/amqp-client.jar").exists()
        && Command::new("javac")
            .arg("-version")
            .output()
            .is_ok_and(|o| o.status.success());
    common::present_or_skipped(
        test,
        ok,
        "WARREN_REQUIRE_JAVA",
        "no javac or Java client (apt-get install default-jdk-headless librabbitmq-client-java)",
    )
}

/// Compiles the scenarios into `dir` and runs them against `amqp_url`, the
/// management API at `http` (`HOST:PORT`): the transcript.
fn run_scenarios(dir: &Path, amqp_url: &str, http: &str) -> String {
    let compiled = Command::new("javac")
        .arg("-d")
        .arg(dir)
        .args(["-cp", CLASSPATH, &format!("{DIR}/Scenarios.java")])
        .status()
        .expect("javac");
    assert!(compiled.success(), "javac failed");
    let out = Command::new("java")
        .arg("-cp")
        .arg(format!("{}:{CLASSPATH}", dir.display()))
        .args(["Scenarios", amqp_url, &format!("http://{http}")])
        .output()
        .expect("java");
    assert!(
        out.status.success(),
        "the scenarios failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("a UTF-8 transcript")
}

/// Fails with each line where `warren`'s transcript differs from
/// RabbitMQ's recorded one.
fn assert_as_rabbitmq(warren: &str, placement: &str) {
    let recorded = Path::new(DIR).join("rabbitmq-3.10.txt");
    common::assert_transcript("the Java client", &recorded, warren, placement);
}

#[test]
fn the_java_client_sees_what_it_sees_on_rabbitmq_on_one_node() {
    if !has_java("java on one node") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = common::Node::start(&dir.path().join("data"), &[]);
    let transcript = run_scenarios(dir.path(), &node.url(), &node.http);
    assert_as_rabbitmq(&transcript, "one node");
}

/// The client on node 2 of three, the scenarios' queues mirrored on all
/// (their masters on node 2), as in the recording.
#[test]
fn the_java_client_sees_what_it_sees_on_rabbitmq_on_a_mirrored_cluster() {
    if !has_java("java on a mirrored cluster") {
        return;
    }
    let root = peers::test_root();
    let (_secret, nodes) = peers::three_with(root.path(), &[]);
    let policy = json!({
        "pattern": "^java-",
        "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
        "apply-to": "queues",
    });
    let (status, v) = nodes[0].http("PUT", "/api/policies/%2F/java-all", Some(&policy));
    assert!(status == 201 || status == 204, "policy: {status} {v}");
    let transcript = run_scenarios(root.path(), &nodes[1].amqp_url(), &nodes[1].http);
    assert_as_rabbitmq(&transcript, "mirrored cluster");
}

#[test]
fn the_java_client_sees_what_it_sees_on_rabbitmq_on_a_node_of_two_shards() {
    if !has_java("java on two shards") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = common::Node::start(&dir.path().join("data"), &["--shards", "2"]);
    let transcript = run_scenarios(dir.path(), &node.url(), &node.http);
    assert_as_rabbitmq(&transcript, "two shards");
}
