//! A node whose disk fills up: a real tmpfs mounted for the test (root
//! only; skipped with a message elsewhere, unless `WARREN_REQUIRE_MOUNT=1`),
//! real `warren` processes and lapin. The disk free alarm is off
//! (`disk_free_limit.absolute = 0`), as when the disk fills faster than the
//! alarm looks.
//!
//! - Alone: publishes the node cannot store are nacked, never left
//!   unanswered; once space is freed the queue opens its log again and
//!   confirms again; every message confirmed at any point is delivered,
//!   after a SIGKILL and restart too.
//! - A cluster member: its Raft log cannot be written either, so the node
//!   stops with a clear error (fail-stop), its mirrored queue's mirrors take
//!   over with every confirmed message, and once space is freed it starts
//!   again with its unmirrored queue's messages.

mod common;
mod peers;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Node, within};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use peers::{declare_durable, eventually, set_ha_all, three_with};

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

/// A confirming channel on a new connection to `url`.
async fn channel(url: &str) -> (Connection, Channel) {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    (conn, ch)
}

/// [`channel`] to `node`, the durable queue [`QUEUE`] declared.
async fn queue_channel(node: &Node) -> (Connection, Channel) {
    let (conn, ch) = channel(&node.url()).await;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(QUEUE.into(), durable, FieldTable::default())
        .await
        .expect("declare");
    (conn, ch)
}

/// Publishes `body` (persistent, padded to 8 KiB) to `queue` and returns
/// whether it was acked (false: nacked). Within 60 s: never left
/// unanswered.
async fn publish(ch: &Channel, queue: &str, body: &str) -> bool {
    let mut payload = body.as_bytes().to_vec();
    payload.push(b' ');
    payload.resize(8 << 10, b'.');
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &payload,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .expect("publish");
    within(confirm).await.expect("confirm").is_ack()
}

/// Every message of `queue` (basic.get with acks), by the name at the
/// start of its body.
async fn take_all(ch: &Channel, queue: &str) -> BTreeSet<String> {
    let mut got = BTreeSet::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        let body = String::from_utf8_lossy(&m.delivery.data).into_owned();
        got.insert(body.split(' ').next().unwrap_or_default().to_owned());
    }
    got
}

/// Writes a `warren.conf` with the disk free alarm off into `dir`; its path.
fn no_disk_alarm(dir: &Path) -> String {
    let conf = dir.join("warren.conf");
    std::fs::write(&conf, "disk_free_limit.absolute = 0\n").expect("config");
    conf.to_str().expect("utf-8 path").to_owned()
}

/// Fills the file system of `dir` with one file until it refuses more,
/// to the last byte.
fn fill(dir: &Path) {
    let mut f = std::fs::File::create(dir.join("filler")).expect("create the filler");
    let chunk = vec![0u8; 64 << 10];
    for size in [64 << 10, 4 << 10, 256, 1] {
        while f.write_all(&chunk[..size]).is_ok() {}
    }
}

