//! The durable segment log: append-only files of CRC-checked records in one
//! directory, group-committed with `fdatasync`, compacted so that disk use
//! follows the live queue.
//!
//! Invariants:
//! - Records are appended to the last ("active") segment. When it is full the
//!   log writes it out, seals it and starts a new one. A sealed segment is
//!   synced before any byte of a later one is written, by the next
//!   [`SyncJob`] (off the caller's lock) or by the log if it must write
//!   first; so only the last segment that holds records can ever have a torn
//!   tail, and recovery drops the segments after a torn one (they hold none).
//! - A segment is deleted only from the head (oldest first), once none of its
//!   publishes is live, and only by a [`SyncJob`] after that job's sync has
//!   made every removal and every compaction copy durable. Recovery ignores
//!   removals of unknown messages and lets a later copy of a message replace an
//!   earlier one, so an interrupted deletion is harmless.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

use crate::core::{Entry, Removed, StoreRef};
use crate::error::StoreError;
use crate::journal::{Journal, JournalWrite};
use crate::record::{self, Invalid, PublishMeta, Record};
use crate::storage::{Storage, StorageFile};

/// Numbers every log opened in this process ([`SyncJob`]s name theirs).
static NEXT_LOG_ID: AtomicU64 = AtomicU64::new(1);

/// Options of the durable store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// A segment is closed and a new one started past this many bytes.
    pub segment_bytes: u64,
    /// Lazy mode: once the queue holds more than this many body bytes, new
    /// messages keep their body (and properties) only on disk and are read
    /// back on fetch (transient ones too: they are written to the log but not
    /// synced for, and recovery ignores them). `0` is RabbitMQ's lazy mode; `u64::MAX` keeps
    /// everything in memory.
    pub resident_bytes_max: u64,
    /// At recovery, skip corrupt records (reported in [`RecoveryReport`])
    /// instead of failing with [`StoreError::Corrupt`].
    pub skip_corrupt: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 8 << 20,
            resident_bytes_max: u64::MAX,
            skip_corrupt: false,
        }
    }
}

/// What recovery found besides the messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Messages recovered.
    pub messages: u64,
    /// A torn tail cut off the last segment: the file and the offset it was cut at.
    pub truncated: Option<(PathBuf, u64)>,
    /// Corrupt regions skipped (`skip_corrupt`): file, offset, bytes skipped.
    pub skipped: Vec<(PathBuf, u64, u64)>,
    /// The machine restarted since the log was last opened (its
    /// [`Storage::boot_id`] changed): delivery marks it never synced may be
    /// lost, so every message recovered comes back marked delivered
    /// (AMQP's `redelivered`: it may have been delivered before).
    pub rebooted: bool,
    /// The directory held files already: a log opened again, not a new one.
    pub found: bool,
}

/// Below this many buffered bytes, appends stay in memory until a sync.
const WRITE_BUFFER_BYTES: usize = 1 << 20;
/// Bodies this large are written to the file directly, not through the buffer.
const LARGE_BODY_BYTES: usize = 64 << 10;
/// Written after the last record (a record length of zero, which no record
/// has); overwritten by the next append.
const END_MARK: [u8; 4] = [0; 4];
/// Jobs of one group commit from which their journal stands for their
/// files' syncs.
const JOURNAL_MIN_FILES: usize = 2;
/// Old segment files kept for reuse.
const MAX_SPARES: usize = 2;
/// Pending remove/delivered marks are written as one record per this many.
const MARKS_BATCH: usize = 4096;

#[derive(Debug)]
struct Segment {
    id: u32,
    path: PathBuf,
    file: Arc<dyn StorageFile>,
    /// Bytes appended, including those still in the write buffer.
    len: u64,
    /// Bytes written to the file.
    written: u64,
    /// Bytes made durable (synced, or journaled) or handed to the sync job
    /// that will: a job may be journaled only if everything written past
    /// this is in its own buffer.
    durable: u64,
    live: u64,
    live_bytes: u64,
}

/// The segment log of one durable queue.
#[derive(Debug)]
pub(crate) struct SegmentLog {
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    cfg: StoreConfig,
    segments: VecDeque<Segment>,
    /// Appended to the active segment but not yet written.
    buf: Vec<u8>,
    pending_removed: Vec<u64>,
    pending_delivered: Vec<u64>,
    /// Highest seq of an appended publish.
    appended_seq: u64,
    /// Every publish with seq ≤ this is on disk and synced.
    synced_seq: u64,
    dir_dirty: bool,
    /// Head segments with no live messages, to delete after the next sync.
    retired: Vec<PathBuf>,
    /// Old segment files kept for reuse (renamed `*.spare`): writing into
    /// already allocated blocks makes `fdatasync` cheaper.
    spares: Vec<PathBuf>,
    /// Spares being made by the sync job in flight.
    spares_in_flight: usize,
    live_bytes: u64,
    disk_bytes: u64,
    /// Tells this log's sync jobs from those of a log it replaced (the
    /// same directory reopened).
    id: u64,
    gen_prepared: u64,
    gen_completed: u64,
    /// A sync job failed or was lost: durability can no longer be promised
    /// (after a failed fsync the page cache cannot be trusted). Reopen.
    poisoned: bool,
    /// The write buffer last handed to a sync job, until written.
    deferred: DeferredSlot,
    /// Segments rolled over and not yet synced.
    sealed: SealedSlot,
    /// A segment was sealed since the last sync job was prepared, or that
    /// job has not completed: until then writing the active segment means
    /// syncing the sealed one first.
    sealed_pending: bool,
    /// The first sync job that syncs what is sealed now.
    sealed_by_gen: u64,
    /// No segment is retired or compacted while set: a lazy snapshot reads
    /// its records later (see `BackingQueue::snapshot_lazy`).
    pinned: bool,
    /// Called when the log gets something to sync ([`Self::tell_unsynced`]).
    unsynced_hook: Option<Hook>,
    /// The hook was called since it was last armed.
    told: bool,
}

