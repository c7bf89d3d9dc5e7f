//! An in-process broker behind the served router, and plain HTTP/1.1
//! requests to it over TCP; [`amqp`] serves the broker to AMQP clients as
//! the node's shell does (without its flow control and group commits:
//! transient messages only).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::BytesMut;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use warren_broker::meta::MemoryStore;
use warren_broker::{Broker, BrokerConfig};
use warren_lock::MeasuredMutex;
use warren_management::Management;

/// A broker named `warren@a` with data in `dir`, over the default
/// in-memory metadata store.
pub fn broker(dir: &std::path::Path) -> Arc<MeasuredMutex<Broker>> {
    let mut cfg = BrokerConfig::new(dir);
    cfg.node_name = "warren@a".into();
    Arc::new(MeasuredMutex::new(
        Broker::open(cfg, Box::new(MemoryStore::default())).unwrap(),
    ))
}

/// Serves `state` on a free loopback port; its address.
pub async fn serve(state: Management) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(warren_management::serve(listener, state));
    addr
}

/// One request as `user`: the status and the body text.
pub async fn request_as(
    addr: &str,
    (user, password): (&str, &str),
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {auth}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_owned();
    (status, body)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Serves `broker` to AMQP clients on a free loopback port; the URL to
/// connect to as guest.
pub async fn amqp(broker: Arc<MeasuredMutex<Broker>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ticked = broker.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            ticked.lock().tick(now_ms());
        }
    });
    tokio::spawn(async move {
        while let Ok((stream, peer)) = listener.accept().await {
            tokio::spawn(client(broker.clone(), stream, peer));
        }
    });
    format!("amqp://guest:guest@{addr}/%2F")
}

/// One client connection: bytes in, the turn's output out in one write.
async fn client(broker: Arc<MeasuredMutex<Broker>>, stream: TcpStream, peer: SocketAddr) {
    let notify = Arc::new(Notify::new());
    let id = {
        let n = notify.clone();
        broker
            .lock()
            .connect(peer, Arc::new(move || n.notify_one()))
    };
    let (mut rd, mut wr) = stream.into_split();
    let (mut input, mut output) = (BytesMut::with_capacity(65_536), BytesMut::new());
    loop {
        let open = tokio::select! {
            r = rd.read_buf(&mut input) => match r {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let mut b = broker.lock();
                    b.handle_input(id, &mut input, now_ms());
                    b.take_output(id, &mut output)
                }
            },
            () = notify.notified() => broker.lock().take_output(id, &mut output),
        };
        if wr.write_all(&output).await.is_err() || !open {
            break;
        }
        output.clear();
    }
    drop(broker.lock().disconnect(id, now_ms()));
}
