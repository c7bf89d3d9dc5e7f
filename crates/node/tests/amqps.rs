//! AMQPS: a node with `listeners.ssl.default` in its `warren.conf` speaks
//! AMQP over TLS with the configured certificate, on a node of two shards
//! too, where a client moves to its queue's shard with its TLS session.

#![allow(clippy::print_stderr)]

mod common;

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// A node with an AMQPS listener.
struct Started {
    child: Child,
    /// Its AMQP, AMQPS and management addresses (`HOST:PORT`).
    amqp: String,
    amqps: String,
    http: String,
    /// Its certificate, PEM.
    pem: String,
}

/// The address the ready line gives after `label`.
fn ready_addr(line: &str, label: &str) -> String {
    line.split(label)
        .nth(1)
        .and_then(|s| s.split(',').next())
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {label:?} in the ready line: {line:?}"))
        .to_owned()
}

/// Starts a node with an AMQPS listener (a fresh self-signed certificate
/// for `localhost`) and `args`.
fn start(dir: &std::path::Path, args: &[&str]) -> Started {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cert_file, key_file) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let conf = dir.join("warren.conf");
    std::fs::write(
        &conf,
        format!(
            "listeners.tcp.default = 127.0.0.1:0\n\
             management.tcp.ip = 127.0.0.1\n\
             management.tcp.port = 0\n\
             prometheus.tcp.ip = 127.0.0.1\n\
             prometheus.tcp.port = 0\n\
             data_dir = {}\n\
             listeners.ssl.default = 127.0.0.1:0\n\
             ssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\n",
            dir.join("data").display(),
            cert_file.display(),
            key_file.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_warren"))
        .arg("--config")
        .arg(&conf)
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("WARREN_CONFIG_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    Started {
        child,
        amqp: ready_addr(&line, "AMQP on "),
        amqps: ready_addr(&line, "AMQPS on "),
        http: ready_addr(&line, "HTTP on "),
        pem: cert.pem(),
    }
}

/// The connection whose client port is `port`, as `/api/connections` shows it.
fn shown_connection(http: &str, port: u16) -> serde_json::Value {
    let list = common::api_get(http, "/api/connections");
    list.as_array()
        .into_iter()
        .flatten()
        .find(|c| c["peer_port"] == port)
        .cloned()
        .unwrap_or_else(|| panic!("no connection from port {port} in {list}"))
}

/// Sends the protocol header and reads the frame head that answers it.
async fn header_answer(s: &mut (impl AsyncRead + AsyncWrite + Unpin)) -> [u8; 11] {
    s.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
    let mut head = [0u8; 11];
    s.read_exact(&mut head).await.unwrap();
    head
}

/// A TLS client gets connection.start, and the management API shows its
/// connection with `ssl` true and its TLS version, as RabbitMQ does (a
/// plain one's `ssl` false).
#[tokio::test]
async fn a_tls_client_gets_connection_start_over_amqps_and_shows_as_ssl() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = start(dir.path(), &[]);
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(node.pem.as_bytes()).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(&node.amqps).await.unwrap();
    let tls_port = tcp.local_addr().unwrap().port();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake with the node's certificate");
    let head = header_answer(&mut tls).await;
    // A method frame on channel 0: connection.start (class 10, method 10).
    assert_eq!(head[0], 1, "a method frame");
    assert_eq!(&head[1..3], &[0, 0], "on channel 0");
    assert_eq!(&head[7..11], &[0, 10, 0, 10], "connection.start");
    let mut plain = tokio::net::TcpStream::connect(&node.amqp).await.unwrap();
    let plain_port = plain.local_addr().unwrap().port();
    assert_eq!(&header_answer(&mut plain).await[7..11], &[0, 10, 0, 10]);
    let shown = shown_connection(&node.http, tls_port);
    assert_eq!(
        (&shown["ssl"], &shown["ssl_protocol"]),
        (&serde_json::json!(true), &serde_json::json!("tlsv1.3")),
        "the AMQPS connection: {shown}"
    );
    let shown = shown_connection(&node.http, plain_port);
    assert_eq!(
        (&shown["ssl"], &shown["ssl_protocol"]),
        (&serde_json::json!(false), &serde_json::Value::Null),
        "the plain connection: {shown}"
    );
    let _ = node.child.kill();
    let _ = node.child.wait();
}

/// pika over TLS on `--shards 2` (`tests/python/amqps_shards.py`): four
/// clients given to the shards in turn, three of them naming a queue of
/// the first one's shard, so that the second and the fourth move there
/// (their TLS sessions to that shard's thread) while publishing with
/// confirms and consuming with acks; every message arrives, in order.
#[test]
fn amqps_clients_move_to_their_queues_shard_with_their_tls_session() {
    if !common::has_pika("amqps_clients_move_to_their_queues_shard_with_their_tls_session") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut node = start(dir.path(), &["--shards", "2"]);
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &node.pem).unwrap();
    let port = node.amqps.rsplit(':').next().expect("a port");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/amqps_shards.py");
    let out = Command::new("python3")
        .args([script, port, ca.to_str().expect("a UTF-8 path")])
        .env("PYTHONWARNINGS", "ignore")
        .output()
        .expect("run python3");
    let _ = node.child.kill();
    let _ = node.child.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "amqps_shards.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(
        v,
        serde_json::json!({"in_order": true, "received": 200, "left": 0}),
        "over TLS through both shards"
    );
}