/// What a log calls when it gets something to sync, so that its owner
/// commits the logs that need it without asking every log it has
/// ([`crate::BackingQueue::on_unsynced`]).
pub type UnsyncedHook = Arc<dyn Fn() + Send + Sync>;

/// An [`UnsyncedHook`] in a log.
pub(crate) struct Hook(pub(crate) UnsyncedHook);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnsyncedHook")
    }
}

/// A log's write buffer handed to a [`SyncJob`] by `prepare_sync`: written
/// by the job, off the queue's lock, or by the log itself if it touches the
/// file before the job ran. Whoever comes first writes it while holding the
/// slot, so it always reaches the file before any later write or read; the
/// data stays for the job to journal.
#[derive(Debug)]
struct DeferredWrite {
    file: Arc<dyn StorageFile>,
    path: PathBuf,
    offset: u64,
    /// The bytes, ending with [`END_MARK`].
    data: Vec<u8>,
    written: bool,
}

type DeferredSlot = Arc<Mutex<Option<DeferredWrite>>>;

/// A full segment closed by a roll and not yet synced, with the log's
/// directory if the segment's own creation is not yet durable.
#[derive(Debug)]
struct Sealed {
    file: Arc<dyn StorageFile>,
    path: PathBuf,
    dir: Option<PathBuf>,
}

/// The segments a log sealed and nobody has synced yet, oldest first.
type SealedSlot = Arc<Mutex<Vec<Sealed>>>;

/// Syncs the sealed segments, oldest first; whoever writes a segment file
/// calls it first, so that no later segment holds a byte before every
/// earlier one is durable. One that fails stays, to be synced again.
fn sync_sealed(storage: &dyn Storage, slot: &Mutex<Vec<Sealed>>) -> Result<(), StoreError> {
    let mut sealed = slot.lock().unwrap_or_else(PoisonError::into_inner);
    while let Some(s) = sealed.first() {
        s.file.sync_data().map_err(|e| StoreError::io(&s.path, e))?;
        if let Some(dir) = &s.dir {
            sync_dir(storage, dir)?;
        }
        sealed.remove(0);
    }
    Ok(())
}

/// Writes the slot's buffer if nobody has yet.
///
/// A write that fails stays in the slot: the log's next attempt
/// (`settle_deferred`) writes it again, or is poisoned. Taking it out
/// first lost it, and the next append went in after a hole of zeros that
/// recovery refuses as corruption.
fn write_deferred(
    storage: &dyn Storage,
    sealed: &Mutex<Vec<Sealed>>,
    slot: &Mutex<Option<DeferredWrite>>,
) -> Result<(), StoreError> {
    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(w) = slot.as_mut().filter(|w| !w.written) {
        sync_sealed(storage, sealed)?;
        w.file
            .write_at(&w.data, w.offset)
            .map_err(|e| StoreError::io(&w.path, e))?;
        w.written = true;
    }
    Ok(())
}

/// One group commit: syncs everything appended before it was prepared, then
/// deletes the segments retired before it. Run it on any thread (one job at a
/// time), then hand it back to
/// [`complete_sync`](crate::BackingQueue::complete_sync).
#[derive(Debug)]
pub struct SyncJob {
    /// The log that prepared it.
    log: u64,
    generation: u64,
    storage: Arc<dyn Storage>,
    /// The appends to write before the sync, unless the log already did.
    deferred: Option<DeferredSlot>,
    /// The log's sealed segments, synced before anything else is written.
    sealed: SealedSlot,
    file: Option<(Arc<dyn StorageFile>, PathBuf)>,
    /// Everything `file` holds past its last sync is in `deferred`: a
    /// journal record of it may stand for the file's sync (and with no
    /// `deferred`, the file needs none).
    journalable: bool,
    dir: Option<PathBuf>,
    up_to: u64,
    /// Retired segments, oldest first, each with the spare name to rename it
    /// to (or `None`: delete it).
    retired: Vec<(PathBuf, Option<PathBuf>)>,
    ran: bool,
}

fn sync_dir(storage: &dyn Storage, dir: &Path) -> Result<(), StoreError> {
    storage.sync_dir(dir).map_err(|e| StoreError::io(dir, e))
}

impl SyncJob {
    /// Performs the fsyncs and deletions. Blocking.
    pub fn run(&mut self) -> Result<(), StoreError> {
        self.write()?;
        self.release_data();
        if let Some((file, path)) = self.file.as_ref().filter(|_| self.needs_file_sync()) {
            file.sync_data().map_err(|e| StoreError::io(path, e))?;
        }
        self.finish()
    }

    /// Frees the buffer once it is in the file and journaled (or needs no
    /// journal): an idle queue keeps no copy of its last commit.
    fn release_data(&self) {
        if let Some(slot) = &self.deferred {
            let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.as_ref().is_some_and(|w| w.written) {
                *slot = None;
            }
        }
    }

    /// Whether the file must be synced: it holds bytes past its last sync
    /// (without a journal, even those in `deferred`).
    fn needs_file_sync(&self) -> bool {
        !self.journalable || self.deferred.is_some()
    }

