//! Two more ecosystems' standard clients against Warren: Bunny (Ruby,
//! Debian's `ruby-bunny`) and php-amqplib (PHP, Debian's `php-amqplib`).
//! Their scenarios (`tests/bunny/scenarios.rb`, `tests/php/scenarios.php`:
//! handshake capabilities, header field types and properties, exchange to
//! exchange and headers bindings, confirms and returns, prefetch, multiple
//! acks, nack and reject, recover, consumer cancellation, channel errors
//! and RabbitMQ's texts for them, transactions, dead-lettering's `x-death`,
//! exclusive and server-named queues, priorities, purge and delete) print
//! what the client saw, and each transcript must be the one recorded from a
//! 3-node RabbitMQ 3.10 cluster with the scenarios' queues mirrored (`cargo
//! xtask conformance --record-bunny`, `--record-php`). They run on one
//! node, on a mirrored 3-node cluster (the client on node 2) and on a node
//! of two shards. Without Ruby and Bunny, or PHP and php-amqplib, the tests
//! say so and pass, unless `WARREN_REQUIRE_BUNNY=1` or
//! `WARREN_REQUIRE_PHP=1`.

mod common;
mod peers;

use std::path::Path;
use std::process::Command;

use serde_json::json;

/// A client whose scenarios print a transcript.
struct Client {
    /// Who it is, in messages.
    name: &'static str,
    /// Its scenarios and their recorded transcript, under `tests/`.
    dir: &'static str,
    /// The interpreter and the scenarios' file.
    program: &'static str,
    script: &'static str,
    /// Interpreter arguments that fail unless the client is installed.
    check: &'static [&'static str],
    /// The variable that makes its absence a failure.
    require: &'static str,
    /// What to install.
    missing: &'static str,
    /// The prefix of every queue its scenarios name (mirrored ones).
    prefix: &'static str,
}

const BUNNY: Client = Client {
    name: "Bunny",
    dir: "bunny",
    program: "ruby",
    script: "scenarios.rb",
    check: &["-rbunny", "-e", "1"],
    require: "WARREN_REQUIRE_BUNNY",
    missing: "no Ruby or Bunny (apt-get install ruby-bunny)",
    prefix: "rb-",
};

const PHP: Client = Client {
    name: "php-amqplib",
    dir: "php",
    program: "php",
    script: "scenarios.php",
    check: &["-r", "require '/usr/share/php/PhpAmqpLib/autoload.php';"],
    require: "WARREN_REQUIRE_PHP",
    missing: "no PHP or php-amqplib (apt-get install php-cli php-amqplib)",
    prefix: "php-",
};

impl Client {
    fn dir(&self) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests")
            .join(self.dir)
    }

    /// Whether the interpreter and the client are installed; without them
    /// `test` says so and passes, unless the client is required.
    fn present(&self, test: &str) -> bool {
        let ok = Command::new(self.program)
            .args(self.check)
            .output()
            .is_ok_and(|o| o.status.success());
        common::present_or_skipped(test, ok, self.require, self.missing)
    }

    /// Runs the scenarios against `amqp_url` and compares what they printed
    /// with RabbitMQ's transcript.
    fn sees_what_it_sees_on_rabbitmq(&self, amqp_url: &str, placement: &str) {
        let out = Command::new(self.program)
            .arg(self.dir().join(self.script))
            .arg(amqp_url)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", self.program));
        assert!(
            out.status.success(),
            "{}'s scenarios failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let transcript = String::from_utf8(out.stdout).expect("a UTF-8 transcript");
        common::assert_transcript(
            self.name,
            &self.dir().join("rabbitmq-3.10.txt"),
            &transcript,
            placement,
        );
    }
}

/// The clients installed here (each absent one says it is skipped).
fn present(placement: &str) -> Vec<&'static Client> {
    [&BUNNY, &PHP]
        .into_iter()
        .filter(|c| c.present(&format!("{} on {placement}", c.name)))
        .collect()
}

/// Runs each present client's scenarios on a node started with `extra`.
fn on_one_node(extra: &[&str], placement: &str) {
    let clients = present(placement);
    if clients.is_empty() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = common::Node::start(&dir.path().join("data"), extra);
    for c in clients {
        c.sees_what_it_sees_on_rabbitmq(&node.url(), placement);
    }
}

#[test]
fn bunny_and_php_amqplib_see_what_they_see_on_rabbitmq_on_one_node() {
    on_one_node(&[], "one node");
}

#[test]
fn bunny_and_php_amqplib_see_what_they_see_on_rabbitmq_on_a_node_of_two_shards() {
    on_one_node(&["--shards", "2"], "two shards");
}

/// The clients on node 2 of three, their scenarios' queues mirrored on all
/// (their masters on node 2), as in the recording.
#[test]
fn bunny_and_php_amqplib_see_what_they_see_on_rabbitmq_on_a_mirrored_cluster() {
    let clients = present("a mirrored cluster");
    if clients.is_empty() {
        return;
    }
    let root = peers::test_root();
    let (_secret, nodes) = peers::three_with(root.path(), &[]);
    for c in &clients {
        let policy = json!({
            "pattern": format!("^{}", c.prefix),
            "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
            "apply-to": "queues",
        });
        let path = format!("/api/policies/%2F/{}-all", c.dir);
        let (status, v) = nodes[0].http("PUT", &path, Some(&policy));
        assert!(status == 201 || status == 204, "policy: {status} {v}");
    }
    for c in clients {
        c.sees_what_it_sees_on_rabbitmq(&nodes[1].amqp_url(), "mirrored cluster");
    }
}
