//! Group commits of many queues run together (`SyncJob::run_all`): one
//! `sync_files` call per storage, every job's publishes durable after it.

use std::path::Path;
use std::sync::Arc;

use warren_backing_queue::{
    BackingQueue, FsStorage, MemStorage, NewMessage, QueueConfig, RecoveryReport, Storage,
    StoreConfig,
};

use crate::{commit_together, drain, small_store};

/// Opens `n` durable queues under `root` on `storage`, publishes `k + 1`
/// persistent messages to queue `k` (enough to roll segments in some) and
/// commits them all with one `run_all`.
fn publish_and_commit_together(storage: &Arc<dyn Storage>, root: &Path, n: usize) {
    let mut queues: Vec<BackingQueue> = (0..n)
        .map(|k| {
            BackingQueue::open_in(
                Arc::clone(storage),
                &root.join(format!("q{k}")),
                QueueConfig::default(),
                small_store(),
            )
            .expect("open")
            .0
        })
        .collect();
    let mut last = Vec::new();
    for (k, q) in queues.iter_mut().enumerate() {
        let mut seq = 0;
        for i in 0..=k {
            let body = vec![k as u8; 300 + i];
            seq = q
                .publish(0, NewMessage::new((k * 100 + i) as u64, body, true))
                .expect("publish")
                .seq;
        }
        last.push(seq);
    }
    commit_together(&mut queues, &last, None);
    assert!(queues.iter().all(|q| !q.needs_sync()));
}

fn reopen_all(storage: &Arc<dyn Storage>, root: &Path, n: usize) {
    for k in 0..n {
        let (mut q, _) = BackingQueue::open_in(
            Arc::clone(storage),
            &root.join(format!("q{k}")),
            QueueConfig::default(),
            small_store(),
        )
        .expect("reopen");
        let got = drain(&mut q, 0);
        assert_eq!(got.len(), k + 1, "queue q{k}");
        for (i, d) in got.iter().enumerate() {
            assert_eq!(d.id, (k * 100 + i) as u64);
            assert_eq!(d.body.len(), 300 + i);
        }
    }
}

#[test]
fn queues_committed_together_keep_every_publish_through_a_power_loss() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let root = Path::new("/node");
    publish_and_commit_together(&storage, root, 8);
    mem.crash();
    reopen_all(&storage, root, 8);
}

#[test]
fn queues_on_real_files_are_committed_with_one_call() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage: Arc<dyn Storage> = FsStorage::shared();
    publish_and_commit_together(&storage, dir.path(), 8);
    reopen_all(&storage, dir.path(), 8);
}

/// Sixteen queues on real files while at most four may be open: files are
/// closed and opened again between a queue's appends, its group commit and
/// its reads, and every publish is back after the reopen.
#[test]
fn queues_on_more_files_than_may_be_open_keep_every_publish() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = Arc::new(FsStorage::default());
    fs.set_open_files_max(4);
    let storage: Arc<dyn Storage> = fs.clone();
    publish_and_commit_together(&storage, dir.path(), 16);
    assert!(fs.open_files() <= 4, "{} open", fs.open_files());
    reopen_all(&storage, dir.path(), 16);
    assert!(fs.open_files() <= 4, "{} open", fs.open_files());
}

/// The unsynced hook: called once when the log gets something to sync
/// (a publish, an ack), not again until armed; armed while a commit is in
/// flight it is called again at once, armed after the commit completed
/// with nothing new it is not.
#[test]
fn the_unsynced_hook_is_called_once_per_commit_with_something_to_sync() {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let (mut q, _) = BackingQueue::open_in(
        storage,
        Path::new("/node/hooked"),
        QueueConfig::default(),
        StoreConfig::default(),
    )
    .expect("open");
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&calls);
    let called = || calls.load(std::sync::atomic::Ordering::Relaxed);
    q.on_unsynced(Arc::new(move || {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }));
    // A new log's first segment header waits for the first commit.
    let mut job = q.prepare_sync().expect("prepare").expect("a job");
    job.run().expect("run");
    q.complete_sync(&job).expect("complete");
    q.arm_unsynced();
    let before = called();
    for id in 1..=3 {
        q.publish(0, NewMessage::new(id, vec![1; 10], true))
            .expect("publish");
    }
    assert_eq!(called(), before + 1, "once for three publishes");
    let mut job = q.prepare_sync().expect("prepare").expect("a job");
    assert!(q.arm_unsynced(), "its commit is in flight: still owed");
    assert_eq!(called(), before + 2);
    job.run().expect("run");
    q.complete_sync(&job).expect("complete");
    assert!(!q.arm_unsynced(), "nothing left to sync");
    let d = q.fetch(0).expect("fetch").expect("a message");
    q.ack(d.tag).expect("ack");
    assert_eq!(called(), before + 3, "the ack's mark");
    assert!(!q.tell_unsynced(), "told already: nothing was missed");
}

