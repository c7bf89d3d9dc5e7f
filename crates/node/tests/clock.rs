//! The system clock stepped under a running node, as NTP or `date -s` steps
//! it: libfaketime (`LD_PRELOAD`, the wall clock only, its offset read from
//! a file the test rewrites) moves the node's wall clock an hour forward,
//! then two hours back. The broker times everything by the monotonic clock
//! (`warren_mirror_driver::steady_clock_ms`), so neither step expires a
//! queue or a message early, ends a client's connection for heartbeats it
//! did send, or stops the node's heartbeats. Without libfaketime
//! (`apt-get install libfaketime`) the test says so and passes, unless
//! `WARREN_REQUIRE_FAKETIME=1`.

#![allow(clippy::print_stderr)]

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Node, login_with_heartbeat, within};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Where Debian's libfaketime package puts the library.
const LIBFAKETIME: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
];

fn libfaketime() -> Option<PathBuf> {
    let found = LIBFAKETIME.iter().map(PathBuf::from).find(|p| p.exists());
    if found.is_none() {
        assert!(
            std::env::var("WARREN_REQUIRE_FAKETIME").as_deref() != Ok("1"),
            "WARREN_REQUIRE_FAKETIME=1 but libfaketime is not installed (apt-get install libfaketime)"
        );
        eprintln!("clock test skipped: libfaketime is not installed (apt-get install libfaketime)");
    }
    found
}

/// A client heartbeat frame.
const HEARTBEAT: [u8; 8] = [8, 0, 0, 0, 0, 0, 0, 0xCE];

/// What a raw client read for a while: the node's heartbeat frames, and
/// whether the node closed the connection (connection.close or EOF).
#[derive(Debug, Default)]
struct Heard {
    heartbeats: usize,
    /// When each heartbeat was read, from the start of the listening.
    at: Vec<Duration>,
    closed: bool,
}

/// Reads the node's frames on `s` for `for_`, sending a heartbeat of ours
/// every `ours` (never, if `None`).
async fn listen(s: &mut TcpStream, for_: Duration, ours: Option<Duration>) -> Heard {
    let until = Instant::now() + for_;
    let mut heard = Heard::default();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    let mut next_ours = ours.map(|d| Instant::now() + d);
    loop {
        let wake = next_ours.map_or(until, |n| n.min(until));
        match tokio::time::timeout_at(wake, s.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => {
                heard.closed = true;
                return heard;
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => {}
        }
        // Whole frames: type, channel, size, payload, end octet.
        while buf.len() >= 7 {
            let size = u32::from_be_bytes(buf[3..7].try_into().unwrap()) as usize;
            if buf.len() < 8 + size {
                break;
            }
            match buf[0] {
                8 => {
                    heard.heartbeats += 1;
                    heard
                        .at
                        .push(for_ - until.saturating_duration_since(Instant::now()));
                }
                // connection.close
                1 if buf[7..11] == [0, 10, 0, 50] => heard.closed = true,
                _ => {}
            }
            buf.drain(..8 + size);
        }
        if Instant::now() >= until {
            return heard;
        }
        if let (Some(at), Some(every)) = (next_ours, ours)
            && Instant::now() >= at
        {
            s.write_all(&HEARTBEAT).await.expect("send a heartbeat");
            next_ours = Some(Instant::now() + every);
        }
    }
}

/// Sets the node's wall clock to the real one moved by `offset` (libfaketime's
/// syntax: "+1h", "-1h").
fn step(file: &Path, offset: &str) {
    std::fs::write(file, format!("{offset}\n")).expect("write the faketime file");
}

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// Whether queue `name` exists (a passive declare, on a channel of its own).
async fn exists(conn: &lapin::Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.expect("channel");
    let opts = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    ch.queue_declare(name.into(), opts, FieldTable::default())
        .await
        .is_ok()
}

async fn body_of_next(ch: &Channel, queue: &str) -> Option<Vec<u8>> {
    ch.basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
        .map(|m| m.delivery.data.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stepped_system_clock_moves_no_timer_of_the_broker() {
    let Some(lib) = libfaketime() else { return };
    let dir = tempfile::tempdir().unwrap();
    let offset = dir.path().join("faketime");
    step(&offset, "+0");
    let env: [(&str, &OsStr); 4] = [
        ("LD_PRELOAD", lib.as_os_str()),
        ("FAKETIME_TIMESTAMP_FILE", offset.as_os_str()),
        ("FAKETIME_NO_CACHE", OsStr::new("1")),
        ("DONT_FAKE_MONOTONIC", OsStr::new("1")),
    ];
    let node = Node::start_with_env(&dir.path().join("data"), &[], &env);
    within(async {
        let conn = node.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let expires = table(&[("x-expires", AMQPValue::LongInt(600_000))]);
        ch.queue_declare("expires".into(), QueueDeclareOptions::default(), expires)
            .await
            .unwrap();
        let ttl = table(&[("x-message-ttl", AMQPValue::LongInt(600_000))]);
        ch.queue_declare("ttl".into(), QueueDeclareOptions::default(), ttl)
            .await
            .unwrap();
        ch.basic_publish(
            "".into(),
            "ttl".into(),
            BasicPublishOptions::default(),
            b"ten minutes",
            BasicProperties::default(),
        )
        .await
        .unwrap();

        // A client that negotiated a 4 s heartbeat: the node sends one every
        // 2 s and gives up on the client after 8 s of silence.
        let mut raw = TcpStream::connect(("127.0.0.1", node.port)).await.unwrap();
        raw.write_all(&login_with_heartbeat(4)).await.unwrap();
        let before = listen(
            &mut raw,
            Duration::from_secs(3),
            Some(Duration::from_secs(1)),
        )
        .await;
        assert!(!before.closed, "the raw client was closed before any step");

        // An hour forward, the raw client silent for 3 s of it (it last
        // spoke under a second ago): read by the wall clock, its silence
        // looks like an hour.
        step(&offset, "+1h");
        let forward = listen(&mut raw, Duration::from_secs(3), None).await;
        assert!(
            !forward.closed,
            "an hour's step forward ended a client that had sent its heartbeats"
        );
        assert!(
            exists(&conn, "expires").await,
            "an hour's step forward deleted a queue with a ten-minute x-expires"
        );
        assert_eq!(
            body_of_next(&ch, "ttl").await.as_deref(),
            Some(&b"ten minutes"[..]),
            "an hour's step forward expired a message with a ten-minute TTL"
        );

        // Two hours back: read by the wall clock, the node's last heartbeat
        // was sent two hours from now.
        // Heartbeats stopped by the step would stop for two hours: two in
        // 10 s (five expected) leave room for a node slowed by a loaded
        // machine (a CI run once saw one in 6 s).
        step(&offset, "-1h");
        let back = listen(
            &mut raw,
            Duration::from_secs(10),
            Some(Duration::from_secs(1)),
        )
        .await;
        assert!(!back.closed, "a step back ended the raw client");
        assert!(
            back.heartbeats >= 2,
            "after a step back the node sent {} heartbeats in 10 s (one every 2 s expected), read at {:?}",
            back.heartbeats,
            back.at
        );
        assert!(exists(&conn, "expires").await);
        step(&offset, "+0");
    })
    .await;
}
