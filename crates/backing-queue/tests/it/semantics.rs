//! Targeted checks of RabbitMQ semantics.

use bytes::Bytes;
use warren_backing_queue::{
    BackingQueue, DropReason, Limits, NewMessage, QueueConfig, QueueError, StoreConfig,
};

use crate::{drain, open, small_store};

fn msg(id: u64, len: usize, persistent: bool) -> NewMessage {
    NewMessage::new(id, vec![id as u8; len], persistent)
}

#[test]
fn requeue_goes_back_to_its_position_redelivered() {
    let mut q = BackingQueue::in_memory(QueueConfig::default());
    for id in 1..=4 {
        q.publish(0, msg(id, 3, false)).unwrap();
    }
    let a = q.fetch(0).unwrap().unwrap();
    let b = q.fetch(0).unwrap().unwrap();
    assert_eq!((a.id, b.id, a.redelivered), (1, 2, false));
    q.requeue(b.tag).unwrap();
    q.requeue(a.tag).unwrap();
    let ids: Vec<_> = drain(&mut q, 0)
        .iter()
        .map(|d| (d.id, d.redelivered))
        .collect();
    assert_eq!(ids, vec![(1, true), (2, true), (3, false), (4, false)]);
    assert!(matches!(
        q.ack(a.tag),
        Err(QueueError::UnknownDeliveryTag(_))
    ));
}

#[test]
fn stats_count_ready_and_unacked() {
    let mut q = BackingQueue::in_memory(QueueConfig::default());
    q.publish(0, msg(1, 10, false)).unwrap();
    q.publish(0, msg(2, 20, false)).unwrap();
    let d = q.fetch(0).unwrap().unwrap();
    let s = q.stats();
    assert_eq!(
        (s.ready, s.ready_bytes, s.unacked, s.unacked_bytes),
        (1, 20, 1, 10)
    );
    q.discard(d.tag).unwrap();
    assert_eq!(q.purge().unwrap(), 1);
    assert_eq!(q.stats().ready + q.stats().unacked, 0);
}

#[test]
fn ttl_and_expiration_expire_at_the_head() {
    let cfg = QueueConfig {
        limits: Limits {
            message_ttl_ms: Some(100),
            ..Limits::default()
        },
        report_dropped: true,
        ..QueueConfig::default()
    };
    let mut q = BackingQueue::in_memory(cfg);
    let mut short = msg(1, 1, false);
    short.expiration_ms = Some(10);
    q.publish(0, short).unwrap();
    q.publish(0, msg(2, 1, false)).unwrap();
    assert_eq!(q.next_expiry_ms(), Some(10));
    assert_eq!(q.fetch(11).unwrap().unwrap().id, 2);
    q.publish(50, msg(3, 1, false)).unwrap();
    q.expire(151).unwrap();
    assert_eq!(q.stats().ready, 0);
    let mut dropped = Vec::new();
    q.take_dropped(&mut dropped);
    let got: Vec<_> = dropped.iter().map(|d| (d.id, d.reason)).collect();
    assert_eq!(
        got,
        vec![(1, DropReason::Expired), (3, DropReason::Expired)]
    );
}

#[test]
fn max_length_drops_head() {
    let cfg = QueueConfig {
        limits: Limits {
            max_length: Some(2),
            max_length_bytes: Some(25),
            ..Limits::default()
        },
        ..QueueConfig::default()
    };
    let mut q = BackingQueue::in_memory(cfg);
    for id in 1..=3 {
        q.publish(0, msg(id, 10, false)).unwrap();
    }
    assert_eq!(q.ready_seqs().collect::<Vec<_>>(), vec![2, 3]);
    q.publish(0, msg(4, 10, false)).unwrap();
    q.set_limits(Limits {
        max_length_bytes: Some(10),
        ..Limits::default()
    })
    .unwrap();
    let ids: Vec<_> = drain(&mut q, 0).iter().map(|d| d.id).collect();
    assert_eq!(ids, vec![4]);
}