#[test]
fn real_files_on_one_file_system_are_synced_together() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = FsStorage::default();
    fs.create_dir_all(dir.path()).expect("dir");
    let files: Vec<_> = (0..3)
        .map(|i| {
            let f = fs
                .create_new(&dir.path().join(format!("f{i}")))
                .expect("create");
            f.write_at(b"data", 0).expect("write");
            f
        })
        .collect();
    let devs: Vec<_> = files.iter().map(|f| f.file_system()).collect();
    assert!(devs[0].is_some());
    assert!(devs.iter().all(|d| *d == devs[0]));
    let handles: Vec<_> = files.iter().map(|f| &**f).collect();
    let results = fs.sync_files(&handles);
    assert_eq!(results.len(), 3);
    assert!(results.iter().all(Result::is_ok));
}

/// A sync job writes the appends it covers off the queue's lock; if the queue
/// reads or writes its file first, the queue writes them, and the job, run
/// late, must not write them again over what came after.
#[test]
fn a_sync_job_run_late_never_overwrites_later_appends() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let dir = Path::new("/node/lazy");
    let store = StoreConfig {
        resident_bytes_max: 0,
        ..StoreConfig::default()
    };
    let open = || {
        BackingQueue::open_in(Arc::clone(&storage), dir, QueueConfig::default(), store)
            .expect("open")
            .0
    };
    let mut q = open();
    q.publish(0, NewMessage::new(1, vec![1; 100], true))
        .expect("publish");
    let mut first = q.prepare_sync().expect("prepare").expect("durable");
    q.publish(0, NewMessage::new(2, vec![2; 100], true))
        .expect("publish");
    // Lazy mode: both bodies are read back from the file, which makes the
    // queue write the first job's appends, then its own buffer.
    let got = drain(&mut q, 0);
    assert_eq!(got.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2]);
    assert!(got[0].body.iter().all(|&b| b == 1));
    assert!(got[1].body.iter().all(|&b| b == 2));
    first.run().expect("first job");
    q.complete_sync(&first).expect("complete first");
    let mut second = q.prepare_sync().expect("prepare").expect("durable");
    second.run().expect("second job");
    q.complete_sync(&second).expect("complete second");
    drop(q);
    mem.crash();
    let mut q = open();
    let got = drain(&mut q, 0);
    assert_eq!(got.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2]);
    assert!(got.iter().all(|d| d.redelivered));
}

/// Opens the queue in `dir` with the default settings (recovery must not
/// fail: no corrupt segment).
fn open_default(storage: &Arc<dyn Storage>, dir: &Path) -> (BackingQueue, RecoveryReport) {
    BackingQueue::open_in(
        Arc::clone(storage),
        dir,
        QueueConfig::default(),
        StoreConfig::default(),
    )
    .expect("open (no corrupt segment)")
}

/// A sync job whose write fails (a failing disk) is never completed (the
/// broker drops it); the appends it carried must not be lost on the way:
/// the next job writes them first, so the file never has a hole of zeros
/// that recovery refuses as corruption (a node could not restart).
#[test]
fn a_failed_sync_jobs_appends_are_written_by_the_next_one() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let dir = Path::new("/node/failing");
    let open = || open_default(&storage, dir).0;
    let mut q = open();
    q.publish(0, NewMessage::new(1, vec![1; 100], true))
        .expect("publish");
    let mut failed = q.prepare_sync().expect("prepare").expect("durable");
    mem.set_failing(true);
    assert!(failed.run().is_err(), "the disk fails");
    mem.set_failing(false);
    q.publish(0, NewMessage::new(2, vec![2; 100], true))
        .expect("publish");
    let mut next = q.prepare_sync().expect("prepare").expect("durable");
    next.run().expect("the disk works again");
    // The failed job was never completed: the log is poisoned now.
    assert!(q.complete_sync(&next).is_err());
    drop(q);
    for crash in [false, true] {
        if crash {
            mem.crash();
        }
        let mut q = open();
        let got = drain(&mut q, 0);
        assert_eq!(got.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2]);
    }
}

