//! The management API's message operations and smaller endpoints (publish
//! and get over HTTP, the aliveness test, a queue's bindings, a binding by
//! its properties key, permissions per user and per vhost, bulk user
//! deletion, the older node health check, a connection's client
//! properties), as AMQPStorm's functional suite uses them: the requests of
//! `tests/http_api/probe.py` (the standard library and pika, a real client)
//! against a real `warren` process, each outcome compared with RabbitMQ
//! 3.10's, recorded beside it (`rabbitmq-3.10.json`). Expected results are
//! never written by hand. Without pika the test says so and passes, unless
//! `WARREN_REQUIRE_PIKA=1`.

#![allow(clippy::print_stderr)]

mod common;

use common::{Node, assert_as_rabbitmq, has_pika, probe_json};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/http_api");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn management_api_answers_as_rabbitmq_does() {
    if !has_pika("http_api") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let http_port = node.http.rsplit(':').next().unwrap().to_owned();
    let args = vec![node.port.to_string(), http_port];
    let warren = probe_json(format!("{DIR}/probe.py"), args).await;
    assert_as_rabbitmq(&warren, include_str!("http_api/rabbitmq-3.10.json"));
}