    /// Runs many group commits (of different queues) at once, each as
    /// [`run`](Self::run) would. With a `journal`, the jobs on its
    /// storage whose new bytes are all in their buffers are made durable by
    /// one journal append and one sync ([`Journal`]); the other jobs' files
    /// on one [`Storage`] are synced in one [`Storage::sync_files`] call
    /// (one `syncfs` on [`FsStorage::shared`](crate::FsStorage::shared)).
    /// Then each job's directory syncs and deletions run. One result per
    /// job, in order.
    pub fn run_all(
        jobs: &mut [&mut SyncJob],
        journal: Option<&Journal>,
    ) -> Vec<Result<(), StoreError>> {
        let mut synced: Vec<Option<Result<(), StoreError>>> = jobs.iter().map(|_| None).collect();
        let mut groups: Vec<(*const (), Vec<usize>)> = Vec::new();
        let mut journaled: Vec<usize> = Vec::new();
        for (i, job) in jobs.iter_mut().enumerate() {
            if let Err(e) = job.write() {
                synced[i] = Some(Err(e));
                continue;
            }
            if job.file.is_none() || !job.needs_file_sync() {
                synced[i] = Some(Ok(()));
                continue;
            }
            let key = Arc::as_ptr(&job.storage).cast::<()>();
            if job.journalable
                && journal.is_some_and(|j| Arc::as_ptr(j.storage()).cast::<()>() == key)
            {
                journaled.push(i);
                continue;
            }
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => groups.push((key, vec![i])),
            }
        }
        if let Some(journal) = journal
            && !journaled.is_empty()
        {
            if journaled.len() < JOURNAL_MIN_FILES {
                // One file: its own sync costs what the journal's would.
                let key = Arc::as_ptr(&jobs[journaled[0]].storage).cast::<()>();
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, members)) => members.append(&mut journaled),
                    None => groups.push((key, std::mem::take(&mut journaled))),
                }
            } else {
                let slots: Vec<_> = journaled
                    .iter()
                    .filter_map(|&i| jobs[i].deferred.as_ref())
                    .map(|slot| slot.lock().unwrap_or_else(PoisonError::into_inner))
                    .collect();
                let writes: Vec<JournalWrite<'_>> = slots
                    .iter()
                    .filter_map(|slot| slot.as_ref())
                    .map(|w| JournalWrite {
                        path: &w.path,
                        file: &w.file,
                        offset: w.offset,
                        data: &w.data[..w.data.len() - END_MARK.len()],
                    })
                    .collect();
                let res = journal.commit(&writes);
                drop(writes);
                drop(slots);
                for &i in &journaled {
                    synced[i] = Some(match &res {
                        Ok(()) => Ok(()),
                        Err(e) => Err(StoreError::io(
                            jobs[i]
                                .file
                                .as_ref()
                                .map_or(Path::new(""), |(_, p)| p.as_path()),
                            std::io::Error::other(format!("journal commit failed: {e}")),
                        )),
                    });
                }
            }
        }
        for job in jobs.iter() {
            job.release_data();
        }
        for (_, members) in groups {
            let files: Vec<&(Arc<dyn StorageFile>, PathBuf)> = members
                .iter()
                .filter_map(|&i| jobs[i].file.as_ref())
                .collect();
            let handles: Vec<&dyn StorageFile> = files.iter().map(|(f, _)| &**f).collect();
            let results = jobs[members[0]].storage.sync_files(&handles);
            for ((&i, res), (_, path)) in members.iter().zip(results).zip(files) {
                synced[i] = Some(res.map_err(|e| StoreError::io(path, e)));
            }
        }
        jobs.iter_mut()
            .zip(synced)
            .map(|(job, res)| match res {
                Some(Ok(())) => job.finish(),
                Some(Err(e)) => Err(e),
                None => Err(StoreError::io(
                    job.file
                        .as_ref()
                        .map_or(Path::new(""), |(_, p)| p.as_path()),
                    std::io::Error::other("the storage returned no sync result for this file"),
                )),
            })
            .collect()
    }

    /// Syncs the segments the log sealed, then writes the appends it
    /// handed over, unless it already did.
    fn write(&mut self) -> Result<(), StoreError> {
        sync_sealed(&*self.storage, &self.sealed)?;
        match &self.deferred {
            Some(slot) => write_deferred(&*self.storage, &self.sealed, slot),
            None => Ok(()),
        }
    }

    /// The rest of a group commit once its file is synced: the directory
    /// sync and the deletions.
    fn finish(&mut self) -> Result<(), StoreError> {
        if let Some(dir) = &self.dir {
            sync_dir(&*self.storage, dir)?;
        }
        // Oldest first, each unlink made durable before the next, so that a
        // crash never keeps an older segment whose removals lived in a newer one.
        for (path, spare) in &self.retired {
            let res = match spare {
                Some(spare) => self.storage.rename(path, spare),
                None => self.storage.remove(path),
            };
            match res {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::io(path, e)),
            }
            if let Some(dir) = path.parent() {
                sync_dir(&*self.storage, dir)?;
            }
        }
        self.ran = true;
        Ok(())
    }

    /// The publish watermark this job makes durable.
    pub fn up_to(&self) -> u64 {
        self.up_to
    }
}

fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("{id:010}.seg"))
}

fn segment_id(path: &Path) -> Option<u32> {
    if path.extension()? != "seg" {
        return None;
    }
    let stem = path.file_stem()?.to_str()?;
    (stem.len() == 10).then(|| stem.parse().ok()).flatten()
}

