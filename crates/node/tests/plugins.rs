//! RabbitMQ's own shovel and federation plugins with Warren at the other
//! end. A RabbitMQ 3.10 node (Debian's `rabbitmq-server`, with
//! `rabbitmq_shovel` and `rabbitmq_federation` enabled, on free ports, its
//! data in a temporary directory) runs beside a Warren node: a dynamic
//! shovel moves persistent messages from a Warren queue into a RabbitMQ one
//! and another the other way (`ack-mode: on-confirm`), and a federated
//! exchange on RabbitMQ takes the messages published to its upstream, an
//! exchange of Warren's (the link first declares an
//! `x-federation-upstream` exchange there and falls back to a `fanout` only
//! when that closes its connection with 503, as RabbitMQ 3.10 without the
//! plugin does). Both plugins speak AMQP through RabbitMQ's Erlang client.
//! Without RabbitMQ the test says so and passes, unless
//! `WARREN_REQUIRE_RABBITMQ=1`.

mod common;

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Node;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The PIDs of the running `epmd` daemons.
fn epmds() -> Vec<String> {
    Command::new("pgrep")
        .args(["-x", "epmd"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// A RabbitMQ node of this test's own, stopped (its process group) when
/// dropped, with the `epmd` it started if there was none before.
struct Rabbit {
    child: Child,
    home: tempfile::TempDir,
    node: String,
    port: u16,
    epmd_before: Vec<String>,
}

impl Rabbit {
    fn start() -> Self {
        let home = tempfile::tempdir().expect("a temporary directory");
        let dir = home.path();
        let port = free_port();
        // The CLI tools take the ports 10,000 above the node's distribution
        // port: keep both below 65,536.
        let dist = loop {
            let p = free_port();
            if p < 55_000 {
                break p;
            }
        };
        let node = format!("warren-plugins-{}@localhost", std::process::id());
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\n"),
        )
        .unwrap();
        std::fs::write(
            dir.join("enabled_plugins"),
            "[rabbitmq_shovel,rabbitmq_federation].\n",
        )
        .unwrap();
        let cookie = dir.join(".erlang.cookie");
        std::fs::write(&cookie, format!("WARRENPLUGINS{}", std::process::id())).unwrap();
        std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400)).unwrap();
        let epmd_before = epmds();
        let child = Command::new(SERVER)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("HOME", dir)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start rabbitmq-server");
        let mut rabbit = Self {
            child,
            home,
            node,
            port,
            epmd_before,
        };
        // Its listener opens once it has booted (plugins included).
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                !matches!(rabbit.child.try_wait(), Ok(Some(_))),
                "rabbitmq-server exited; its logs are in {}",
                rabbit.dir().join("log").display()
            );
            assert!(Instant::now() < deadline, "RabbitMQ not up in 120 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        rabbit.ctl(&["await_startup"]);
        rabbit
    }

    fn dir(&self) -> PathBuf {
        self.home.path().to_owned()
    }

    /// Runs `rabbitmqctl` against the node; its output.
    fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new(CTL)
            .arg("-n")
            .arg(&self.node)
            .args(args)
            .env("HOME", self.dir())
            .output()
            .expect("run rabbitmqctl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_)))
                && !Command::new("pgrep")
                    .args(["-g", &self.child.id().to_string()])
                    .status()
                    .is_ok_and(|s| s.success())
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
        for pid in epmds() {
            if !self.epmd_before.contains(&pid) {
                let _ = Command::new("kill").arg(&pid).status();
            }
        }
    }
}

