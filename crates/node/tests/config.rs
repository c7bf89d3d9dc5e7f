//! `warren.conf`: the `warren` binary started with a configuration file.

mod common;

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

/// A port nothing listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the child when the test ends, however it ends.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn warren(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_warren"));
    c.current_dir(dir)
        .env("RUST_LOG", "warn")
        .env_remove("WARREN_CONFIG_FILE")
        .env_remove("WARREN_NODENAME");
    c
}

/// `GET path` of the management API on `port`, as the configured admin.
fn api(port: u16, path: &str) -> serde_json::Value {
    common::api_get_as(&format!("127.0.0.1:{port}"), "admin:s3cret", path)
}

/// The payload of the connection.start frame the node on `port` sends a
/// client that opens with the AMQP 0-9-1 header (its server properties).
fn connection_start(port: u16) -> Vec<u8> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"AMQP\x00\x00\x09\x01").unwrap();
    let mut head = [0u8; 7];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[0], 1, "a method frame");
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
    let mut payload = vec![0u8; usize::try_from(size).unwrap()];
    s.read_exact(&mut payload).unwrap();
    assert_eq!(payload[..4], [0, 10, 0, 10], "connection.start");
    payload
}

#[tokio::test]
async fn a_node_runs_as_its_warren_conf_says() {
    let dir = tempfile::tempdir().unwrap();
    let (amqp, http) = (free_port(), free_port());
    let data = dir.path().join("data");
    let conf = dir.path().join("warren.conf");
    std::fs::write(
        &conf,
        format!(
            "# a node from its configuration file\n\
             listeners.tcp.default = 127.0.0.1:{amqp}\n\
             management.tcp.ip = 127.0.0.1\n\
             management.tcp.port = {http}\n\
             prometheus.tcp.ip = 127.0.0.1\n\
             prometheus.tcp.port = 0\n\
             nodename = warren@fromconf\n\
             data_dir = {}\n\
             default_user = admin\n\
             default_pass = s3cret\n\
             log.console.level = warning\n\
             vm_memory_high_watermark.absolute = 2GB\n\
             disk_free_limit.absolute = 50MB\n\
             product.name = RabbitMQ\n\
             product.version = 3.10.8\n",
            data.display()
        ),
    )
    .unwrap();
    let log = dir.path().join("stderr.log");
    let mut child = Kill(
        warren(dir.path())
            .arg("--config")
            .arg(&conf)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.starts_with(&format!(
            "Warren node warren@fromconf ready, AMQP on 127.0.0.1:{amqp}, HTTP on 127.0.0.1:{http}, metrics on 127.0.0.1:"
        )),
        "{line}"
    );
    assert!(data.join("metadata.json").exists(), "data in data_dir");
    // The resource limits are the configured ones.
    let node = api(http, "/api/nodes/warren%40fromconf");
    assert_eq!(node["mem_limit"], 2_000_000_000u64, "{node}");
    assert_eq!(node["disk_free_limit"], 50_000_000u64, "{node}");
    assert_eq!(node["mem_alarm"], false, "{node}");
    // The product as configured, to operators and to clients (RabbitMQ's
    // `product.name` and `product.version`).
    let overview = api(http, "/api/overview");
    assert_eq!(overview["product_name"], "RabbitMQ", "{overview}");
    assert_eq!(overview["product_version"], "3.10.8", "{overview}");
    let start = connection_start(amqp);
    for (key, value) in [("product", "RabbitMQ"), ("version", "3.10.8")] {
        let mut field = vec![u8::try_from(key.len()).unwrap()];
        field.extend_from_slice(key.as_bytes());
        field.push(b'S');
        field.extend_from_slice(&u32::try_from(value.len()).unwrap().to_be_bytes());
        field.extend_from_slice(value.as_bytes());
        assert!(
            start.windows(field.len()).any(|w| w == field),
            "no {key} = {value} in connection.start: {}",
            String::from_utf8_lossy(&start)
        );
    }

    tokio::time::timeout(Duration::from_secs(60), async {
        let url = format!("amqp://admin:s3cret@127.0.0.1:{amqp}/%2f");
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("the default user connects on the configured port");
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            "q".into(),
            lapin::options::QueueDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
        let guest = format!("amqp://guest:guest@127.0.0.1:{amqp}/%2f");
        assert!(
            Connection::connect(&guest, ConnectionProperties::default())
                .await
                .is_err(),
            "default_user replaces guest"
        );
    })
    .await
    .expect("timed out");

    // The flag beats the environment, which beats the file.
    drop(child);
    let mut child = Kill(
        warren(dir.path())
            .args(["--amqp-addr", "127.0.0.1:0", "--node-name", "warren@flag"])
            .env("WARREN_CONFIG_FILE", &conf)
            .env("WARREN_HTTP_ADDR", "127.0.0.1:0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("Warren node warren@flag ready"), "{line}");
    assert!(!line.contains(&format!(":{amqp},")), "{line}");
    assert!(!line.contains(&format!(":{http},")), "{line}");
}

#[test]
fn a_bad_key_stops_start_up_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("warren.conf");
    std::fs::write(
        &conf,
        "# line 1\nnodename = warren@x\nlistners.tcp.default = 5672\n",
    )
    .unwrap();
    let out = warren(dir.path())
        .arg("--config")
        .arg(&conf)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("warren.conf:3: unknown key \"listners.tcp.default\""),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "never ready: {out:?}");
    assert!(
        !dir.path().join("data").exists(),
        "refused before touching data"
    );

    std::fs::write(&conf, "cluster.boot_wait = soon\n").unwrap();
    let out = warren(dir.path())
        .env("WARREN_CONFIG_FILE", &conf)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("warren.conf:1: \"soon\" is not a number of seconds"),
        "{stderr}"
    );
}
