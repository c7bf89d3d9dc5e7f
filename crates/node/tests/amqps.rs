//! AMQPS: a node with `listeners.ssl.default` in its `warren.conf` speaks
//! AMQP over TLS with the configured certificate.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

#[tokio::test]
async fn a_tls_client_gets_connection_start_over_amqps() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let conf = dir.path().join("warren.conf");
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
            dir.path().join("data").display(),
            cert_file.display(),
            key_file.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_warren"))
        .arg("--config")
        .arg(&conf)
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

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(cert.pem().as_bytes()).unwrap())
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