async fn connect(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

async fn durable_queue(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declare {name}: {e}"));
}

async fn durable_direct_exchange(ch: &Channel, name: &str) {
    ch.exchange_declare(
        name.into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declare {name}: {e}"));
}

/// Publishes `n` persistent messages `PREFIX-i` to `exchange` with `key`,
/// every one confirmed.
async fn publish(ch: &Channel, exchange: &str, key: &str, prefix: &str, n: usize) {
    for i in 0..n {
        let confirm = ch
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                format!("{prefix}-{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        assert!(
            confirm.await.unwrap().is_ack(),
            "{prefix}-{i} not confirmed"
        );
    }
}

/// The messages in `queue` once it holds `n` (within 60 s), taken out:
/// bodies and headers.
async fn take(ch: &Channel, queue: &str, n: usize) -> Vec<(String, Option<FieldTable>)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    while got.len() < n {
        match ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            Some(m) => got.push((
                String::from_utf8_lossy(&m.delivery.data).into_owned(),
                m.delivery.properties.headers().clone(),
            )),
            None => {
                assert!(
                    Instant::now() < deadline,
                    "{queue}: {} of {n} after 60 s",
                    got.len()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    got
}

fn bodies(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

fn present(test: &str) -> bool {
    common::present_or_skipped(
        test,
        Path::new(SERVER).exists() && Path::new(CTL).exists(),
        "WARREN_REQUIRE_RABBITMQ",
        "no RabbitMQ (apt-get install rabbitmq-server)",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmqs_shovel_and_federation_work_with_warren_at_the_other_end() {
    if !present("rabbitmqs_shovel_and_federation_work_with_warren_at_the_other_end") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let warren = Node::start(dir.path(), &[]);
    let rabbit = tokio::task::spawn_blocking(Rabbit::start).await.unwrap();
    let warren_uri = format!("amqp://guest:guest@127.0.0.1:{}", warren.port);
    let run = async {
        let w = connect(&warren.url()).await;
        let wch = w.create_channel().await.unwrap();
        wch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let r = connect(&rabbit.url()).await;
        let rch = r.create_channel().await.unwrap();
        rch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();

        // Shovels both ways, each acking its source once its destination
        // confirmed.
        for q in ["to-rabbit", "from-rabbit"] {
            durable_queue(&wch, q).await;
        }
        for q in ["to-warren", "from-warren"] {
            durable_queue(&rch, q).await;
        }
        publish(&wch, "", "to-rabbit", "w", 100).await;
        publish(&rch, "", "to-warren", "r", 100).await;
        let shovel = |name: &str, src: &str, src_queue: &str, dest: &str, dest_queue: &str| {
            let def = serde_json::json!({
                "src-uri": src, "src-queue": src_queue,
                "dest-uri": dest, "dest-queue": dest_queue,
                "ack-mode": "on-confirm", "dest-add-forward-headers": true,
            });
            rabbit.ctl(&["set_parameter", "shovel", name, &def.to_string()]);
        };
        shovel("w2r", &warren_uri, "to-rabbit", "amqp://", "from-warren");
        shovel("r2w", "amqp://", "to-warren", &warren_uri, "from-rabbit");
        let moved: Vec<String> = take(&rch, "from-warren", 100)
            .await
            .into_iter()
            .map(|(b, _)| b)
            .collect();
        assert_eq!(moved, bodies("w", 100), "Warren to RabbitMQ, in order");
        let moved = take(&wch, "from-rabbit", 100).await;
        assert_eq!(
            moved.iter().map(|(b, _)| b.clone()).collect::<Vec<_>>(),
            bodies("r", 100),
            "RabbitMQ to Warren, in order"
        );
        assert!(
            moved[0]
                .1
                .as_ref()
                .is_some_and(|h| h.inner().contains_key("x-shovelled")),
            "the shovel's forward headers reached Warren: {:?}",
            moved[0].1
        );
        // Each source acked what it moved.
        let left = |ch: &Channel, q: &'static str| {
            let ch = ch.clone();
            async move {
                ch.queue_declare(
                    q.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap()
                .message_count()
            }
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while left(&wch, "to-rabbit").await + left(&rch, "to-warren").await > 0 {
            assert!(Instant::now() < deadline, "a shovel's source kept messages");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // A federated exchange whose upstream is Warren.
        durable_direct_exchange(&wch, "fed.x").await;
        let upstream = serde_json::json!({ "uri": warren_uri });
        rabbit.ctl(&[
            "set_parameter",
            "federation-upstream",
            "warren",
            &upstream.to_string(),
        ]);
        rabbit.ctl(&[
            "set_policy",
            "fed",
            "^fed\\.",
            r#"{"federation-upstream-set":"all"}"#,
            "--apply-to",
            "exchanges",
        ]);
        durable_direct_exchange(&rch, "fed.x").await;
        durable_queue(&rch, "fed.q").await;
        rch.queue_bind(
            "fed.q".into(),
            "fed.x".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        // Until the link is up and bound upstream, what Warren's exchange
        // gets goes nowhere: probe until one arrives.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut probes = 0;
        loop {
            publish(&wch, "fed.x", "k", &format!("probe{probes}"), 1).await;
            probes += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
            if rch
                .basic_get("fed.q".into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
                .is_some()
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the federated exchange got nothing from Warren in 60 s: {}",
                rabbit.ctl(&["eval", "rabbit_federation_status:status()."])
            );
        }
        publish(&wch, "fed.x", "other", "unbound", 50).await;
        publish(&wch, "fed.x", "k", "bound", 50).await;
        // Probes still on their way come first.
        let mut got = Vec::new();
        while got.len() < 50 {
            got.extend(
                take(&rch, "fed.q", 1)
                    .await
                    .into_iter()
                    .filter(|(b, _)| !b.starts_with("probe")),
            );
        }
        let got_bodies: Vec<String> = got.iter().map(|(b, _)| b.clone()).collect();
        assert_eq!(got_bodies, bodies("bound", 50), "the bound key's, in order");
        let last = got.last().and_then(|(_, h)| h.as_ref());
        assert!(
            last.is_some_and(|h| matches!(
                h.inner().get("x-received-from"),
                Some(AMQPValue::FieldArray(_))
            )),
            "x-received-from names the upstream: {last:?}"
        );
    };
    tokio::time::timeout(Duration::from_secs(240), run)
        .await
        .expect("test timed out");
    drop(rabbit);
}
