//! The node's journal (`Journal`): many queues' group commit made durable by
//! one append to it, replayed into the queues' files after a power loss.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use warren_backing_queue::{
    BackingQueue, Journal, JournalReport, MemStorage, NewMessage, QueueConfig, Storage,
    StoreConfig, SyncJob,
};

use crate::{commit_together, drain};

const JOURNAL: &str = "/node/journal";

fn queue_dir(k: usize) -> PathBuf {
    PathBuf::from(format!("/node/queues/q{k}"))
}

fn open_queue(storage: &Arc<dyn Storage>, k: usize) -> BackingQueue {
    BackingQueue::open_in(
        Arc::clone(storage),
        &queue_dir(k),
        QueueConfig::default(),
        StoreConfig::default(),
    )
    .expect("open")
    .0
}

/// Publishes message `id` (body `len` bytes of `id`) to each queue and
/// commits them together with `journal`.
fn publish_and_commit(queues: &mut [BackingQueue], id: u64, len: usize, journal: Option<&Journal>) {
    let mut last = Vec::new();
    for q in queues.iter_mut() {
        let seq = q
            .publish(0, NewMessage::new(id, vec![id as u8; len], true))
            .expect("publish")
            .seq;
        last.push(seq);
    }
    commit_together(queues, &last, journal);
}

fn ids(q: &mut BackingQueue) -> Vec<u64> {
    drain(q, 0).iter().map(|d| d.id).collect()
}

/// The bytes of queue `k`'s segment files that survived.
fn durable_bytes(mem: &MemStorage, k: usize) -> usize {
    let storage: &dyn Storage = mem;
    storage
        .list(&queue_dir(k))
        .unwrap_or_default()
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .filter_map(|p| mem.file(p))
        .map(|d| d.len())
        .sum()
}

#[test]
fn a_journaled_group_commit_survives_a_power_loss_by_replay() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let (journal, _) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("journal");
    let mut queues: Vec<_> = (0..8).map(|k| open_queue(&storage, k)).collect();
    let empty = durable_bytes(&mem, 0);
    for id in 1..=3 {
        publish_and_commit(&mut queues, id, 200, Some(&journal));
    }
    drop(queues);
    drop(journal);
    mem.crash();
    // The queues' files were never synced: only the journal holds the
    // messages (so the journal, not a sync of the files, made them durable).
    for k in 0..8 {
        assert_eq!(durable_bytes(&mem, k), empty, "queue {k} was synced");
    }
    let (_, report) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("replay");
    assert_eq!(report.replayed, 3 * 8);
    for k in 0..8 {
        assert_eq!(ids(&mut open_queue(&storage, k)), [1, 2, 3], "queue {k}");
    }
    // Replay is done once: the journal starts empty.
    let (_, again) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("reopen");
    assert_eq!(again.replayed, 0);
}

/// A write journaled, a later one synced in the file itself (a commit of
/// one queue), then a power loss: replaying the first must not cut the
/// second off (a log writes an end mark behind each write, which the next
/// overwrites; the journal leaves it out).
#[test]
fn replay_never_undoes_a_later_write_synced_in_the_file() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let (journal, _) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("journal");
    let mut queues: Vec<_> = (0..2).map(|k| open_queue(&storage, k)).collect();
    publish_and_commit(&mut queues, 1, 100, Some(&journal));
    // One queue alone: its own fdatasync, no journal record.
    publish_and_commit(&mut queues[..1], 2, 100, Some(&journal));
    publish_and_commit(&mut queues, 3, 100, Some(&journal));
    drop(queues);
    drop(journal);
    mem.crash();
    Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("replay");
    assert_eq!(ids(&mut open_queue(&storage, 0)), [1, 2, 3]);
    assert_eq!(ids(&mut open_queue(&storage, 1)), [1, 3]);
}

