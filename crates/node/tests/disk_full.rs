//! A node whose disk fills up: a real tmpfs of 16 MiB mounted for the test
//! (root only; skipped with a message elsewhere, unless
//! `WARREN_REQUIRE_MOUNT=1`), a real `warren` process and lapin. The disk
//! free alarm is off (`disk_free_limit.absolute = 0`), as when the disk
//! fills faster than the alarm looks. Publishes the node cannot store are
//! nacked, never left unanswered; once space is freed the queue opens its
//! log again and confirms again; every message confirmed at any point is
//! delivered, after a SIGKILL and restart too.

mod common;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Node, within};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};

const QUEUE: &str = "disk.q";

/// A tmpfs mounted at a directory for the test's life.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (mount's syntax) at `dir`; `None`, after
    /// saying why, where this process may not mount.
    fn mount(dir: &Path, size: &str) -> Option<Self> {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "warren-test"])
            .arg(dir)
            .output();
        let failed = match out {
            Ok(o) if o.status.success() => return Some(Self(dir.to_owned())),
            Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
            Err(e) => e.to_string(),
        };
        let required = std::env::var("WARREN_REQUIRE_MOUNT").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "WARREN_REQUIRE_MOUNT=1 but mount failed: {failed}"
        );
        #[allow(clippy::print_stderr)]
        {
            eprintln!("skipped: cannot mount a tmpfs here ({failed})");
        }
        None
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A confirming channel on a new connection to `node`, the durable queue declared.
async fn channel(node: &Node) -> (lapin::Connection, Channel) {
    let conn = node.connect().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(QUEUE.into(), durable, FieldTable::default())
        .await
        .expect("declare");
    (conn, ch)
}

/// Publishes `body` (persistent, padded to 8 KiB) and returns whether it
/// was acked (false: nacked). Within 60 s: never left unanswered.
async fn publish(ch: &Channel, body: &str) -> bool {
    let mut payload = body.as_bytes().to_vec();
    payload.push(b' ');
    payload.resize(8 << 10, b'.');
    let confirm = ch
        .basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            &payload,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .expect("publish");
    within(confirm).await.expect("confirm").is_ack()
}

/// Every message of the queue (basic.get with acks), by the name at the
/// start of its body.
async fn take_all(ch: &Channel) -> BTreeSet<String> {
    let mut got = BTreeSet::new();
    while let Some(m) = ch
        .basic_get(QUEUE.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        let body = String::from_utf8_lossy(&m.delivery.data).into_owned();
        got.insert(body.split(' ').next().unwrap_or_default().to_owned());
    }
    got
}

/// Fills the file system of `dir` with one file until it refuses more.
fn fill(dir: &Path) {
    let mut f = std::fs::File::create(dir.join("filler")).expect("create the filler");
    let chunk = vec![0u8; 64 << 10];
    while f.write_all(&chunk).is_ok() {}
}

#[tokio::test]
async fn a_full_disk_nacks_what_it_cannot_store_and_the_queue_confirms_again_once_space_is_freed() {
    let root = tempfile::tempdir().expect("tempdir");
    let disk = root.path().join("disk");
    std::fs::create_dir(&disk).expect("mount point");
    let Some(_tmpfs) = Tmpfs::mount(&disk, "16m") else {
        return;
    };
    let conf = root.path().join("warren.conf");
    std::fs::write(&conf, "disk_free_limit.absolute = 0\n").expect("config");
    let conf = conf.to_str().expect("utf-8 path");
    let data = disk.join("data");
    let mut node = Node::start(&data, &["--config", conf]);
    let (conn, ch) = channel(&node).await;

    let mut confirmed = BTreeSet::new();
    for i in 0..50 {
        let name = format!("before-{i}");
        assert!(
            publish(&ch, &name).await,
            "{name} nacked with room on the disk"
        );
        confirmed.insert(name);
    }

    fill(&disk);
    // Each publish is answered; the disk being full, one is nacked soon
    // (what still fitted, in a page already the file's, may be acked).
    let mut nacked = 0;
    for i in 0..2_000 {
        let name = format!("full-{i}");
        if publish(&ch, &name).await {
            confirmed.insert(name);
        } else {
            nacked += 1;
            if nacked == 10 {
                break;
            }
        }
    }
    assert_eq!(nacked, 10, "2,000 publishes onto a full disk, none nacked");

    std::fs::remove_file(disk.join("filler")).expect("free the disk");
    // The queue opens its log again within a few seconds (it tries every
    // second), nacking publishes meanwhile.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = 0;
    loop {
        let name = format!("after-{i}");
        i += 1;
        if publish(&ch, &name).await {
            confirmed.insert(name);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no publish confirmed 30 s after space was freed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for j in 0..20 {
        let name = format!("later-{j}");
        assert!(
            publish(&ch, &name).await,
            "{name} nacked after the queue came back"
        );
        confirmed.insert(name);
    }
    let got = take_all(&ch).await;
    let lost: Vec<&String> = confirmed.difference(&got).collect();
    assert!(lost.is_empty(), "confirmed but not delivered: {lost:?}");
    drop(conn);

    // What the node confirmed is on its disk: after a SIGKILL, the
    // restarted node has every message confirmed and not yet taken, here
    // the ones published now.
    let (conn, ch) = channel(&node).await;
    let mut kept = BTreeSet::new();
    for k in 0..20 {
        let name = format!("kept-{k}");
        assert!(publish(&ch, &name).await, "{name} nacked");
        kept.insert(name);
    }
    drop(conn);
    node.kill();
    let node = Node::start(&data, &["--config", conf]);
    let (_conn, ch) = channel(&node).await;
    assert_eq!(take_all(&ch).await, kept);
}
