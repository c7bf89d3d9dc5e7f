//! An in-process broker behind the served router, and plain HTTP/1.1
//! requests to it over TCP.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use base64::Engine as _;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use warren_broker::meta::MemoryStore;
use warren_broker::{Broker, BrokerConfig};
use warren_management::Management;

/// A broker named `warren@a` with data in `dir`, over the default
/// in-memory metadata store.
pub fn broker(dir: &std::path::Path) -> Arc<Mutex<Broker>> {
    let mut cfg = BrokerConfig::new(dir);
    cfg.node_name = "warren@a".into();
    Arc::new(Mutex::new(
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