/// A queue deleted and declared again under the same directory must not
/// get the old queue's journaled bytes back after a power loss.
#[test]
fn a_forgotten_directory_gets_none_of_its_old_records() {
    for commit_new in [false, true] {
        let mem = MemStorage::new();
        let storage: Arc<dyn Storage> = Arc::new(mem.clone());
        let (journal, _) =
            Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("journal");
        let mut queues: Vec<_> = (0..2).map(|k| open_queue(&storage, k)).collect();
        publish_and_commit(&mut queues, 1, 100, Some(&journal));
        publish_and_commit(&mut queues, 2, 100, Some(&journal));
        redeclare(&mut queues, 0, 0, &storage, &journal);
        if commit_new {
            publish_and_commit(&mut queues, 7, 50, Some(&journal));
        }
        let report = crash_and_replay(queues, journal, &mem, &storage);
        assert_eq!(report.skipped, 2, "the old queue's two writes");
        let expected: &[u64] = if commit_new { &[7] } else { &[] };
        assert_eq!(ids(&mut open_queue(&storage, 0)), expected);
        let kept: &[u64] = if commit_new { &[1, 2, 7] } else { &[1, 2] };
        assert_eq!(ids(&mut open_queue(&storage, 1)), kept);
    }
}

/// Closes `queues` and `journal`, crashes `mem` (what was not synced is
/// lost) and replays the journal.
fn crash_and_replay(
    queues: Vec<BackingQueue>,
    journal: Arc<Journal>,
    mem: &MemStorage,
    storage: &Arc<dyn Storage>,
) -> JournalReport {
    drop(queues);
    drop(journal);
    mem.crash();
    Journal::open(Arc::clone(storage), Path::new(JOURNAL))
        .expect("replay")
        .1
}

/// Deletes queue `k`, at `at` in `queues` (its directory forgotten by the
/// journal, then removed), and declares it again in its place.
fn redeclare(
    queues: &mut Vec<BackingQueue>,
    at: usize,
    k: usize,
    storage: &Arc<dyn Storage>,
    journal: &Journal,
) {
    drop(queues.remove(at));
    journal.forget_dir(&queue_dir(k)).expect("forget");
    storage.remove_dir_all(&queue_dir(k)).expect("remove");
    queues.insert(at, open_queue(storage, k));
}

/// A replay drops the writes of a forgotten directory (`q1`) alone, not
/// those of `q10` beside it, nor those made under `q1` after it was
/// forgotten.
#[test]
fn a_replay_forgets_the_forgotten_directory_alone() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let (journal, _) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("journal");
    let mut queues: Vec<_> = [1, 10].iter().map(|&k| open_queue(&storage, k)).collect();
    publish_and_commit(&mut queues, 1, 100, Some(&journal));
    redeclare(&mut queues, 0, 1, &storage, &journal);
    publish_and_commit(&mut queues, 2, 100, Some(&journal));
    let report = crash_and_replay(queues, journal, &mem, &storage);
    assert_eq!(report.skipped, 1, "the old q1's write");
    assert_eq!(ids(&mut open_queue(&storage, 1)), [2]);
    assert_eq!(ids(&mut open_queue(&storage, 10)), [1, 2]);
}

/// A journal that checkpoints past 4 KiB, on storage that can crash.
fn checkpointing_at_4_kib() -> (MemStorage, Arc<dyn Storage>, Arc<Journal>) {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let (journal, _) =
        Journal::open_with_checkpoint(Arc::clone(&storage), Path::new(JOURNAL), 4096)
            .expect("journal");
    (mem, storage, journal)
}

/// Forgetting one queue's directory (`q1`) keeps the journal's hold on
/// every other queue's files, `q10`'s and `q0`'s beside it too: a checkpoint
/// after it still syncs them before it drops the records.
#[test]
fn forgetting_a_directory_keeps_the_neighbours_covered() {
    let (mem, storage, journal) = checkpointing_at_4_kib();
    let ks = [0, 1, 10, 2];
    let mut queues: Vec<_> = ks.iter().map(|&k| open_queue(&storage, k)).collect();
    publish_and_commit(&mut queues, 1, 100, Some(&journal));
    drop(queues.remove(1));
    journal.forget_dir(&queue_dir(1)).expect("forget");
    storage.remove_dir_all(&queue_dir(1)).expect("remove");
    // Only q0 and q2 write on, past the checkpoint: q10's one message is
    // durable only if the checkpoint synced its file.
    let mut others = vec![queues.remove(0), queues.pop().expect("q2")];
    for id in 2..=20 {
        publish_and_commit(&mut others, id, 300, Some(&journal));
    }
    drop((queues, others));
    drop(journal);
    mem.crash();
    Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("replay");
    assert_eq!(ids(&mut open_queue(&storage, 10)), [1]);
    assert_eq!(
        ids(&mut open_queue(&storage, 0)),
        (1..=20).collect::<Vec<u64>>()
    );
    assert_eq!(ids(&mut open_queue(&storage, 1)), [] as [u64; 0]);
}