#[test]
fn persistent_messages_survive_restart_redelivered() {
    let dir = tempfile::tempdir().unwrap();
    let mut q = open(dir.path(), small_store());
    let mut p = msg(1, 5, true);
    p.props = Bytes::from_static(b"props");
    let first = q.publish(0, p).unwrap();
    assert!(first.needs_sync);
    assert!(!q.publish(0, msg(2, 5, false)).unwrap().needs_sync);
    q.publish(0, msg(3, 5, true)).unwrap();
    let d = q.fetch(0).unwrap().unwrap();
    assert_eq!(&d.props[..], b"props");
    let mut confirmed = Vec::new();
    q.drain_confirmed(&mut confirmed);
    assert!(confirmed.is_empty());
    q.sync().unwrap();
    q.drain_confirmed(&mut confirmed);
    assert_eq!(confirmed, vec![1, 3]);
    drop(q);
    let mut q = open(dir.path(), small_store());
    let got: Vec<_> = drain(&mut q, 0)
        .iter()
        .map(|d| (d.id, d.redelivered, d.props.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, true, Bytes::from_static(b"props")),
            (3, false, Bytes::new())
        ]
    );
    // Sequence numbers keep growing across restarts.
    assert_eq!(q.publish(0, msg(4, 1, true)).unwrap().seq, 4);
}

#[test]
fn lazy_mode_reads_bodies_from_disk_and_disk_follows_live_queue() {
    let dir = tempfile::tempdir().unwrap();
    let store = StoreConfig {
        resident_bytes_max: 0,
        ..small_store()
    };
    let mut q = open(dir.path(), store);
    for round in 0..20u64 {
        for i in 0..50 {
            q.publish(0, msg(round * 100 + i, 100, true)).unwrap();
        }
        q.sync().unwrap();
        for d in drain(&mut q, 0) {
            assert_eq!(d.body, vec![d.id as u8; 100]);
            q.ack(d.tag).unwrap();
        }
        q.sync().unwrap();
    }
    q.publish(0, msg(7, 100, true)).unwrap();
    q.sync().unwrap();
    // Roughly 7 KiB of live data per round went through; only a segment or
    // two remain.
    assert!(q.stats().disk_bytes <= 3 * 1024, "{:?}", q.stats());
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let segments = names.iter().filter(|n| n.ends_with(".seg")).count();
    let spares = names.iter().filter(|n| n.ends_with(".spare")).count();
    assert!(segments <= 3 && spares <= 2, "{names:?}");
    assert!(spares > 0, "old segments are kept for reuse: {names:?}");
    drop(q);
    let (mut q, report) = BackingQueue::open(dir.path(), QueueConfig::default(), store).unwrap();
    // The stale tail of a recycled segment is no torn write.
    assert_eq!(report.truncated, None);
    let ids: Vec<_> = drain(&mut q, 0).iter().map(|d| d.id).collect();
    assert_eq!(ids, vec![7]);
}

#[test]
fn a_long_lived_message_does_not_pin_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut q = open(dir.path(), small_store());
    q.publish(0, msg(0, 50, true)).unwrap();
    let held = q.fetch(0).unwrap().unwrap();
    for i in 1..2000 {
        q.publish(0, msg(i, 50, true)).unwrap();
        let d = q.fetch(0).unwrap().unwrap();
        q.ack(d.tag).unwrap();
        if i % 100 == 0 {
            q.sync().unwrap();
        }
    }
    q.sync().unwrap();
    assert!(q.stats().disk_bytes <= 4 * 1024, "{:?}", q.stats());
    drop(q);
    let mut q = open(dir.path(), small_store());
    let got: Vec<_> = drain(&mut q, 0)
        .iter()
        .map(|d| (d.id, d.redelivered))
        .collect();
    assert_eq!(got, vec![(0, true)]);
    drop(held);
}