/// The result of opening a log.
pub(crate) struct Opened {
    pub(crate) log: SegmentLog,
    pub(crate) messages: Vec<Entry>,
    pub(crate) next_seq: u64,
    pub(crate) report: RecoveryReport,
}

/// Names the machine boot that last opened a log ([`Storage::boot_id`]).
const BOOT_FILE: &str = "boot";

/// This boot's id ([`Storage::boot_id`]), if it differs from the one
/// recorded by the last open of the log in `dir` (or none was).
fn new_boot(storage: &dyn Storage, dir: &Path) -> Option<Vec<u8>> {
    let boot = storage.boot_id();
    let last = storage.read(&dir.join(BOOT_FILE)).ok();
    (last.as_deref() != Some(boot.as_slice())).then_some(boot)
}

/// Records `boot` as the one that last opened the log in `dir`. No sync:
/// a record lost in a power loss reads as a restart, as that loss was one.
fn record_boot(storage: &dyn Storage, dir: &Path, boot: &[u8]) -> Result<(), StoreError> {
    let tmp = dir.join("boot.tmp");
    let _ = storage.remove(&tmp);
    let file = storage
        .create_new(&tmp)
        .map_err(|e| StoreError::io(&tmp, e))?;
    file.write_at(boot, 0)
        .map_err(|e| StoreError::io(&tmp, e))?;
    let path = dir.join(BOOT_FILE);
    storage
        .rename(&tmp, &path)
        .map_err(|e| StoreError::io(&path, e))
}

