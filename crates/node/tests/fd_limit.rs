//! A node under a low open-files limit (`ulimit -n 300`), against clients
//! past its socket budget: as RabbitMQ 3.10 does, it holds nine tenths of
//! what is left after 100 descriptors for files and peers (180 sockets),
//! stops accepting beyond that (the next client's handshake waits), keeps
//! declaring durable queues and confirming persistent messages at the
//! budget, and lets a waiting client in once another leaves. The requests
//! of `tests/fd_limit/probe.py` (pika, a real client) run against a real
//! `warren` process; each outcome is compared with RabbitMQ 3.10's,
//! recorded beside it under the same limit (`rabbitmq-3.10.json`). Without
//! pika the test says so and passes, unless `WARREN_REQUIRE_PIKA=1`.

mod common;

use common::{Node, assert_as_rabbitmq, has_pika, probe_json};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fd_limit");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_past_the_socket_budget_wait_as_on_rabbitmq() {
    if !has_pika("fd_limit") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_with_open_files(dir.path(), 300);
    let http_port = node.http.rsplit(':').next().unwrap().to_owned();
    let args = vec![node.port.to_string(), http_port];
    let warren = probe_json(format!("{DIR}/probe.py"), args).await;
    assert_as_rabbitmq(&warren, include_str!("fd_limit/rabbitmq-3.10.json"));
}
