//! The Raft log and the state machine, on disk in the node's data directory.
//!
//! Layout of `<data_dir>/raft/`:
//!
//! - `log`: the log, an append-only file of records `[len: u32 BE][crc32c: u32 BE][postcard entry]`.
//!   Appends are fsynced before openraft is told they are durable. A torn or
//!   corrupt tail (a crash mid-append) is cut off at the first bad record on load.
//! - `vote`, `purged`: one small record each, replaced atomically and durably
//!   (write a temporary file, fsync, rename, fsync the directory).
//! - `committed`: the commit index, a hint for how far to re-apply the log at
//!   start; replaced by rename without fsync (a stale or damaged one only
//!   means re-applying less until the leader says more).
//! - `snapshot`: the latest snapshot (meta + the serialised [`Metadata`]),
//!   replaced atomically. The state machine itself lives in memory and is
//!   rebuilt at start from the snapshot plus the committed log.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Cursor, Read, Write};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine};
use openraft::{
    AnyError, EntryPayload, ErrorSubject, ErrorVerb, LogState, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, Snapshot, StorageIOError,
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::state::{CommandResponse, Metadata};
use crate::types::{
    Entry, LogId, NodeId, SnapshotMeta, StorageError, StoredMembership, TypeConfig, Vote,
};

const LOG_FILE: &str = "log";
const VOTE_FILE: &str = "vote";
const COMMITTED_FILE: &str = "committed";
const PURGED_FILE: &str = "purged";
const SNAPSHOT_FILE: &str = "snapshot";

fn io_err(verb: ErrorVerb, subject: ErrorSubject<NodeId>, e: impl Into<AnyError>) -> StorageError {
    StorageError::IO {
        source: StorageIOError::new(subject, verb, e),
    }
}

fn any(e: &io::Error) -> AnyError {
    AnyError::new(e)
}

/// The Raft directory inside a data directory.
pub(crate) fn raft_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("raft")
}