#[test]
fn pipelined_group_commit_confirms_only_what_it_covered() {
    let dir = tempfile::tempdir().unwrap();
    let mut q = open(dir.path(), small_store());
    for id in 0..10 {
        q.publish(0, msg(id, 100, true)).unwrap();
    }
    let mut job = q.prepare_sync().unwrap().unwrap();
    assert_eq!(job.up_to(), 10);
    // Appends go on while the job runs (here: before it runs).
    for id in 10..15 {
        q.publish(0, msg(id, 100, true)).unwrap();
    }
    let mut confirmed = Vec::new();
    q.drain_confirmed(&mut confirmed);
    // Segments of 1 KiB rolled (and synced) on the way: those are confirmed.
    let early = confirmed.len();
    assert!(confirmed.iter().all(|&s| s <= q.synced_seq()));
    job.run().unwrap();
    q.complete_sync(&job).unwrap();
    q.drain_confirmed(&mut confirmed);
    assert!(confirmed.len() >= 10 && confirmed.len() >= early);
    assert!(confirmed.windows(2).all(|w| w[0] < w[1]));
    assert!(q.needs_sync());
    q.sync().unwrap();
    q.drain_confirmed(&mut confirmed);
    assert_eq!(confirmed, (1..=15).collect::<Vec<_>>());
    assert!(!q.needs_sync());
}

#[test]
fn a_lost_sync_job_poisons_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut q = open(dir.path(), small_store());
    q.publish(0, msg(1, 1, true)).unwrap();
    let lost = q.prepare_sync().unwrap().unwrap();
    let mut second = q.prepare_sync().unwrap().unwrap();
    second.run().unwrap();
    assert!(q.complete_sync(&second).is_err());
    assert!(q.sync().is_err(), "poisoned");
    drop(lost);
    drop(q);
    let mut q = open(dir.path(), small_store());
    assert_eq!(drain(&mut q, 0).len(), 1);
}

#[test]
fn lazy_mode_pages_transient_messages_too_and_recovery_ignores_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = StoreConfig {
        resident_bytes_max: 1000,
        ..StoreConfig::default()
    };
    let mut q = open(dir.path(), store);
    for id in 0..100 {
        let p = q.publish(0, msg(id, 100, false)).unwrap();
        assert!(!p.needs_sync);
    }
    // The first ten stay in memory, the other ninety go to the log.
    assert!(q.stats().disk_bytes > 90 * 100, "{:?}", q.stats());
    let got = drain(&mut q, 0);
    assert_eq!(got.len(), 100);
    for d in &got {
        assert_eq!(d.body, vec![d.id as u8; 100]);
    }
    q.sync().unwrap();
    drop(q);
    let mut q = open(dir.path(), store);
    assert!(drain(&mut q, 0).is_empty());
}

#[test]
fn power_loss_on_mem_storage_keeps_exactly_what_was_synced() {
    use std::path::Path;
    use warren_backing_queue::MemStorage;

    let mem = MemStorage::new();
    let dir = Path::new("/queues/q1");
    let open = || open_in_memory(&mem, dir);
    let mut q = open();
    for id in 0..30 {
        q.publish(0, msg(id, 40, true)).unwrap();
    }
    let synced = q.sync().unwrap();
    assert_eq!(synced, 30);
    for id in 30..60 {
        q.publish(0, msg(id, 40, true)).unwrap();
    }
    let d = q.fetch(0).unwrap().unwrap();
    q.ack(d.tag).unwrap();
    drop(q);
    mem.crash();
    let mut q = open();
    let ids: Vec<u64> = drain(&mut q, 0).iter().map(|d| d.id).collect();
    // Everything synced is back (the unsynced ack is lost: a redelivery);
    // unsynced publishes may be back only where a sealed segment was synced
    // before the next one was written (a second roll before any sync).
    assert_eq!(ids[..30], (0..30).collect::<Vec<_>>()[..]);
    assert!(ids.windows(2).all(|w| w[0] + 1 == w[1]));
}

