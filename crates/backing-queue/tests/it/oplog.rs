//! A mirror applying its master's op log (through postcard) ends in the same state.

use proptest::prelude::*;
use warren_backing_queue::{BackingQueue, Limits, NewMessage, Op, OpOutcome, QueueConfig};

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..100, 0usize..40, any::<bool>(), proptest::option::of(0u64..20)).prop_map(
            |(now_ms, len, persistent, exp)| {
                let mut msg = NewMessage::new(now_ms, vec![len as u8; len], persistent);
                msg.expiration_ms = exp;
                Op::Publish { now_ms, msg }
            }
        ),
        4 => (0u64..100).prop_map(|now_ms| Op::Fetch { now_ms }),
        3 => (1u64..30).prop_map(|tag| Op::Ack { tag }),
        2 => (1u64..30).prop_map(|tag| Op::Requeue { tag }),
        1 => (1u64..30).prop_map(|tag| Op::Discard { tag }),
        1 => Just(Op::Purge),
        1 => (0u64..100).prop_map(|now_ms| Op::Expire { now_ms }),
        1 => proptest::option::of(1u64..6).prop_map(|max_length| Op::SetLimits {
            limits: Limits { max_length, ..Limits::default() }
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        // Fixed, so that runs are deterministic; vary it locally to explore.
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_b0c5),
        ..ProptestConfig::default()
    })]

    #[test]
    fn mirror_replays_master(ops in proptest::collection::vec(op(), 0..80)) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = QueueConfig { record_ops: true, ..QueueConfig::default() };
        let (mut master, _) =
            BackingQueue::open(dir.path(), cfg, crate::small_store()).unwrap();
        let mut mirror = BackingQueue::in_memory(QueueConfig::default());
        for op in ops {
            let on_master = master.apply(op);
            let log = master.take_ops();
            if on_master.is_err() {
                // Refused with no effect: nothing for the mirror.
                prop_assert!(log.is_empty());
                continue;
            }
            prop_assert_eq!(log.len(), 1);
            let wire = log[0].encode().unwrap();
            let on_mirror = mirror.apply(Op::decode(&wire).unwrap()).unwrap();
            match (on_master.unwrap(), on_mirror) {
                // needs_sync differs: the mirror is in memory.
                (OpOutcome::Published(a), OpOutcome::Published(b)) => prop_assert_eq!(a.seq, b.seq),
                (a, b) => prop_assert_eq!(a, b),
            }
            prop_assert_eq!(master.stats().ready, mirror.stats().ready);
            prop_assert_eq!(master.stats().unacked_bytes, mirror.stats().unacked_bytes);
            prop_assert!(master.ready_seqs().eq(mirror.ready_seqs()));
            prop_assert_eq!(master.digest(), mirror.digest());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_5a9c),
        ..ProptestConfig::default()
    })]

    /// A replica that installs a snapshot taken mid-stream (through postcard)
    /// and applies the later ops ends in the master's state, durable or not.
    #[test]
    fn snapshot_then_ops_matches_master(
        ops in proptest::collection::vec(op(), 0..80),
        cut in 0usize..80,
        durable_mirror: bool,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = QueueConfig { record_ops: true, ..QueueConfig::default() };
        let (mut master, _) =
            BackingQueue::open(dir.path(), cfg, crate::small_store()).unwrap();
        let cut = cut.min(ops.len());
        for op in &ops[..cut] {
            let _ = master.apply(op.clone());
        }
        master.take_ops();
        let snap = master.snapshot().unwrap();
        let snap: warren_backing_queue::Snapshot =
            postcard::from_bytes(&postcard::to_allocvec(&snap).unwrap()).unwrap();
        let mdir = tempfile::tempdir().unwrap();
        let mut mirror = if durable_mirror {
            BackingQueue::open(mdir.path(), QueueConfig::default(), crate::small_store()).unwrap().0
        } else {
            BackingQueue::in_memory(QueueConfig::default())
        };
        prop_assert!(mirror.install_snapshot(snap).unwrap());
        prop_assert_eq!(master.unacked_tags(), mirror.unacked_tags());
        for op in &ops[cut..] {
            let on_master = master.apply(op.clone());
            for logged in master.take_ops() {
                let on_mirror = mirror.apply(logged).unwrap();
                match (on_master.as_ref().unwrap(), on_mirror) {
                    (OpOutcome::Published(a), OpOutcome::Published(b)) => prop_assert_eq!(a.seq, b.seq),
                    (a, b) => prop_assert_eq!(a, &b),
                }
            }
            prop_assert!(master.ready_seqs().eq(mirror.ready_seqs()));
            prop_assert_eq!(master.stats().unacked, mirror.stats().unacked);
        }
        mirror.sync().unwrap();
        // A non-empty queue refuses a snapshot.
        if mirror.stats().ready + mirror.stats().unacked > 0 {
            prop_assert!(!mirror.install_snapshot(master.snapshot().unwrap()).unwrap());
        }
    }
}

#[test]
fn the_digest_tells_replicas_that_differ() {
    let publish = |q: &mut BackingQueue, id: u64| {
        q.publish(0, NewMessage::new(id, b"x".to_vec(), false))
            .unwrap();
    };
    let (mut a, mut b) = (
        BackingQueue::in_memory(QueueConfig::default()),
        BackingQueue::in_memory(QueueConfig::default()),
    );
    assert_eq!(a.digest(), b.digest(), "two empty queues");
    publish(&mut a, 1);
    assert_ne!(a.digest(), b.digest(), "a message missing");
    publish(&mut b, 2);
    assert_ne!(a.digest(), b.digest(), "another message");
    let (mut c, mut d) = (
        BackingQueue::in_memory(QueueConfig::default()),
        BackingQueue::in_memory(QueueConfig::default()),
    );
    for q in [&mut c, &mut d] {
        publish(q, 1);
        publish(q, 2);
    }
    assert_eq!(c.digest(), d.digest(), "the same messages");
    let tag = c.fetch(0).unwrap().unwrap().tag;
    assert_ne!(c.digest(), d.digest(), "one delivered, pending ack");
    d.fetch(0).unwrap();
    assert_eq!(c.digest(), d.digest(), "both delivered");
    c.requeue(tag).unwrap();
    assert_ne!(c.digest(), d.digest(), "one requeued");
}