fn encode_record<T: Serialize>(value: &T) -> io::Result<Vec<u8>> {
    let body = postcard::to_stdvec(value).map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(body.len() + 8);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&crc32c::crc32c(&body).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes the record at the start of `buf`: `Ok(None)` for a torn or corrupt record.
fn decode_record<T: DeserializeOwned>(buf: &[u8]) -> Option<(T, usize)> {
    if buf.len() < 8 {
        return None;
    }
    let len = u32::from_be_bytes(buf[0..4].try_into().ok()?) as usize;
    let crc = u32::from_be_bytes(buf[4..8].try_into().ok()?);
    let body = buf.get(8..8 + len)?;
    if crc32c::crc32c(body) != crc {
        return None;
    }
    let value = postcard::from_bytes(body).ok()?;
    Some((value, 8 + len))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Replaces `dir/name` atomically and durably with one record holding `value`.
pub(crate) fn write_atomic<T: Serialize>(dir: &Path, name: &str, value: &T) -> io::Result<()> {
    let tmp = unique_tmp(dir, name);
    let mut f = File::create(&tmp)?;
    f.write_all(&encode_record(value)?)?;
    f.sync_all()?;
    drop(f);
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// A temporary file for replacing `dir/name` that no other writer uses: two
/// writers of one file (a snapshot installed while another is built, or a
/// stopped node's last write finishing as it starts again) never rename
/// each other's temporary file away.
fn unique_tmp(dir: &Path, name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!("{name}.{}-{n}.tmp", std::process::id()))
}

/// Replaces `dir/name` with one record holding `value`, without fsync: for
/// hints whose loss or corruption in a crash is harmless (read them with
/// [`read_hint`]).
fn write_hint<T: Serialize>(dir: &Path, name: &str, value: &T) -> io::Result<()> {
    let tmp = unique_tmp(dir, name);
    fs::write(&tmp, encode_record(value)?)?;
    fs::rename(&tmp, dir.join(name))
}

/// Reads a hint written by [`write_hint`]: `None` if absent or damaged.
fn read_hint<T: DeserializeOwned>(dir: &Path, name: &str) -> Option<T> {
    let buf = fs::read(dir.join(name)).ok()?;
    decode_record(&buf).map(|(v, _)| v)
}

/// Reads a file written by [`write_atomic`]; `Ok(None)` if absent.
pub(crate) fn read_atomic<T: DeserializeOwned>(dir: &Path, name: &str) -> io::Result<Option<T>> {
    let mut buf = Vec::new();
    match File::open(dir.join(name)) {
        Ok(mut f) => f.read_to_end(&mut buf)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    match decode_record(&buf) {
        Some((v, _)) => Ok(Some(v)),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is corrupt", dir.join(name).display()),
        )),
    }
}

/// Everything the log directory holds, read at once (also used offline).
#[derive(Debug, Default)]
pub(crate) struct LogFiles {
    pub(crate) vote: Option<Vote>,
    pub(crate) committed: Option<LogId>,
    pub(crate) purged: Option<LogId>,
    /// Entries after `purged`, with the file offset where each record starts.
    pub(crate) entries: BTreeMap<u64, (Entry, u64)>,
    /// Where the valid part of the log file ends.
    pub(crate) end: u64,
}

impl LogFiles {
    pub(crate) fn load(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let vote = read_atomic(dir, VOTE_FILE)?;
        // The commit index is only a hint (how far to re-apply at start):
        // Raft learns it again from the leader, so it is not fsynced.
        let committed: Option<LogId> = read_hint::<Option<LogId>>(dir, COMMITTED_FILE).flatten();
        let purged: Option<LogId> = read_atomic(dir, PURGED_FILE)?;
        let mut buf = Vec::new();
        if let Ok(mut f) = File::open(dir.join(LOG_FILE)) {
            f.read_to_end(&mut buf)?;
        }
        let mut entries = BTreeMap::new();
        let mut pos = 0usize;
        while pos < buf.len() {
            let Some((entry, used)) = decode_record::<Entry>(&buf[pos..]) else {
                tracing::warn!(
                    offset = pos,
                    len = buf.len(),
                    "raft log has a torn or corrupt tail; cutting it off"
                );
                break;
            };
            let index = entry.log_id.index;
            if purged.is_none_or(|p| index > p.index) {
                // A later record for an index supersedes a truncated one.
                entries.split_off(&index);
                entries.insert(index, (entry, pos as u64));
            }
            pos += used;
        }
        tracing::debug!(
            dir = %dir.display(),
            entries = entries.len(),
            last = entries.last_key_value().map(|(i, _)| *i),
            ?committed,
            "loaded raft log"
        );
        Ok(Self {
            vote,
            committed,
            purged,
            entries,
            end: pos as u64,
        })
    }
}

/// The log file and where each record starts: touched only by the writer
/// (openraft's core, one call at a time), on a blocking thread.
struct LogIo {
    file: File,
    end: u64,
    offsets: BTreeMap<u64, u64>,
}

/// What readers see: the entries and the small records, in memory.
#[derive(Default)]
struct LogMem {
    entries: BTreeMap<u64, Entry>,
    vote: Option<Vote>,
    committed: Option<LogId>,
    purged: Option<LogId>,
}

struct LogShared {
    dir: PathBuf,
    io: Mutex<LogIo>,
    mem: RwLock<LogMem>,
}

impl LogShared {
    fn io(&self) -> MutexGuard<'_, LogIo> {
        self.io.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mem(&self) -> std::sync::RwLockReadGuard<'_, LogMem> {
        self.mem.read().unwrap_or_else(|e| e.into_inner())
    }

    fn mem_mut(&self) -> std::sync::RwLockWriteGuard<'_, LogMem> {
        self.mem.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends entries durably (fsync) and makes them readable. An entry at
    /// an index already present replaces it and everything after it.
    fn append_sync(&self, entries: Vec<Entry>) -> io::Result<()> {
        let Some(first) = entries.first().map(|e| e.log_id.index) else {
            return Ok(());
        };
        {
            let mut io = self.io();
            if let Some(&offset) = io.offsets.get(&first) {
                io.file.set_len(offset)?;
                io.end = offset;
                io.offsets.split_off(&first);
            }
            let mut buf = Vec::new();
            let mut placed = Vec::with_capacity(entries.len());
            for entry in &entries {
                placed.push((entry.log_id.index, io.end + buf.len() as u64));
                buf.extend_from_slice(&encode_record(entry)?);
            }
            io.file.write_all(&buf)?;
            io.file.sync_data()?;
            tracing::trace!(
                first,
                count = placed.len(),
                at = io.end,
                "appended raft log entries"
            );
            io.end += buf.len() as u64;
            io.offsets.extend(placed);
        }
        let mut mem = self.mem_mut();
        mem.entries.split_off(&first);
        mem.entries
            .extend(entries.into_iter().map(|e| (e.log_id.index, e)));
        Ok(())
    }

    /// Deletes the entries from `index` on.
    fn truncate_sync(&self, index: u64) -> io::Result<()> {
        {
            let mut io = self.io();
            if let Some(&offset) = io.offsets.get(&index) {
                io.file.set_len(offset)?;
                io.file.sync_all()?;
                io.end = offset;
                io.offsets.split_off(&index);
            }
        }
        self.mem_mut().entries.split_off(&index);
        Ok(())
    }

    /// Forgets the entries up to `log_id` (they are in a snapshot) and
    /// rewrites the log file with the rest.
    fn purge_sync(&self, log_id: LogId) -> io::Result<()> {
        let mut io = self.io();
        write_atomic(&self.dir, PURGED_FILE, &log_id)?;
        let kept: Vec<Entry> = {
            let mut mem = self.mem_mut();
            mem.purged = Some(log_id);
            let keep = mem.entries.split_off(&(log_id.index + 1));
            mem.entries = keep;
            mem.entries.values().cloned().collect()
        };
        let tmp = unique_tmp(&self.dir, LOG_FILE);
        let mut buf = Vec::new();
        let mut offsets = BTreeMap::new();
        for entry in &kept {
            offsets.insert(entry.log_id.index, buf.len() as u64);
            buf.extend_from_slice(&encode_record(entry)?);
        }
        let mut f = File::create(&tmp)?;
        f.write_all(&buf)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, self.dir.join(LOG_FILE))?;
        sync_dir(&self.dir)?;
        io.file = OpenOptions::new()
            .append(true)
            .open(self.dir.join(LOG_FILE))?;
        io.end = buf.len() as u64;
        io.offsets = offsets;
        Ok(())
    }
}