#[test]
fn a_group_commit_after_rolls_makes_the_sealed_segments_durable() {
    use std::path::Path;
    use warren_backing_queue::MemStorage;

    let mem = MemStorage::new();
    let dir = Path::new("/queues/q1");
    let open = || open_in_memory(&mem, dir);
    let mut q = open();
    q.publish(0, msg(0, 40, true)).unwrap();
    q.sync().unwrap();
    // Far more than one segment (small_store: 1 KiB), with no sync between.
    for id in 1..100 {
        q.publish(0, msg(id, 40, true)).unwrap();
    }
    assert_eq!(q.sync().unwrap(), 100);
    drop(q);
    mem.crash();
    let mut q = open();
    let ids: Vec<u64> = drain(&mut q, 0).iter().map(|d| d.id).collect();
    assert_eq!(ids, (0..100).collect::<Vec<_>>());
}

#[test]
fn large_bodies_round_trip_through_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    for resident_bytes_max in [u64::MAX, 0] {
        let store = StoreConfig {
            resident_bytes_max,
            ..small_store()
        };
        let mut q = open(dir.path(), store);
        let mut m = NewMessage::new(1, big.clone(), true);
        m.props = Bytes::from_static(b"hdr");
        q.publish(0, m).unwrap();
        q.publish(0, msg(2, 10, true)).unwrap();
        q.sync().unwrap();
        let d = q.fetch(0).unwrap().unwrap();
        assert_eq!((&d.props[..], &d.body[..]), (&b"hdr"[..], &big[..]));
        q.requeue(d.tag).unwrap();
        q.sync().unwrap();
        drop(q);
        let mut q = open(dir.path(), store);
        let got = drain(&mut q, 0);
        assert_eq!(got.len(), 2);
        assert_eq!(
            (&got[0].props[..], &got[0].body[..]),
            (&b"hdr"[..], &big[..])
        );
        assert!(got[0].redelivered);
        for d in got {
            q.ack(d.tag).unwrap();
        }
        q.sync().unwrap();
    }
}

#[test]
fn a_spilling_queue_opens_its_log_only_past_its_budget() {
    // A non-durable queue: in memory until its bodies pass the budget, then
    // new bodies go to a log opened (emptied first) in its directory.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("transient-q");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("stale"), b"a previous run's").unwrap();
    let store = StoreConfig {
        resident_bytes_max: 1000,
        ..StoreConfig::default()
    };
    let mut q = BackingQueue::spilling(
        warren_backing_queue::FsStorage::shared(),
        &dir,
        QueueConfig::default(),
        store,
    );
    for id in 0..10 {
        q.publish(0, msg(id, 100, false)).unwrap();
    }
    assert_eq!(q.stats().disk_bytes, 0, "within the budget: no log yet");
    assert!(dir.join("stale").exists());
    for id in 10..100 {
        let p = q.publish(0, msg(id, 100, false)).unwrap();
        assert!(!p.needs_sync);
    }
    assert!(!dir.join("stale").exists(), "the directory was emptied");
    assert!(q.stats().disk_bytes > 90 * 100, "{:?}", q.stats());
    let got = drain(&mut q, 0);
    assert_eq!(got.len(), 100);
    for d in &got {
        assert_eq!(d.body, vec![d.id as u8; 100]);
    }
}

/// Lowering the budget (a policy made the queue lazy) pages out what the
/// queue already holds: a durable queue writes its transient messages to
/// its log, a non-durable one opens its spill log; every body comes back
/// whole, in order.
#[test]
fn a_lower_budget_pages_out_the_messages_already_held() {
    let tmp = tempfile::tempdir().unwrap();
    let roomy = StoreConfig {
        resident_bytes_max: 1 << 20,
        ..StoreConfig::default()
    };
    let durable = open(&tmp.path().join("durable"), roomy);
    let spill_dir = tmp.path().join("transient");
    let spilling = BackingQueue::spilling(
        warren_backing_queue::FsStorage::shared(),
        &spill_dir,
        QueueConfig::default(),
        roomy,
    );
    for mut q in [durable, spilling] {
        for id in 0..100 {
            q.publish(0, msg(id, 100, id % 2 == 0)).unwrap();
        }
        let before = q.stats().disk_bytes;
        q.set_resident_bytes_max(1000).unwrap();
        assert!(
            q.stats().disk_bytes >= before + 40 * 100,
            "the transient ones were not written out: {before} then {:?}",
            q.stats()
        );
        let got = drain(&mut q, 0);
        assert_eq!(got.len(), 100);
        for (i, d) in got.iter().enumerate() {
            assert_eq!(d.id, i as u64);
            assert_eq!(d.body, vec![d.id as u8; 100]);
        }
    }
}