#[tokio::test]
async fn a_full_disk_nacks_what_it_cannot_store_and_the_queue_confirms_again_once_space_is_freed() {
    let root = tempfile::tempdir().expect("tempdir");
    let disk = root.path().join("disk");
    std::fs::create_dir(&disk).expect("mount point");
    let Some(_tmpfs) = Tmpfs::mount(&disk, "16m") else {
        return;
    };
    let conf = no_disk_alarm(root.path());
    let data = disk.join("data");
    let mut node = Node::start(&data, &["--config", &conf]);
    let (conn, ch) = queue_channel(&node).await;

    let mut confirmed = BTreeSet::new();
    for i in 0..50 {
        let name = format!("before-{i}");
        assert!(
            publish(&ch, QUEUE, &name).await,
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
        if publish(&ch, QUEUE, &name).await {
            confirmed.insert(name);
        } else {
            nacked += 1;
            if nacked == 10 {
                break;
            }
        }
    }
    assert_eq!(nacked, 10, "2,000 publishes onto a full disk, none nacked");
    // What the API shows while the queue is held (its log cannot open
    // while the disk is full): RabbitMQ's "stopped", and no counts, which
    // are not known.
    let held = Instant::now() + Duration::from_secs(5);
    let q = loop {
        let q = node.api("/api/queues/%2F/disk.q");
        if q["state"] == "stopped" || Instant::now() > held {
            break q;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(q["state"], "stopped", "{q}");
    assert!(q.get("messages").is_none(), "{q}");
    // A binding of the durable queue cannot be written to the definitions
    // file (16 KiB of arguments: more than the slack of the file's last
    // page): it is answered once it can, never refused for a full disk.
    let (binder, bind_ch) = channel(&node.url()).await;
    let mut args = FieldTable::default();
    args.insert(
        "padding".into(),
        AMQPValue::LongString("p".repeat(16 << 10).into()),
    );
    let bound = tokio::spawn(async move {
        bind_ch
            .queue_bind(
                QUEUE.into(),
                "amq.direct".into(),
                "bound-on-a-full-disk".into(),
                QueueBindOptions::default(),
                args,
            )
            .await
    });
    // Before the file's writes left the broker's lock, a 541 came at once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!bound.is_finished(), "a bind answered on a full disk");

    std::fs::remove_file(disk.join("filler")).expect("free the disk");
    within(bound)
        .await
        .expect("the bind task")
        .expect("the bind made on the full disk is answered once there is room");
    drop(binder);
    // The queue opens its log again within a few seconds (it tries every
    // second), nacking publishes meanwhile.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = 0;
    loop {
        let name = format!("after-{i}");
        i += 1;
        if publish(&ch, QUEUE, &name).await {
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
            publish(&ch, QUEUE, &name).await,
            "{name} nacked after the queue came back"
        );
        confirmed.insert(name);
    }
    let got = take_all(&ch, QUEUE).await;
    let lost: Vec<&String> = confirmed.difference(&got).collect();
    assert!(lost.is_empty(), "confirmed but not delivered: {lost:?}");
    drop(conn);

    // What the node confirmed is on its disk: after a SIGKILL, the
    // restarted node has every message confirmed and not yet taken, here
    // the ones published now.
    let (conn, ch) = queue_channel(&node).await;
    let mut kept = BTreeSet::new();
    for k in 0..20 {
        let name = format!("kept-{k}");
        assert!(publish(&ch, QUEUE, &name).await, "{name} nacked");
        kept.insert(name);
    }
    drop(conn);
    node.kill();
    let node = Node::start(&data, &["--config", &conf]);
    let (_conn, ch) = queue_channel(&node).await;
    assert_eq!(take_all(&ch, QUEUE).await, kept);
    // The binding made on the full disk is kept.
    ch.basic_publish(
        "amq.direct".into(),
        "bound-on-a-full-disk".into(),
        BasicPublishOptions::default(),
        b"routed",
        BasicProperties::default(),
    )
    .await
    .expect("publish")
    .await
    .expect("confirm");
    assert_eq!(
        take_all(&ch, QUEUE).await,
        BTreeSet::from(["routed".to_owned()])
    );
}

#[test]
fn a_member_whose_disk_fills_stops_its_mirrors_take_over_and_it_starts_again_once_space_is_freed() {
    member_disk_fills(2, 0);
}

/// As above with the node that is the Raft leader (the first, which the
/// others joined) as well as the queues' master: the view change that
/// hands its queue over is first refused by its failing store, then has
/// no leader to decide it until the others elect one.
#[test]
fn the_leaders_disk_fills_and_its_mirrored_queue_moves_to_another_node() {
    member_disk_fills(0, 1);
}

/// Three nodes, node `full`'s data on a 48 MiB tmpfs; it serves a
/// mirrored and an unmirrored queue, clients publish through node `via`.
/// Its disk fills: it stops, a mirror takes the mirrored queue over with
/// every confirmed message, and started again with room on its disk it
/// serves the unmirrored queue's messages.
fn member_disk_fills(full: usize, via: usize) {
    let root = peers::test_root();
    let node = ["a", "b", "c"][full];
    let disk = root.path().join(node);
    std::fs::create_dir(&disk).expect("mount point");
    let Some(_tmpfs) = Tmpfs::mount(&disk, "48m") else {
        return;
    };
    let conf = no_disk_alarm(root.path());
    let extra = ["--config", conf.as_str()];
    let (secret, mut nodes) = three_with(root.path(), &extra);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    set_ha_all(&nodes[0]);
    // Both served by the node whose disk will fill: one mirrored to the
    // two others, one not.
    let (mirrored, plain) = ("ha.disk", "plain.disk");
    declare_durable(&rt, &nodes[full], mirrored);
    declare_durable(&rt, &nodes[full], plain);
    eventually("ha.disk's two mirrors synchronised", || {
        let q = nodes[via].get("/api/queues/%2F/ha.disk");
        q["synchronised_slave_nodes"].as_array().map(Vec::len) == Some(2)
    });
    let url = nodes[via].amqp_url();
    let (mut confirmed, kept) = rt.block_on(async {
        let (_conn, ch) = channel(&url).await;
        let (mut confirmed, mut kept) = (BTreeSet::new(), BTreeSet::new());
        for i in 0..30 {
            let name = format!("before-{i}");
            assert!(publish(&ch, mirrored, &name).await, "{name} nacked");
            confirmed.insert(name.clone());
            assert!(publish(&ch, plain, &name).await, "{name} nacked");
            kept.insert(name);
        }
        (confirmed, kept)
    });

    fill(&disk);
    // Publishes go on being answered while the node fails: its queue logs
    // and then its Raft log refuse the writes, it stops, and a mirror on
    // another node takes the queue over with what was confirmed.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stopped = None;
    let mut acked_since = 0;
    rt.block_on(async {
        let (_conn, ch) = channel(&url).await;
        for i in 0.. {
            let name = format!("full-{i}");
            if publish(&ch, mirrored, &name).await {
                confirmed.insert(name);
                if stopped.is_some() {
                    acked_since += 1;
                }
            }
            if stopped.is_none() {
                stopped = nodes[full].exited();
            }
            if acked_since == 10 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "60 s after {node}'s disk filled: it stopped: {stopped:?}, publishes acked since: {acked_since}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let status = stopped.expect("the node stopped");
    assert!(!status.success(), "it stopped with {status}");
    let log = std::fs::read_to_string(root.path().join(format!("{node}.log"))).expect("its log");
    assert!(
        log.contains("the cluster metadata store failed"),
        "its log does not say why it stopped"
    );
    let got = rt.block_on(async {
        let (_conn, ch) = channel(&url).await;
        take_all(&ch, mirrored).await
    });
    let lost: Vec<&String> = confirmed.difference(&got).collect();
    assert!(lost.is_empty(), "confirmed but not delivered: {lost:?}");

    std::fs::remove_file(disk.join("filler")).expect("free the disk");
    let back = nodes[full].restart(&secret, &extra);
    let got = rt.block_on(async {
        let (_conn, ch) = channel(&back.amqp_url()).await;
        take_all(&ch, plain).await
    });
    assert_eq!(got, kept, "the unmirrored queue after the restart");
}