/// Past its checkpoint size the journal syncs the files it covers and
/// starts a new file: what was committed before survives without it.
#[test]
fn a_checkpoint_syncs_the_files_and_starts_a_new_journal() {
    let (mem, storage, journal) = checkpointing_at_4_kib();
    let mut queues: Vec<_> = (0..4).map(|k| open_queue(&storage, k)).collect();
    for id in 1..=10 {
        publish_and_commit(&mut queues, id, 300, Some(&journal));
    }
    let files = storage.list(Path::new(JOURNAL)).expect("list");
    assert_eq!(files.len(), 1, "old journal files are removed: {files:?}");
    let name = files[0].file_name().and_then(|n| n.to_str()).unwrap_or("");
    assert_ne!(
        name,
        format!("{:020}.jnl", 1),
        "a checkpoint started a new file"
    );
    drop(queues);
    drop(journal);
    mem.crash();
    let (_, report) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("replay");
    assert!(
        report.replayed < 10 * 4,
        "part was checkpointed: {report:?}"
    );
    for k in 0..4 {
        assert_eq!(
            ids(&mut open_queue(&storage, k)),
            (1..=10).collect::<Vec<_>>()
        );
    }
}

/// A journal whose write fails fails the commits it carried (the queues
/// must be reopened, as after a failed fsync); once the disk works, the
/// next commits go through it again and survive a power loss.
#[test]
fn a_failed_journal_write_fails_its_commit_only() {
    let mem = MemStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let (journal, _) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("journal");
    let mut queues: Vec<_> = (0..2).map(|k| open_queue(&storage, k)).collect();
    publish_and_commit(&mut queues, 5, 50, Some(&journal));
    for q in &mut queues {
        q.publish(0, NewMessage::new(1, vec![1; 100], true))
            .expect("publish");
    }
    let mut jobs: Vec<SyncJob> = queues
        .iter_mut()
        .map(|q| q.prepare_sync().expect("prepare").expect("durable"))
        .collect();
    // A large body is written to the file at once, and the jobs' buffers
    // before it: their writes went through; then the disk fails.
    for q in &mut queues {
        q.publish(0, NewMessage::new(9, vec![9; 100 << 10], true))
            .expect("publish");
    }
    mem.set_failing(true);
    let mut refs: Vec<&mut SyncJob> = jobs.iter_mut().collect();
    let results = SyncJob::run_all(&mut refs, Some(&journal));
    assert!(results.iter().all(Result::is_err));
    // Nor may a directory the journal covers be removed meanwhile.
    drop(queues.pop());
    assert!(
        warren_backing_queue::remove_log_dir(&*storage, Some(&journal), &queue_dir(1)).is_err()
    );
    mem.set_failing(false);
    assert!(storage.list(&queue_dir(1)).is_ok(), "the directory stays");
    for (q, job) in queues.iter_mut().zip(&jobs) {
        assert!(
            q.complete_sync(job).is_err(),
            "a failed commit poisons the log"
        );
    }
    drop(queues);
    // Reopened (recovery), the queues commit through the journal again.
    let mut queues: Vec<_> = (0..2).map(|k| open_queue(&storage, k)).collect();
    publish_and_commit(&mut queues, 2, 100, Some(&journal));
    drop(queues);
    drop(journal);
    mem.crash();
    let (_, report) = Journal::open(Arc::clone(&storage), Path::new(JOURNAL)).expect("replay");
    assert_eq!(report.replayed, 4);
    for k in 0..2 {
        let got = ids(&mut open_queue(&storage, k));
        assert!(
            got.starts_with(&[5]) && got.ends_with(&[2]),
            "queue {k}: {got:?}"
        );
    }
}