/// The on-disk Raft log (openraft's `RaftLogStorage`); cheap to clone.
///
/// Reads come from memory; writes (fsync) run on a blocking thread, so a
/// slow disk never stalls the async runtime.
#[derive(Clone)]
pub(crate) struct LogStore {
    shared: Arc<LogShared>,
}

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("dir", &self.shared.dir)
            .finish_non_exhaustive()
    }
}

impl LogStore {
    /// Opens (or creates) the log in `dir`, cutting off a torn tail.
    pub(crate) fn open(dir: &Path) -> io::Result<Self> {
        let files = LogFiles::load(dir)?;
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(LOG_FILE))?;
        if file.metadata()?.len() != files.end {
            file.set_len(files.end)?;
            file.sync_all()?;
        }
        let offsets = files.entries.iter().map(|(i, (_, o))| (*i, *o)).collect();
        let entries = files
            .entries
            .into_iter()
            .map(|(i, (e, _))| (i, e))
            .collect();
        Ok(Self {
            shared: Arc::new(LogShared {
                dir: dir.to_owned(),
                io: Mutex::new(LogIo {
                    file,
                    end: files.end,
                    offsets,
                }),
                mem: RwLock::new(LogMem {
                    entries,
                    vote: files.vote,
                    committed: files.committed,
                    purged: files.purged,
                }),
            }),
        })
    }

    /// Whether any vote or entry was ever stored (the node has Raft state).
    pub(crate) fn has_state(&self) -> bool {
        let m = self.shared.mem();
        m.vote.is_some() || !m.entries.is_empty() || m.purged.is_some()
    }

    /// Runs a storage write on a blocking thread.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&LogShared) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || f(&shared))
            .await
            .map_err(io::Error::other)?
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(self
            .shared
            .mem()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let m = self.shared.mem();
        let last = m
            .entries
            .last_key_value()
            .map(|(_, e)| e.log_id)
            .or(m.purged);
        Ok(LogState {
            last_purged_log_id: m.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        let v = *vote;
        self.blocking(move |s| write_atomic(&s.dir, VOTE_FILE, &v))
            .await
            .map_err(|e| io_err(ErrorVerb::Write, ErrorSubject::Vote, any(&e)))?;
        self.shared.mem_mut().vote = Some(v);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        Ok(self.shared.mem().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.blocking(move |s| write_hint(&s.dir, COMMITTED_FILE, &committed))
            .await
            .map_err(|e| io_err(ErrorVerb::Write, ErrorSubject::Store, any(&e)))?;
        self.shared.mem_mut().committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.shared.mem().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        match self.blocking(move |s| s.append_sync(entries)).await {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let err = io_err(ErrorVerb::Write, ErrorSubject::Logs, any(&e));
                callback.log_io_completed(Err(e));
                Err(err)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "truncating raft log");
        self.blocking(move |s| s.truncate_sync(log_id.index))
            .await
            .map_err(|e| io_err(ErrorVerb::Delete, ErrorSubject::Logs, any(&e)))
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.blocking(move |s| s.purge_sync(log_id))
            .await
            .map_err(|e| io_err(ErrorVerb::Delete, ErrorSubject::Logs, any(&e)))
    }
}

/// A snapshot as stored on disk and sent to peers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StoredSnapshot {
    pub(crate) meta: SnapshotMeta,
    /// postcard of [`SnapshotState`].
    pub(crate) data: Vec<u8>,
}

/// The state machine's content as a snapshot carries it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SnapshotState {
    pub(crate) last_applied: Option<LogId>,
    pub(crate) membership: StoredMembership,
    pub(crate) metadata: Metadata,
}