/// A delivery mark not yet synced when the power fails is lost with it: the
/// log then tells from the changed boot that every message it recovers may
/// have been delivered. A process restart on the same boot keeps them as
/// they were (one was delivered, the other not).
#[test]
fn after_a_power_loss_every_recovered_message_may_have_been_delivered() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let dir = Path::new("/node/power");
    let open = || open_default(&storage, dir);
    let (mut q, report) = open();
    assert!(!report.rebooted, "a new log recovered nothing");
    assert!(!report.found, "a new log");
    for id in [1, 2] {
        q.publish(0, NewMessage::new(id, vec![id as u8; 10], true))
            .expect("publish");
    }
    let mut job = q.prepare_sync().expect("prepare").expect("durable");
    job.run().expect("sync");
    q.complete_sync(&job).expect("complete");
    let first = q.fetch(0).expect("fetch").expect("a message");
    assert!(!first.redelivered);
    let mut job = q.prepare_sync().expect("prepare").expect("a mark to sync");
    job.run().expect("sync");
    q.complete_sync(&job).expect("complete");
    drop(q);
    // Same boot: the synced mark says which one was delivered.
    let (mut q, report) = open();
    assert!(!report.rebooted);
    assert!(report.found, "a log opened again");
    let got = drain(&mut q, 0);
    assert_eq!(
        got.iter()
            .map(|d| (d.id, d.redelivered))
            .collect::<Vec<_>>(),
        [(1, true), (2, false)]
    );
    // Delivered again; this mark is never synced, and the power fails.
    drop(q);
    let (mut q, _) = open();
    let second = q.fetch(0).expect("fetch").expect("a message");
    assert_eq!(second.id, 1);
    let third = q.fetch(0).expect("fetch").expect("a message");
    assert_eq!((third.id, third.redelivered), (2, false));
    drop(q);
    mem.crash();
    let (mut q, report) = open();
    assert!(report.rebooted);
    let got = drain(&mut q, 0);
    assert_eq!(got.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2]);
    assert!(
        got.iter().all(|d| d.redelivered),
        "message 2 was delivered before the power loss"
    );
}

/// A queue replaced while its sync job ran (its directory reopened: a
/// mirror's store renewed at a node's stop) ignores that job: the new log
/// is not poisoned, and its own jobs complete in order.
#[test]
fn a_sync_job_of_a_replaced_log_is_ignored() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let dir = Path::new("/node/replaced");
    let open = || {
        BackingQueue::open_in(
            Arc::clone(&storage),
            dir,
            QueueConfig::default(),
            StoreConfig::default(),
        )
        .expect("open")
        .0
    };
    let mut old = open();
    old.publish(0, NewMessage::new(1, vec![1; 100], true))
        .expect("publish");
    let mut late = old.prepare_sync().expect("prepare").expect("durable");
    late.run().expect("run");
    drop(old);
    let mut new = open();
    new.publish(0, NewMessage::new(2, vec![2; 100], true))
        .expect("publish");
    let synced = new.synced_seq();
    assert_eq!(new.complete_sync(&late).expect("ignored"), synced);
    let mut own = new.prepare_sync().expect("prepare").expect("durable");
    own.run().expect("run");
    assert!(new.complete_sync(&own).expect("complete") > synced);
    assert!(!new.needs_sync());
}

/// A queue whose disk failed is opened again from its log once the disk
/// works (`reopen_in`): what it held in memory, delivery marks included, is
/// gone, so every message it recovers comes back marked delivered; the
/// confirmed ones are all there, and it takes publishes again.
#[test]
fn a_queue_reopened_after_its_disk_failed_marks_what_it_recovers_delivered() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let dir = Path::new("/node/reopened");
    let mut q = open_default(&storage, dir).0;
    for id in 1..=3 {
        q.publish(0, NewMessage::new(id, vec![id as u8; 10], true))
            .expect("publish");
    }
    q.sync().expect("synced: all three confirmed");
    let first = q.fetch(0).expect("fetch").expect("a message");
    assert_eq!((first.id, first.redelivered), (1, false));
    mem.set_failing(true);
    q.publish(0, NewMessage::new(4, vec![4; 10], true))
        .expect("publish");
    assert!(q.sync().is_err(), "the disk fails");
    assert!(q.sync().is_err(), "poisoned");
    assert!(
        BackingQueue::reopen_in(
            Arc::clone(&storage),
            dir,
            QueueConfig::default(),
            StoreConfig::default()
        )
        .is_err(),
        "not while the disk fails"
    );
    mem.set_failing(false);
    drop(q);
    let (mut q, _) = BackingQueue::reopen_in(
        Arc::clone(&storage),
        dir,
        QueueConfig::default(),
        StoreConfig::default(),
    )
    .expect("reopened");
    let got: Vec<(u64, bool)> = drain(&mut q, 0)
        .iter()
        .map(|d| (d.id, d.redelivered))
        .collect();
    assert_eq!(got, [(1, true), (2, true), (3, true)]);
    q.publish(0, NewMessage::new(5, vec![5; 10], true))
        .expect("publish");
    q.sync().expect("the log works again");
}