impl SegmentLog {
    /// Opens (creating if needed) the log in `dir` and replays it. With
    /// `marks_lost` (this process's copy of the log failed), every message
    /// recovered counts as delivered, as after a machine restart.
    pub(crate) fn open(
        storage: Arc<dyn Storage>,
        dir: &Path,
        cfg: StoreConfig,
        marks_lost: bool,
    ) -> Result<Opened, StoreError> {
        storage
            .create_dir_all(dir)
            .map_err(|e| StoreError::io(dir, e))?;
        let listing = storage.list(dir).map_err(|e| StoreError::io(dir, e))?;
        let mut ids: Vec<u32> = listing.iter().filter_map(|p| segment_id(p)).collect();
        let mut spares: Vec<PathBuf> = listing
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "spare"))
            .cloned()
            .collect();
        spares.sort();
        for extra in spares.split_off(spares.len().min(MAX_SPARES)) {
            storage
                .remove(&extra)
                .map_err(|e| StoreError::io(&extra, e))?;
        }
        ids.sort_unstable();

        let mut report = RecoveryReport {
            found: !listing.is_empty(),
            ..RecoveryReport::default()
        };
        let mut found: BTreeMap<u64, Entry> = BTreeMap::new();
        let mut max_seq = 0u64;
        let mut segments = VecDeque::new();
        let mut resident = 0u64;
        for (i, &id) in ids.iter().enumerate() {
            let is_last = i + 1 == ids.len();
            // A torn segment that is not the last: a crash came between a
            // roll and its sync, so the later ones hold no record and go.
            let tear_ends_log = || is_last || !holds_records(&*storage, dir, &ids[i + 1..]);
            let mut torn = false;
            let path = segment_path(dir, id);
            let data = Bytes::from(storage.read(&path).map_err(|e| StoreError::io(&path, e))?);
            let mut valid_len = data.len() as u64;
            let header_len = record::SEGMENT_HEADER_LEN as usize;
            match record::parse_segment_header(&data) {
                Some(base) => max_seq = max_seq.max(base.saturating_sub(1)),
                None if data.len() < header_len && is_torn_header(&data) && tear_ends_log() => {
                    valid_len = 0;
                    torn = true;
                }
                None if cfg.skip_corrupt => {
                    report.skipped.push((path.clone(), 0, header_len as u64));
                }
                None => {
                    return Err(StoreError::Corrupt {
                        file: path,
                        offset: 0,
                        reason: "bad segment header".into(),
                    });
                }
            }
            let mut pos = header_len;
            while valid_len != 0 && pos < data.len() {
                let parsed = record::check(&data[pos..], id)
                    .and_then(|(total, payload)| Ok((total, record::decode(payload)?)));
                match parsed {
                    Ok((total, rec)) => {
                        let store = StoreRef {
                            segment: id,
                            offset: pos as u32,
                        };
                        apply_record(
                            &data,
                            &mut found,
                            &mut max_seq,
                            &mut resident,
                            &cfg,
                            rec,
                            store,
                        );
                        pos += total;
                    }
                    Err(invalid) => {
                        let next = next_valid(&data, pos + 1, id);
                        let reason = match invalid {
                            Invalid::Truncated => "record runs past the end of the file".to_owned(),
                            Invalid::Bad(r) => r,
                        };
                        match next {
                            None if is_last && data[pos..].starts_with(&END_MARK) => {
                                valid_len = pos as u64;
                                break;
                            }
                            None if tear_ends_log() => {
                                // The caller says so, once (`RecoveryReport::truncated`):
                                // an open retried every second must not repeat it.
                                tracing::debug!(file = %path.display(), offset = pos, "cutting off torn tail of segment log");
                                report.truncated = Some((path.clone(), pos as u64));
                                valid_len = pos as u64;
                                torn = true;
                                break;
                            }
                            _ if !cfg.skip_corrupt => {
                                return Err(StoreError::Corrupt {
                                    file: path,
                                    offset: pos as u64,
                                    reason,
                                });
                            }
                            next => {
                                let to = next.unwrap_or(data.len());
                                tracing::warn!(file = %path.display(), offset = pos, %reason, "skipping corrupt records");
                                report
                                    .skipped
                                    .push((path.clone(), pos as u64, (to - pos) as u64));
                                pos = to;
                            }
                        }
                    }
                }
            }
            let file = storage.open(&path).map_err(|e| StoreError::io(&path, e))?;
            if valid_len < data.len() as u64 {
                file.set_len(valid_len)
                    .map_err(|e| StoreError::io(&path, e))?;
            }
            // What we recovered may so far be only in the page cache.
            file.sync_data().map_err(|e| StoreError::io(&path, e))?;
            segments.push_back(Segment {
                id,
                path,
                file,
                len: valid_len,
                written: valid_len,
                durable: valid_len,
                live: 0,
                live_bytes: 0,
            });
            if torn && !is_last {
                for &later in &ids[i + 1..] {
                    let later = segment_path(dir, later);
                    tracing::debug!(file = %later.display(), "removing a segment begun after a torn one");
                    storage
                        .remove(&later)
                        .map_err(|e| StoreError::io(&later, e))?;
                }
                break;
            }
        }

        let mut log = SegmentLog {
            storage: Arc::clone(&storage),
            dir: dir.to_path_buf(),
            cfg,
            segments,
            buf: Vec::new(),
            pending_removed: Vec::new(),
            pending_delivered: Vec::new(),
            appended_seq: max_seq,
            synced_seq: max_seq,
            dir_dirty: false,
            retired: Vec::new(),
            spares,
            spares_in_flight: 0,
            live_bytes: 0,
            disk_bytes: 0,
            id: NEXT_LOG_ID.fetch_add(1, Ordering::Relaxed),
            gen_prepared: 0,
            gen_completed: 0,
            poisoned: false,
            deferred: DeferredSlot::default(),
            sealed: SealedSlot::default(),
            sealed_pending: false,
            sealed_by_gen: 0,
            pinned: false,
            unsynced_hook: None,
            told: false,
        };
        let next_seq = max_seq + 1;
        match log.segments.back() {
            Some(s) if s.len == 0 => {
                log.buf.extend_from_slice(&record::segment_header(next_seq));
                if let Some(s) = log.segments.back_mut() {
                    s.len = record::SEGMENT_HEADER_LEN;
                }
            }
            Some(_) => {}
            None => log.new_segment(0, next_seq)?,
        }
        // What recovery cut or removed is made durable now. A new log's
        // first segment is not: the first sync job syncs the directory
        // (`new_segment` marked it), rather than a declare waiting for it
        // here, under the broker's lock.
        if !ids.is_empty() {
            sync_dir(&*storage, dir)?;
        }
        let boot = new_boot(&*storage, dir);
        if boot.is_some() || marks_lost {
            if !found.is_empty() {
                // Marked on disk before this boot is recorded: a crash in
                // between finds the old boot and marks them again.
                report.rebooted = boot.is_some();
                for (&seq, e) in &mut found {
                    if !e.delivered() {
                        e.set_delivered(true);
                        log.mark_delivered(seq)?;
                    }
                }
                let mut job = log.prepare_sync()?;
                job.run()?;
                log.complete_sync(&job)?;
            }
            if let Some(boot) = boot {
                record_boot(&*storage, dir, &boot)?;
            }
        }

        let mut messages = Vec::with_capacity(found.len());
        for (_, f) in found {
            let bytes = crate::core::record_len(f.props_len, f.body_len, f.priority);
            if let Ok(i) = log
                .segments
                .binary_search_by_key(&f.store.segment, |s| s.id)
            {
                log.segments[i].live += 1;
                log.segments[i].live_bytes += bytes;
            }
            log.live_bytes += bytes;
            messages.push(f);
        }
        log.disk_bytes = log.segments.iter().map(|s| s.len).sum();
        log.retire_empty_head();
        report.messages = messages.len() as u64;
        Ok(Opened {
            log,
            messages,
            next_seq,
            report,
        })
    }

    fn new_segment(&mut self, id: u32, base_seq: u64) -> Result<(), StoreError> {
        let path = segment_path(&self.dir, id);
        // A spare's old records fail the CRC seeded with the new id. If the
        // spare is gone (removed by hand), make a new file.
        let recycled = self
            .spares
            .pop()
            .is_some_and(|spare| self.storage.rename(&spare, &path).is_ok());
        let file = if recycled {
            self.storage.open(&path)
        } else {
            self.storage.create_new(&path)
        }
        .map_err(|e| StoreError::io(&path, e))?;
        self.buf
            .extend_from_slice(&record::segment_header(base_seq));
        self.segments.push_back(Segment {
            id,
            path,
            file,
            len: record::SEGMENT_HEADER_LEN,
            written: 0,
            durable: 0,
            live: 0,
            live_bytes: 0,
        });
        self.disk_bytes += record::SEGMENT_HEADER_LEN;
        self.dir_dirty = true;
        Ok(())
    }

    fn active(&mut self) -> &mut Segment {
        // `open` always leaves at least one segment.
        let last = self.segments.len() - 1;
        &mut self.segments[last]
    }

    /// Writes the buffer handed to a sync job that has not run yet, if any.
    fn settle_deferred(&mut self) -> Result<(), StoreError> {
        write_deferred(&*self.storage, &self.sealed, &self.deferred)
            .inspect_err(|_| self.poisoned = true)
    }

    /// Writes the buffer to the active segment file (the sealed segments
    /// synced first, if no sync job has yet).
    fn write_out(&mut self) -> Result<(), StoreError> {
        self.settle_deferred()?;
        sync_sealed(&*self.storage, &self.sealed).inspect_err(|_| self.poisoned = true)?;
        self.sealed_pending = false;
        if self.buf.is_empty() {
            return Ok(());
        }
        // The end mark goes out with the data and is overwritten by the next
        // write: recovery tells the clean end of the log from a torn write (or
        // from the stale tail of a recycled file).
        self.buf.extend_from_slice(&END_MARK);
        let buf = std::mem::take(&mut self.buf);
        let seg = self.active();
        let res = seg.file.write_at(&buf, seg.written);
        res.map_err(|e| StoreError::io(&seg.path, e))?;
        seg.written += (buf.len() - END_MARK.len()) as u64;
        self.buf = buf;
        self.buf.clear();
        Ok(())
    }

    /// Closes the active segment (written, and sealed for the next sync
    /// job to sync) and starts a new one.
    fn roll(&mut self) -> Result<(), StoreError> {
        self.flush_marks();
        self.write_out()?;
        let (id, path, file) = {
            let s = self.active();
            (s.id, s.path.clone(), Arc::clone(&s.file))
        };
        // A recycled file may be longer: cut its stale tail, so that once
        // synced a sealed segment has no bytes past its records.
        let len = self.active().len;
        file.set_len(len).map_err(|e| StoreError::io(&path, e))?;
        // Its sync is the next writer's: not here, under the caller's lock.
        let dir = std::mem::take(&mut self.dir_dirty).then(|| self.dir.clone());
        self.sealed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Sealed { file, path, dir });
        self.sealed_pending = true;
        self.sealed_by_gen = self.gen_prepared + 1;
        // Not the seq of the record being appended: a compaction copy is old.
        let base = self.appended_seq + 1;
        self.new_segment(id.wrapping_add(1), base)
    }

    fn append(&mut self, record_len: u64) -> Result<(), StoreError> {
        let max = u64::from(record::MAX_RECORD_LEN);
        if record_len > max {
            return Err(StoreError::RecordTooLarge {
                len: record_len,
                max,
            });
        }
        let len = self.active().len;
        if len > record::SEGMENT_HEADER_LEN
            && len + record_len > self.cfg.segment_bytes.min(u64::from(u32::MAX) / 2)
        {
            self.roll()?;
        }
        Ok(())
    }

    /// Appends a publish record; returns where it is.
    pub(crate) fn append_publish(
        &mut self,
        meta: PublishMeta,
        props: &[u8],
        body: &[u8],
    ) -> Result<StoreRef, StoreError> {
        let rec_len = crate::core::record_len(props.len() as u32, body.len() as u32, meta.priority);
        self.append(rec_len)?;
        // While a sealed segment awaits its sync, writing the active one
        // would sync it here, under the caller's lock: buffer instead.
        if body.len() >= LARGE_BODY_BYTES && !self.sealed_pending {
            // Written straight from the caller's buffer, never copied.
            let seed = self.active().id;
            record::encode_publish_head(&mut self.buf, seed, meta, props, body);
            self.write_out()?;
            let seg = self.active();
            let res = seg.file.write_at(body, seg.written);
            res.map_err(|e| StoreError::io(&seg.path, e))?;
            seg.written += body.len() as u64;
            let res = seg.file.write_at(&END_MARK, seg.written);
            res.map_err(|e| StoreError::io(&seg.path, e))?;
        } else {
            let seed = self.active().id;
            record::encode_publish(&mut self.buf, seed, meta, props, body);
        }
        let seg = self.active();
        let store = StoreRef {
            segment: seg.id,
            offset: seg.len as u32,
        };
        seg.len += rec_len;
        seg.live += 1;
        seg.live_bytes += rec_len;
        self.live_bytes += rec_len;
        self.disk_bytes += rec_len;
        self.appended_seq = self.appended_seq.max(meta.seq);
        self.tell_unsynced();
        if self.buf.len() >= WRITE_BUFFER_BYTES && !self.sealed_pending {
            self.write_out()?;
        }
        Ok(store)
    }

    fn flush_marks(&mut self) {
        let seed = self.active().id;
        for delivered in [true, false] {
            let marks = if delivered {
                &mut self.pending_delivered
            } else {
                &mut self.pending_removed
            };
            if marks.is_empty() {
                continue;
            }
            let before = self.buf.len();
            record::encode_seqs(&mut self.buf, seed, delivered, marks);
            marks.clear();
            let added = (self.buf.len() - before) as u64;
            self.active().len += added;
            self.disk_bytes += added;
        }
    }

    fn check_marks(&mut self) -> Result<(), StoreError> {
        if self.pending_removed.len() + self.pending_delivered.len() >= MARKS_BATCH {
            self.append(8 * MARKS_BATCH as u64 + 64)?;
            self.flush_marks();
        }
        Ok(())
    }

    /// Records that a message was delivered (for `redelivered` after recovery).
    pub(crate) fn mark_delivered(&mut self, seq: u64) -> Result<(), StoreError> {
        self.pending_delivered.push(seq);
        self.tell_unsynced();
        self.check_marks()
    }

    /// Records removals and retires head segments that no longer hold live messages.
    pub(crate) fn mark_removed(&mut self, removed: &[Removed]) -> Result<(), StoreError> {
        for r in removed {
            self.pending_removed.push(r.seq);
            if let Ok(i) = self
                .segments
                .binary_search_by_key(&r.store.segment, |s| s.id)
            {
                let s = &mut self.segments[i];
                s.live = s.live.saturating_sub(1);
                s.live_bytes = s.live_bytes.saturating_sub(r.record_len);
            }
            self.live_bytes = self.live_bytes.saturating_sub(r.record_len);
        }
        self.retire_empty_head();
        self.tell_unsynced();
        self.check_marks()
    }

    /// Keeps every segment (and so every record's bytes, live or not) until
    /// unpinned; unpinning retires what became empty meanwhile.
    pub(crate) fn pin(&mut self, on: bool) {
        self.pinned = on;
        if !on {
            self.retire_empty_head();
        }
    }

    fn retire_empty_head(&mut self) {
        if self.pinned {
            return;
        }
        while self.segments.len() > 1 && self.segments.front().is_some_and(|s| s.live == 0) {
            self.retire_front();
        }
    }

    /// Retires the head segment: its live messages must have been copied.
    pub(crate) fn retire_front(&mut self) {
        if self.segments.len() > 1
            && let Some(s) = self.segments.pop_front()
        {
            self.disk_bytes -= s.len;
            self.live_bytes = self.live_bytes.saturating_sub(s.live_bytes);
            self.retired.push(s.path);
            self.tell_unsynced();
        }
    }

    /// The head segment, if the log is worth compacting: the files hold more
    /// than twice the live bytes plus two segments.
    pub(crate) fn compaction_candidate(&self) -> Option<u32> {
        let slack = 2 * self.cfg.segment_bytes;
        (!self.pinned && self.segments.len() > 2 && self.disk_bytes > 2 * self.live_bytes + slack)
            .then(|| self.segments.front().map(|s| s.id))
            .flatten()
    }

    /// Reads a publish record back: props ++ body, and the props length.
    pub(crate) fn read(&mut self, at: StoreRef) -> Result<Bytes, StoreError> {
        self.settle_deferred()?;
        let Ok(i) = self.segments.binary_search_by_key(&at.segment, |s| s.id) else {
            return Err(StoreError::Corrupt {
                file: segment_path(&self.dir, at.segment),
                offset: u64::from(at.offset),
                reason: "segment of a live message is missing".into(),
            });
        };
        if i + 1 == self.segments.len() && u64::from(at.offset) >= self.segments[i].written {
            self.write_out()?;
        }
        let seg = &self.segments[i];
        let corrupt = |reason: String| StoreError::Corrupt {
            file: seg.path.clone(),
            offset: u64::from(at.offset),
            reason,
        };
        let mut header = [0u8; record::RECORD_HEADER_LEN];
        seg.file
            .read_at(&mut header, u64::from(at.offset))
            .map_err(|e| StoreError::io(&seg.path, e))?;
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        if len == 0 || len > record::MAX_RECORD_LEN {
            return Err(corrupt(format!("impossible record length {len}")));
        }
        let mut buf = vec![0u8; record::RECORD_HEADER_LEN + len as usize];
        seg.file
            .read_at(&mut buf, u64::from(at.offset))
            .map_err(|e| StoreError::io(&seg.path, e))?;
        let (_, payload) = record::check(&buf, at.segment).map_err(|e| match e {
            Invalid::Truncated => corrupt("record truncated".into()),
            Invalid::Bad(r) => corrupt(r),
        })?;
        let Ok(Record::Publish { meta, .. }) = record::decode(payload) else {
            return Err(corrupt("not a publish record".into()));
        };
        let skip = record::publish_overhead(meta.priority) as usize;
        Ok(Bytes::from(buf).slice(skip..))
    }

    /// Starts a group commit covering everything appended so far.
    pub(crate) fn prepare_sync(&mut self) -> Result<SyncJob, StoreError> {
        if self.poisoned {
            return Err(StoreError::Poisoned);
        }
        self.flush_marks();
        // The buffer is written by the job, off the caller's lock.
        self.settle_deferred()?;
        // Written straight to the file since the last job (a full buffer, a
        // large body): only a sync of the file makes those bytes durable.
        let journalable = self.active().written == self.active().durable;
        let deferred = if self.buf.is_empty() {
            None
        } else {
            self.buf.extend_from_slice(&END_MARK);
            // The next round's buffer starts at this one's size: no regrowth.
            let next = Vec::with_capacity(self.buf.len());
            let data = std::mem::replace(&mut self.buf, next);
            let seg = self.active();
            let write = DeferredWrite {
                file: Arc::clone(&seg.file),
                path: seg.path.clone(),
                offset: seg.written,
                data,
                written: false,
            };
            seg.written += (write.data.len() - END_MARK.len()) as u64;
            // A slot of its own: the job journals exactly its bytes.
            self.deferred = Arc::new(Mutex::new(Some(write)));
            Some(Arc::clone(&self.deferred))
        };
        let seg = self.active();
        seg.durable = seg.written;
        let file = Some((Arc::clone(&seg.file), seg.path.clone()));
        let dir = std::mem::take(&mut self.dir_dirty).then(|| self.dir.clone());
        let mut retired = Vec::with_capacity(self.retired.len());
        for path in std::mem::take(&mut self.retired) {
            let spare = (self.spares.len() + self.spares_in_flight < MAX_SPARES)
                .then(|| path.with_extension("spare"));
            self.spares_in_flight += usize::from(spare.is_some());
            retired.push((path, spare));
        }
        self.gen_prepared += 1;
        Ok(SyncJob {
            log: self.id,
            generation: self.gen_prepared,
            storage: Arc::clone(&self.storage),
            deferred,
            sealed: Arc::clone(&self.sealed),
            file,
            journalable,
            dir,
            up_to: self.appended_seq,
            retired,
            ran: false,
        })
    }

    /// Finishes a group commit that has run; returns the new synced watermark.
    /// A job of another log (one this log replaced while the job ran, the
    /// same directory reopened) is none of its business: nothing changes.
    pub(crate) fn complete_sync(&mut self, job: &SyncJob) -> Result<u64, StoreError> {
        if job.log != self.id {
            return Ok(self.synced_seq);
        }
        let expected = self.gen_completed + 1;
        if self.poisoned {
            return Err(StoreError::Poisoned);
        }
        if job.generation != expected || !job.ran {
            self.poisoned = true;
            return Err(StoreError::SyncOutOfOrder {
                expected,
                got: job.generation,
            });
        }
        self.gen_completed = job.generation;
        if job.generation >= self.sealed_by_gen {
            // Its `write` synced every segment sealed before it was prepared.
            self.sealed_pending = false;
        }
        for spare in job.retired.iter().filter_map(|(_, s)| s.clone()) {
            self.spares.push(spare);
            self.spares_in_flight -= 1;
        }
        self.synced_seq = self.synced_seq.max(job.up_to);
        Ok(self.synced_seq)
    }

    /// Every logged publish with seq ≤ this is durable.
    pub(crate) fn synced_seq(&self) -> u64 {
        self.synced_seq
    }

    /// Whether a publish was appended since the last sync was prepared
    /// (someone may wait for it to be durable).
    pub(crate) fn has_unsynced_publishes(&self) -> bool {
        self.synced_seq < self.appended_seq
    }

    /// Whether anything was appended since the last sync was prepared.
    pub(crate) fn has_unsynced(&self) -> bool {
        self.synced_seq < self.appended_seq
            || !self.buf.is_empty()
            || !self.pending_removed.is_empty()
            || !self.pending_delivered.is_empty()
            || !self.retired.is_empty()
    }

    /// Calls `hook` whenever the log gets something to sync while armed
    /// (it is armed now, and called at once if the log has something).
    pub(crate) fn on_unsynced(&mut self, hook: UnsyncedHook) {
        self.unsynced_hook = Some(Hook(hook));
        self.arm_unsynced();
    }

    /// Arms the hook again (its owner took the call): it is called at once
    /// if the log still has something to sync. Returns whether it was.
    pub(crate) fn arm_unsynced(&mut self) -> bool {
        self.told = false;
        self.tell_unsynced()
    }

    /// Calls the hook, once until armed again, if there is something to
    /// sync. Every change that leaves something to sync ends with it.
    pub(crate) fn tell_unsynced(&mut self) -> bool {
        if self.told || !self.has_unsynced() {
            return false;
        }
        let Some(hook) = &self.unsynced_hook else {
            return false;
        };
        self.told = true;
        (hook.0)();
        true
    }

    /// Bytes in the segment files (after pending deletions).
    pub(crate) fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }
}