/// The state machine's live state, shared with the [`Cluster`](crate::Cluster) for local reads.
#[derive(Debug, Default)]
pub(crate) struct SmState {
    pub(crate) last_applied: Option<LogId>,
    pub(crate) membership: StoredMembership,
    pub(crate) metadata: Arc<Metadata>,
}

/// Applies one entry to a state machine state.
pub(crate) fn apply_entry(st: &mut SmState, entry: &Entry) -> CommandResponse {
    st.last_applied = Some(entry.log_id);
    match &entry.payload {
        EntryPayload::Blank => CommandResponse::default(),
        EntryPayload::Normal(cmd) => Arc::make_mut(&mut st.metadata).apply(cmd),
        EntryPayload::Membership(m) => {
            st.membership = StoredMembership::new(Some(entry.log_id), m.clone());
            let members = m
                .nodes()
                .map(|(_, n)| (n.name.clone(), n.addr.clone()))
                .collect();
            Arc::make_mut(&mut st.metadata).apply_membership(entry.log_id.index, &members);
            CommandResponse::default()
        }
    }
}

/// The state machine (openraft's `RaftStateMachine`); cheap to clone.
#[derive(Clone)]
pub(crate) struct StateMachine {
    dir: PathBuf,
    pub(crate) state: Arc<RwLock<SmState>>,
    current: Arc<Mutex<Option<StoredSnapshot>>>,
    changed: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for StateMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMachine")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl StateMachine {
    /// Opens the state machine: the stored snapshot, if any.
    pub(crate) fn open(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let snap: Option<StoredSnapshot> = read_atomic(dir, SNAPSHOT_FILE)?;
        let mut state = SmState::default();
        if let Some(s) = &snap {
            let content: SnapshotState = postcard::from_bytes(&s.data).map_err(io::Error::other)?;
            state.last_applied = content.last_applied;
            state.membership = content.membership;
            state.metadata = Arc::new(content.metadata);
        }
        let (changed, _) = tokio::sync::watch::channel(0);
        Ok(Self {
            dir: dir.to_owned(),
            state: Arc::new(RwLock::new(state)),
            current: Arc::new(Mutex::new(snap)),
            changed,
        })
    }

