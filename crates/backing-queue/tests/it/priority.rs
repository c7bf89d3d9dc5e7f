//! Priority queues (`x-max-priority`) as RabbitMQ has them: the highest
//! priority first, FIFO within a priority; requeue to the old place in the
//! priority; expiry and drop-head at the head of that order; recovery,
//! snapshots and mirrors keep the order.

use std::sync::Arc;

use warren_backing_queue::{
    BackingQueue, DropReason, Limits, MemStorage, NewMessage, Op, QueueConfig, StoreConfig,
};

use crate::{drain, small_store};

fn prio(max: u8) -> QueueConfig {
    QueueConfig {
        max_priority: Some(max),
        ..QueueConfig::default()
    }
}

fn msg(id: u64, priority: u8, persistent: bool) -> NewMessage {
    let mut m = NewMessage::new(id, vec![id as u8; 8], persistent);
    m.priority = priority;
    m
}

fn publish_all(q: &mut BackingQueue, msgs: &[(u64, u8)], persistent: bool) {
    for &(id, p) in msgs {
        q.publish(0, msg(id, p, persistent)).unwrap();
    }
}

fn ids(q: &mut BackingQueue) -> Vec<u64> {
    drain(q, 0).iter().map(|d| d.id).collect()
}

/// Everything ready, as (id, redelivered).
fn redelivered(q: &mut BackingQueue) -> Vec<(u64, bool)> {
    drain(q, 0).iter().map(|d| (d.id, d.redelivered)).collect()
}

const MIXED: [(u64, u8); 7] = [(1, 1), (2, 5), (3, 9), (4, 0), (5, 5), (6, 9), (7, 3)];

#[test]
fn highest_priority_first_fifo_within_a_priority() {
    let mut q = BackingQueue::in_memory(prio(10));
    publish_all(&mut q, &MIXED, false);
    assert_eq!(q.stats().ready, 7);
    assert_eq!(ids(&mut q), [3, 6, 2, 5, 7, 1, 4]);
}

#[test]
fn without_max_priority_the_property_is_ignored() {
    let mut q = BackingQueue::in_memory(QueueConfig::default());
    publish_all(&mut q, &MIXED, false);
    assert_eq!(ids(&mut q), [1, 2, 3, 4, 5, 6, 7]);
}

#[test]
fn priorities_above_the_maximum_count_as_the_maximum() {
    let mut q = BackingQueue::in_memory(prio(3));
    publish_all(&mut q, &[(1, 2), (2, 200), (3, 3), (4, 9), (5, 0)], false);
    assert_eq!(ids(&mut q), [2, 3, 4, 1, 5]);
}

#[test]
fn requeue_goes_back_to_its_place_in_its_priority() {
    let mut q = BackingQueue::in_memory(prio(10));
    publish_all(&mut q, &MIXED, false);
    let taken: Vec<_> = (0..4).map(|_| q.fetch(0).unwrap().unwrap()).collect();
    assert_eq!(taken.iter().map(|d| d.id).collect::<Vec<_>>(), [3, 6, 2, 5]);
    // Requeued in any order: each goes back to its place.
    for i in [2, 0, 3, 1] {
        q.requeue(taken[i].tag).unwrap();
    }
    // The four taken are redelivered, in their old places.
    let order = [3, 6, 2, 5, 7, 1, 4];
    let want: Vec<_> = order
        .iter()
        .enumerate()
        .map(|(i, &id)| (id, i < 4))
        .collect();
    assert_eq!(redelivered(&mut q), want);
}

#[test]
fn a_later_higher_priority_goes_ahead_of_a_requeued_lower_one() {
    let mut q = BackingQueue::in_memory(prio(5));
    publish_all(&mut q, &[(1, 1), (2, 1)], false);
    let d = q.fetch(0).unwrap().unwrap();
    publish_all(&mut q, &[(3, 4)], false);
    q.requeue(d.tag).unwrap();
    assert_eq!(ids(&mut q), [3, 1, 2]);
}

#[test]
fn max_length_drops_the_head_of_the_highest_priority() {
    let cfg = QueueConfig {
        limits: Limits {
            max_length: Some(3),
            ..Limits::default()
        },
        report_dropped: true,
        max_priority: Some(5),
        ..QueueConfig::default()
    };
    let mut q = BackingQueue::in_memory(cfg);
    publish_all(
        &mut q,
        &[(1, 1), (2, 3), (3, 5), (4, 0), (5, 5), (6, 2)],
        false,
    );
    let mut dropped = Vec::new();
    q.take_dropped(&mut dropped);
    assert!(dropped.iter().all(|d| d.reason == DropReason::MaxLength));
    assert_eq!(dropped.iter().map(|d| d.id).collect::<Vec<_>>(), [3, 5, 2]);
    assert_eq!(ids(&mut q), [6, 1, 4]);
}