/// Whether any of the segments `ids` in `dir` holds a valid record (a
/// segment that cannot be read counts as holding one).
fn holds_records(storage: &dyn Storage, dir: &Path, ids: &[u32]) -> bool {
    ids.iter()
        .any(|&id| match storage.read(&segment_path(dir, id)) {
            Ok(data) => {
                let from = (record::SEGMENT_HEADER_LEN as usize).min(data.len());
                next_valid(&data, from, id).is_some()
            }
            Err(_) => true,
        })
}

/// A header cut short by a crash right after the segment was created.
fn is_torn_header(data: &[u8]) -> bool {
    record::MAGIC.starts_with(&data[..data.len().min(8)])
}

/// The offset of the next valid record at or after `from`, if any.
fn next_valid(data: &[u8], from: usize, seed: u32) -> Option<usize> {
    (from..data.len().saturating_sub(record::RECORD_HEADER_LEN)).find(|&p| {
        record::check(&data[p..], seed)
            .ok()
            .is_some_and(|(_, payload)| record::decode(payload).is_ok())
    })
}

fn apply_record(
    segment: &Bytes,
    found: &mut BTreeMap<u64, Entry>,
    max_seq: &mut u64,
    resident: &mut u64,
    cfg: &StoreConfig,
    rec: Record<'_>,
    store: StoreRef,
) {
    match rec {
        Record::Publish { meta, .. } if meta.transient => {
            *max_seq = (*max_seq).max(meta.seq);
        }
        Record::Publish { meta, props, body } => {
            *max_seq = (*max_seq).max(meta.seq);
            *resident = resident.saturating_add(body.len() as u64);
            let keep = *resident <= cfg.resident_bytes_max;
            let data = keep.then(|| {
                if body.len() >= LARGE_BODY_BYTES {
                    // Props and body are adjacent in the segment: share it.
                    let start = props.as_ptr() as usize - segment.as_ptr() as usize;
                    segment.slice(start..start + props.len() + body.len())
                } else {
                    let mut v = Vec::with_capacity(props.len() + body.len());
                    v.extend_from_slice(props);
                    v.extend_from_slice(body);
                    Bytes::from(v)
                }
            });
            // A later copy (compaction) replaces an earlier one.
            let was_delivered = found.get(&meta.seq).is_some_and(Entry::delivered);
            let mut entry =
                Entry::restored(meta, props.len() as u32, body.len() as u32, data, store);
            entry.set_delivered(meta.delivered || was_delivered);
            found.insert(meta.seq, entry);
        }
        Record::Remove(seqs) => {
            for s in seqs {
                *max_seq = (*max_seq).max(s);
                found.remove(&s);
            }
        }
        Record::Delivered(seqs) => {
            for s in seqs {
                if let Some(f) = found.get_mut(&s) {
                    f.set_delivered(true);
                }
            }
        }
    }
}
