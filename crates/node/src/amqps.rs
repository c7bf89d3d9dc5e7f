//! The AMQPS listener: AMQP 0-9-1 over TLS (rustls), RabbitMQ's
//! `listeners.ssl.default` with `ssl_options.certfile` / `keyfile` (PEM).
//! Each accepted connection runs the same broker shell as plain AMQP, on
//! its shard's thread once its TLS handshake is done.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::shards::Shards;

use crate::client::TlsSocket;
use crate::config::Tls;
use crate::sockets::ClientSockets;

/// How long a client may take over the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Binds `addr`, loads the certificate and key, and serves AMQPS clients
/// until the process ends; returns the bound address.
pub(crate) async fn start(
    addr: SocketAddr,
    tls: &Tls,
    shards: Shards,
    running: Arc<AtomicBool>,
    sockets: ClientSockets,
) -> anyhow::Result<SocketAddr> {
    let cert = tls
        .certfile
        .as_ref()
        .context("listeners.ssl.default needs ssl_options.certfile")?;
    let key = tls
        .keyfile
        .as_ref()
        .context("listeners.ssl.default needs ssl_options.keyfile")?;
    let certs = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading certificates from {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading certificates from {}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading the private key from {}", key.display()))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("TLS protocol versions")?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("the AMQPS certificate and key do not match")?;
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening for AMQPS on {addr}"))?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            // Held from accept, through the TLS handshake, to the close.
            let socket = sockets.reserve().await;
            let Ok((stream, peer)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            };
            let socket = socket.hold();
            let _ = stream.set_nodelay(true);
            let (acceptor, shards, running) = (acceptor.clone(), shards.clone(), running.clone());
            tokio::spawn(async move {
                // As long as an AMQP handshake may take: a silent or slow
                // client does not hold a task and a socket for ever.
                let handshake = tokio::time::timeout(
                    TLS_HANDSHAKE_TIMEOUT,
                    acceptor.accept(TlsSocket::new(stream)),
                );
                match handshake.await {
                    Ok(Ok(tls)) => shards.serve_on(shards.pick(), tls, peer, running, socket),
                    Ok(Err(e)) => tracing::info!(%peer, error = %e, "AMQPS handshake failed"),
                    Err(_) => tracing::info!(%peer, "AMQPS handshake timed out"),
                }
            });
        }
    });
    tracing::info!(addr = %local, "AMQPS listening");
    Ok(local)
}
