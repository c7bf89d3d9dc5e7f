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
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A node started with an AMQPS listener (a fresh self-signed certificate
/// for `localhost`) and `args`: the node, its AMQPS address and the
/// certificate's PEM. The node is killed when the directory's test ends.
fn start(dir: &std::path::Path, args: &[&str]) -> (Child, String, String) {
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
    let addr = line
        .split("AMQPS on ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .map(str::trim)
        .unwrap_or_else(|| panic!("no AMQPS address in the ready line: {line:?}"))
        .to_owned();
    (child, addr, cert.pem())
}

#[tokio::test]
async fn a_tls_client_gets_connection_start_over_amqps() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr, pem) = start(dir.path(), &[]);
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(pem.as_bytes()).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake with the node's certificate");
    tls.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
    let mut head = [0u8; 11];
    tls.read_exact(&mut head).await.unwrap();
    // A method frame on channel 0: connection.start (class 10, method 10).
    assert_eq!(head[0], 1, "a method frame");
    assert_eq!(&head[1..3], &[0, 0], "on channel 0");
    assert_eq!(&head[7..11], &[0, 10, 0, 10], "connection.start");
    let _ = child.kill();
    let _ = child.wait();
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
    let (mut child, addr, pem) = start(dir.path(), &["--shards", "2"]);
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, pem).unwrap();
    let port = addr.rsplit(':').next().expect("a port");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/amqps_shards.py");
    let out = Command::new("python3")
        .args([script, port, ca.to_str().expect("a UTF-8 path")])
        .env("PYTHONWARNINGS", "ignore")
        .output()
        .expect("run python3");
    let _ = child.kill();
    let _ = child.wait();
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