/// A lazy snapshot reads paged-out bodies a batch at a time, as they were at
/// the snapshot, even after the queue removed those messages and its log
/// would have retired and compacted their segments; the log does so once
/// the snapshot ends.
#[test]
fn a_lazy_snapshot_reads_paged_bodies_as_they_were_at_its_point() {
    let dir = tempfile::tempdir().unwrap();
    let store = StoreConfig {
        resident_bytes_max: 0,
        ..small_store()
    };
    let mut q = open(dir.path(), store);
    for id in 0..40 {
        q.publish(0, msg(id, 200, true)).unwrap();
    }
    q.sync().unwrap();
    let mut snap = q.snapshot_lazy();
    assert_eq!(snap.len(), 40);
    // Everything leaves the queue meanwhile, and more comes and goes.
    for d in drain(&mut q, 0) {
        q.ack(d.tag).unwrap();
    }
    for id in 40..80 {
        q.publish(0, msg(id, 200, true)).unwrap();
    }
    for d in drain(&mut q, 0) {
        q.ack(d.tag).unwrap();
    }
    q.sync().unwrap();
    let pinned = q.stats().disk_bytes;
    let mut got = Vec::new();
    while !snap.is_empty() {
        let batch = q.snapshot_batch(&mut snap, 100, 1000).unwrap();
        assert!(
            (1..=5).contains(&batch.len()),
            "{} messages of 200 bytes in a batch of 1,000",
            batch.len()
        );
        got.extend(batch);
    }
    assert_eq!(got.len(), 40);
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.id, i as u64);
        assert_eq!(m.body, vec![i as u8; 200]);
    }
    q.end_snapshot();
    q.publish(0, msg(80, 10, true)).unwrap();
    q.sync().unwrap();
    assert!(
        q.stats().disk_bytes < pinned / 2,
        "segments retired after the snapshot: {} then {}",
        pinned,
        q.stats().disk_bytes
    );
}

/// A snapshot installed in parts keeps no more bodies in memory than the
/// queue's budget: the rest go to its log as they come.
#[test]
fn a_snapshot_installed_in_parts_pages_out_past_the_budget() {
    let src_dir = tempfile::tempdir().unwrap();
    let mut src = open(src_dir.path(), small_store());
    for id in 0..100 {
        src.publish(0, msg(id, 100, false)).unwrap();
    }
    let d = src.fetch(0).unwrap().unwrap();
    let mut snap = src.snapshot_lazy();
    let dir = tempfile::tempdir().unwrap();
    let store = StoreConfig {
        resident_bytes_max: 1000,
        ..StoreConfig::default()
    };
    let mut q = open(dir.path(), store);
    while !snap.is_empty() {
        let part = src.snapshot_batch(&mut snap, 7, usize::MAX).unwrap();
        assert!(q.install_part(part).unwrap());
    }
    assert!(
        q.finish_install(snap.next_seq, snap.next_tag, snap.limits)
            .unwrap()
    );
    // About ten stay in memory, the other ninety went to the log.
    assert!(q.stats().disk_bytes > 85 * 100, "{:?}", q.stats());
    assert_eq!(q.digest(), src.digest());
    assert_eq!(q.unacked_tags(), vec![d.tag]);
    let got = drain(&mut q, 0);
    assert_eq!(got.len(), 99);
    for m in &got {
        assert_eq!(m.body, vec![m.id as u8; 100]);
    }
}

/// Opens the durable queue in `dir` on in-memory storage (small segments).
fn open_in_memory(mem: &warren_backing_queue::MemStorage, dir: &std::path::Path) -> BackingQueue {
    BackingQueue::open_in(
        std::sync::Arc::new(mem.clone()),
        dir,
        QueueConfig::default(),
        small_store(),
    )
    .unwrap()
    .0
}
