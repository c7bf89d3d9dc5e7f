//! The shell of forwarding between brokers: carries [`LinkMsg`]s over the
//! peer transport (any of TCP, QUIC), one connection per direction and
//! node pair, and tells the broker when a node goes down.
//!
//! Outgoing messages are taken from the broker in batches
//! ([`Broker::take_link_out`]), encoded with postcard, fed to the node's
//! connection and flushed once per batch. Incoming batches go to
//! [`Broker::link_input`] under one lock. A node the cluster's failure
//! detector reports down, or whose connection fails, is reported with
//! [`Broker::link_down`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use tokio::sync::Notify;
use warren_broker::{Broker, LinkMsg};
use warren_cluster::{Cluster, NodeEvent};
use warren_transport::{FrameSender, PeerAddr, Transport};

type Shared = Arc<Mutex<Broker>>;

fn lock(b: &Shared) -> MutexGuard<'_, Broker> {
    b.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Starts the forwarding listener on `bind_ip` (any port), the sender and
/// the failure watcher; returns the listener's address.
pub(crate) async fn start(
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
    bind_ip: std::net::IpAddr,
) -> anyhow::Result<String> {
    let listen = PeerAddr::new(std::net::SocketAddr::new(bind_ip, 0).to_string());
    let mut listener = transport
        .listen(&listen)
        .await
        .context("listening for forwarded queue work")?;
    let addr = listener.local_addr().to_string();
    {
        let broker = broker.clone();
        tokio::spawn(async move {
            while let Ok(conn) = listener.accept().await {
                let peer = conn.peer_node().to_string();
                let (_tx, rx) = conn.split();
                tokio::spawn(receive(peer, rx, broker.clone()));
            }
        });
    }
    let notify = Arc::new(Notify::new());
    {
        let n = notify.clone();
        lock(&broker).set_link_waker(Arc::new(move || n.notify_one()));
    }
    tokio::spawn(send(cluster.clone(), transport, broker.clone(), notify));
    tokio::spawn(watch_down(cluster, broker));
    tracing::info!(%addr, "forwarding listener up");
    Ok(addr)
}

async fn receive(peer: String, mut rx: Box<dyn warren_transport::FrameReceiver>, broker: Shared) {
    let mut frames = Vec::new();
    loop {
        frames.clear();
        match rx.recv_batch(&mut frames, 1024).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut msgs = Vec::with_capacity(frames.len());
        for f in &frames {
            match postcard::from_bytes::<LinkMsg>(f) {
                Ok(m) => msgs.push(m),
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "dropping a malformed link message; closing the link");
                    return;
                }
            }
        }
        lock(&broker).link_input(&peer, msgs, now_ms());
    }
}

async fn send(
    cluster: Cluster,
    transport: Arc<dyn Transport>,
    broker: Shared,
    notify: Arc<Notify>,
) {
    let mut senders: HashMap<String, Box<dyn FrameSender>> = HashMap::new();
    loop {
        notify.notified().await;
        let out = lock(&broker).take_link_out();
        for (node, msgs) in out {
            if !senders.contains_key(&node) {
                let addr = cluster
                    .local()
                    .nodes
                    .get(&node)
                    .and_then(|n| n.link_addr.clone());
                let conn = match addr {
                    Some(a) => transport.connect(&PeerAddr::new(a)).await.ok(),
                    None => None,
                };
                match conn {
                    Some(c) => {
                        let (tx, _rx) = c.split();
                        senders.insert(node.clone(), tx);
                    }
                    None => {
                        tracing::warn!(%node, "cannot reach node for forwarded queue work");
                        lock(&broker).link_down(&node, now_ms());
                        continue;
                    }
                }
            }
            let Some(tx) = senders.get_mut(&node) else {
                continue;
            };
            let mut ok = true;
            for m in &msgs {
                match postcard::to_allocvec(m) {
                    Ok(v) => {
                        if tx.feed(Bytes::from(v)).is_err() {
                            ok = false;
                            break;
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "encoding a link message failed"),
                }
            }
            if !ok || tx.flush().await.is_err() {
                tracing::warn!(%node, "forwarding link broke");
                senders.remove(&node);
                lock(&broker).link_down(&node, now_ms());
            }
        }
    }
}

async fn watch_down(cluster: Cluster, broker: Shared) {
    let mut events = cluster.subscribe();
    loop {
        match events.recv().await {
            Ok(NodeEvent::Down(n)) => {
                tracing::info!(node = %n, "node down: failing its forwarded work");
                lock(&broker).link_down(n.as_str(), now_ms());
            }
            Ok(NodeEvent::Up(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(_) => return,
        }
    }
}