#[test]
fn expiry_works_at_the_head_of_the_priority_order() {
    let cfg = QueueConfig {
        report_dropped: true,
        max_priority: Some(5),
        ..QueueConfig::default()
    };
    let mut q = BackingQueue::in_memory(cfg);
    let mut low = msg(1, 1, false);
    low.expiration_ms = Some(10);
    let mut high = msg(2, 4, false);
    high.expiration_ms = Some(20);
    q.publish(0, low).unwrap();
    q.publish(0, high).unwrap();
    q.publish(0, msg(3, 4, false)).unwrap();
    // The head is the priority-4 message: its expiry is the next one.
    assert_eq!(q.next_expiry_ms(), Some(20));
    q.expire(15).unwrap();
    assert_eq!(q.stats().ready, 3, "only the head expires");
    assert_eq!(q.fetch(21).unwrap().unwrap().id, 3);
    q.expire(21).unwrap();
    let mut dropped = Vec::new();
    q.take_dropped(&mut dropped);
    assert_eq!(dropped.iter().map(|d| d.id).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(q.stats().ready, 0);
}

#[test]
fn purge_empties_every_priority() {
    let mut q = BackingQueue::in_memory(prio(10));
    publish_all(&mut q, &MIXED, false);
    let d = q.fetch(0).unwrap().unwrap();
    assert_eq!(q.purge().unwrap(), 6);
    assert_eq!(q.stats().ready, 0);
    q.requeue(d.tag).unwrap();
    publish_all(&mut q, &[(8, 2)], false);
    assert_eq!(ids(&mut q), [3, 8]);
}

#[test]
fn recovery_keeps_the_priority_order() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut q, _) = BackingQueue::open(dir.path(), prio(10), small_store()).unwrap();
        publish_all(&mut q, &MIXED, true);
        // A transient one is not recovered.
        q.publish(0, msg(8, 9, false)).unwrap();
        let d = q.fetch(0).unwrap().unwrap();
        assert_eq!(d.id, 3);
        q.sync().unwrap();
    }
    let (mut q, report) = BackingQueue::open(dir.path(), prio(10), small_store()).unwrap();
    assert_eq!(report.messages, 7);
    let want = [3, 6, 2, 5, 7, 1, 4].map(|id| (id, id == 3));
    assert_eq!(redelivered(&mut q), want);
}

#[test]
fn recovery_through_compaction_and_paged_out_bodies() {
    let storage = MemStorage::new();
    let store = StoreConfig {
        segment_bytes: 256,
        resident_bytes_max: 16,
        ..StoreConfig::default()
    };
    let dir = std::path::Path::new("/q");
    let open = |storage: &MemStorage| {
        BackingQueue::open_in(Arc::new(storage.clone()), dir, prio(255), store)
            .unwrap()
            .0
    };
    let mut q = open(&storage);
    // Many messages acked at the head segment, a few kept: compaction copies
    // them forward with their priority.
    for id in 1..=60 {
        q.publish(0, msg(id, (id % 4) as u8 * 60, true)).unwrap();
        q.sync().unwrap();
    }
    let mut kept = Vec::new();
    while let Some(d) = q.fetch(0).unwrap() {
        if d.id % 10 == 0 || d.id == 3 {
            kept.push(d.tag);
        } else {
            q.ack(d.tag).unwrap();
        }
    }
    for t in kept {
        q.requeue(t).unwrap();
    }
    q.sync().unwrap();
    let before = q.ready_seqs().collect::<Vec<_>>();
    drop(q);
    storage.crash();
    let mut q = open(&storage);
    assert_eq!(q.ready_seqs().collect::<Vec<_>>(), before);
    let got = drain(&mut q, 0);
    assert_eq!(
        got.iter().map(|d| d.id).collect::<Vec<_>>(),
        [3, 10, 30, 50, 20, 40, 60]
    );
    assert!(got.iter().all(|d| d.body == vec![d.id as u8; 8]));
}

#[test]
fn a_mirror_applying_the_ops_and_a_snapshot_holds_the_same_order() {
    let cfg = QueueConfig {
        record_ops: true,
        ..prio(10)
    };
    let mut master = BackingQueue::in_memory(cfg);
    let mut mirror = BackingQueue::in_memory(prio(10));
    publish_all(&mut master, &MIXED, false);
    let a = master.fetch(0).unwrap().unwrap();
    let _b = master.fetch(0).unwrap().unwrap();
    master.requeue(a.tag).unwrap();
    for op in master.take_ops() {
        let op = Op::decode(&op.encode().unwrap()).unwrap();
        mirror.apply(op).unwrap();
    }
    let mut synced = BackingQueue::in_memory(prio(10));
    assert!(synced.install_snapshot(master.snapshot().unwrap()).unwrap());
    let want = master.ready_seqs().collect::<Vec<_>>();
    assert_eq!(mirror.ready_seqs().collect::<Vec<_>>(), want);
    assert_eq!(synced.ready_seqs().collect::<Vec<_>>(), want);
    assert_eq!(mirror.unacked_tags(), master.unacked_tags());
    assert_eq!(synced.unacked_tags(), master.unacked_tags());
    let m = ids(&mut master);
    assert_eq!(m, [3, 2, 5, 7, 1, 4]);
    assert_eq!(ids(&mut mirror), m);
    assert_eq!(ids(&mut synced), m);
}