    /// A receiver that sees a new value after every applied batch.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub(crate) fn read(&self) -> std::sync::RwLockReadGuard<'_, SmState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, SmState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    fn snap(&self) -> MutexGuard<'_, Option<StoredSnapshot>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[allow(clippy::result_large_err)] // openraft's own error type
    fn install(&self, snap: StoredSnapshot) -> Result<(), StorageError> {
        let content: SnapshotState = postcard::from_bytes(&snap.data).map_err(|e| {
            io_err(
                ErrorVerb::Read,
                ErrorSubject::Snapshot(Some(snap.meta.signature())),
                AnyError::error(e.to_string()),
            )
        })?;
        write_atomic(&self.dir, SNAPSHOT_FILE, &snap).map_err(|e| {
            io_err(
                ErrorVerb::Write,
                ErrorSubject::Snapshot(Some(snap.meta.signature())),
                any(&e),
            )
        })?;
        {
            let mut st = self.write();
            st.last_applied = content.last_applied;
            st.membership = content.membership;
            st.metadata = Arc::new(content.metadata);
        }
        *self.snap() = Some(snap);
        self.changed.send_modify(|v| *v += 1);
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let (content, last_applied, membership) = {
            let st = self.read();
            (
                SnapshotState {
                    last_applied: st.last_applied,
                    membership: st.membership.clone(),
                    metadata: (*st.metadata).clone(),
                },
                st.last_applied,
                st.membership.clone(),
            )
        };
        let data = postcard::to_stdvec(&content).map_err(|e| {
            io_err(
                ErrorVerb::Write,
                ErrorSubject::Snapshot(None),
                AnyError::error(e.to_string()),
            )
        })?;
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id, l.index, data.len()),
            None => format!("empty-{}", data.len()),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership: membership,
            snapshot_id,
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: data.clone(),
        };
        write_atomic(&self.dir, SNAPSHOT_FILE, &stored).map_err(|e| {
            io_err(
                ErrorVerb::Write,
                ErrorSubject::Snapshot(Some(meta.signature())),
                any(&e),
            )
        })?;
        *self.snap() = Some(stored);
        tracing::debug!(snapshot = %meta.snapshot_id, "built snapshot");
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let st = self.read();
        Ok((st.last_applied, st.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CommandResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let out: Vec<CommandResponse> = {
            let mut st = self.write();
            entries
                .into_iter()
                .map(|e| apply_entry(&mut st, &e))
                .collect()
        };
        self.changed.send_modify(|v| *v += 1);
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        tracing::info!(snapshot = %meta.snapshot_id, "installing snapshot from the leader");
        self.install(StoredSnapshot {
            meta: meta.clone(),
            data: snapshot.into_inner(),
        })
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        Ok(self.snap().clone().map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}

/// Writes a whole new state (snapshot + empty log) into a stopped node's Raft
/// directory: used by the offline forget.
pub(crate) fn replace_offline(dir: &Path, snap: &StoredSnapshot, last: LogId) -> io::Result<()> {
    write_atomic(dir, SNAPSHOT_FILE, snap)?;
    write_atomic(dir, PURGED_FILE, &last)?;
    write_atomic(dir, COMMITTED_FILE, &Some(last))?;
    let tmp = dir.join(format!("{LOG_FILE}.tmp"));
    File::create(&tmp)?.sync_all()?;
    fs::rename(&tmp, dir.join(LOG_FILE))?;
    sync_dir(dir)
}

/// Reads the stored snapshot of a (stopped) node's Raft directory.
pub(crate) fn read_snapshot(dir: &Path) -> io::Result<Option<StoredSnapshot>> {
    read_atomic(dir, SNAPSHOT_FILE)
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, Entry as RaftEntry};

    use super::*;
    use crate::state::Command;

    fn entry(term: u64, index: u64) -> Entry {
        RaftEntry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(Command::PutVhost {
                name: format!("v{index}"),
            }),
        }
    }

    fn indexes(dir: &Path) -> Vec<(u64, u64)> {
        LogFiles::load(dir)
            .unwrap()
            .entries
            .values()
            .map(|(e, _)| (e.log_id.leader_id.term, e.log_id.index))
            .collect()
    }

    #[test]
    fn appends_truncates_purges_and_survives_reopening() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = LogStore::open(dir).unwrap();
        let s = &log.shared;
        s.append_sync((1..=7).map(|i| entry(1, i)).collect())
            .unwrap();
        s.truncate_sync(6).unwrap();
        // A new leader overwrites 4.. (an append over existing entries).
        s.append_sync((4..=5).map(|i| entry(2, i)).collect())
            .unwrap();
        drop(log);
        assert_eq!(indexes(dir), vec![(1, 1), (1, 2), (1, 3), (2, 4), (2, 5)]);
        let log = LogStore::open(dir).unwrap();
        let purged = log.shared.mem().entries[&2].log_id;
        log.shared.purge_sync(purged).unwrap();
        log.shared.append_sync(vec![entry(2, 6)]).unwrap();
        drop(log);
        assert_eq!(indexes(dir), vec![(1, 3), (2, 4), (2, 5), (2, 6)]);
        assert_eq!(LogFiles::load(dir).unwrap().purged.unwrap().index, 2);
    }

    #[test]
    fn a_torn_tail_is_cut_off_and_appends_continue_after_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = LogStore::open(dir).unwrap();
        log.shared
            .append_sync((1..=3).map(|i| entry(1, i)).collect())
            .unwrap();
        drop(log);
        // A crash in the middle of an append: half a record, then garbage.
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.join(LOG_FILE))
            .unwrap();
        let rec = encode_record(&entry(1, 4)).unwrap();
        f.write_all(&rec[..rec.len() / 2]).unwrap();
        drop(f);
        let log = LogStore::open(dir).unwrap();
        assert_eq!(indexes(dir), vec![(1, 1), (1, 2), (1, 3)]);
        log.shared.append_sync(vec![entry(1, 4)]).unwrap();
        drop(log);
        assert_eq!(indexes(dir), vec![(1, 1), (1, 2), (1, 3), (1, 4)]);

        // A flipped bit in the last record is caught by its CRC.
        let path = dir.join(LOG_FILE);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        fs::write(&path, bytes).unwrap();
        assert_eq!(indexes(dir), vec![(1, 1), (1, 2), (1, 3)]);
    }

    #[test]
    fn vote_and_committed_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let vote = Vote::new(3, 7);
        write_atomic(tmp.path(), VOTE_FILE, &vote).unwrap();
        let committed = Some(LogId::new(CommittedLeaderId::new(3, 7), 42));
        write_atomic(tmp.path(), COMMITTED_FILE, &committed).unwrap();
        let files = LogFiles::load(tmp.path()).unwrap();
        assert_eq!(files.vote, Some(vote));
        assert_eq!(files.committed, committed);
    }
}

/// openraft's own storage suite (`openraft::testing::Suite`, about 45
/// checks of `RaftLogStorage` and `RaftStateMachine`) on Warren's log and
/// state machine, each build in a fresh directory.
#[cfg(test)]
mod openraft_suite {
    use openraft::testing::{StoreBuilder, Suite};
    use tempfile::TempDir;

    use super::*;

    struct Builder;

    impl StoreBuilder<TypeConfig, LogStore, StateMachine, TempDir> for Builder {
        async fn build(&self) -> Result<(TempDir, LogStore, StateMachine), StorageError> {
            let tmp = tempfile::tempdir().expect("a temporary directory");
            let log = LogStore::open(tmp.path()).expect("the log opens");
            let sm = StateMachine::open(tmp.path()).expect("the state machine opens");
            Ok((tmp, log, sm))
        }
    }

    #[test]
    fn warrens_store_passes_openraft_storage_suite() {
        Suite::test_all(Builder).expect("openraft's storage suite");
    }
}
