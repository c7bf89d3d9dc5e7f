//! The node's journal: a group commit of many queues' logs made durable by
//! one sequential append and one `fdatasync`, instead of a sync of every
//! log (or a `syncfs` of the whole file system, which also writes back
//! every other process's dirty pages).
//!
//! A record names a file, an offset and the bytes just written there, so
//! that opening the journal after a crash can write them again. The bytes a
//! log writes at an offset never change afterwards (the end mark it writes
//! behind them is left out of the record), so replaying an old record over
//! a file that also holds later, directly synced writes changes nothing that
//! is durable. Rules:
//!
//! - A record stands for a file's sync only if the file holds nothing
//!   unsynced outside it (the log decides: [`SyncJob`](crate::SyncJob)'s
//!   `journalable`).
//! - A file that no longer exists at replay is skipped: its segment was
//!   retired (renamed or removed after its removals were durable), or its
//!   creation never became durable, and no confirm waited on such a file
//!   without a directory sync.
//! - A removed directory ([`Journal::forget_dir`], before a deleted queue's
//!   files go) drops the earlier records of files under it, so that a queue
//!   declared again under the same directory never receives the old one's
//!   bytes.
//! - Past [`CHECKPOINT_BYTES`] the journal syncs every file it covers and
//!   starts a new journal file; replay ([`Journal::open`]) does the same.
//!
//! Record format: `len: u32 LE`, `crc32c(payload): u32 LE`, then `payload`:
//! `kind: u8` (1 write, 2 forget a directory), `path_len: u16 LE`, the path's
//! bytes, and for a write `offset: u64 LE` and the data. A record that does
//! not check is the torn end of the journal.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Bound;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::StoreError;
use crate::storage::{Storage, StorageFile};

/// Journal bytes past which the files it covers are synced and a new
/// journal file begins.
pub const CHECKPOINT_BYTES: u64 = 32 << 20;

const KIND_WRITE: u8 = 1;
const KIND_FORGET: u8 = 2;
const RECORD_HEADER: usize = 8;

/// One write a group commit makes durable through the journal.
#[derive(Debug)]
pub(crate) struct JournalWrite<'a> {
    pub(crate) path: &'a Path,
    pub(crate) file: &'a Arc<dyn StorageFile>,
    pub(crate) offset: u64,
    pub(crate) data: &'a [u8],
}

/// What opening a journal did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JournalReport {
    /// Writes replayed into their files.
    pub replayed: u64,
    /// Writes skipped: their file is gone, or its directory was removed
    /// after them.
    pub skipped: u64,
    /// A torn record cut off the journal's end.
    pub torn: bool,
}

/// A node's journal of group commits (see the module documentation).
#[derive(Debug)]
pub struct Journal {
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    /// Journal bytes past which it checkpoints.
    checkpoint_bytes: u64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    file: Arc<dyn StorageFile>,
    path: PathBuf,
    number: u64,
    len: u64,
    /// The files with records in this journal file: synced at a checkpoint.
    /// Ordered, so that a directory's files are found without looking at
    /// every queue's.
    covered: BTreeMap<PathBuf, Arc<dyn StorageFile>>,
}

fn journal_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:020}.jnl"))
}

fn journal_number(path: &Path) -> Option<u64> {
    if path.extension()? != "jnl" {
        return None;
    }
    path.file_stem()?.to_str()?.parse().ok()
}

fn encode(buf: &mut Vec<u8>, kind: u8, path: &Path, offset: u64, data: &[u8]) {
    let path = path.as_os_str().as_bytes();
    let start = buf.len();
    buf.extend_from_slice(&[0; RECORD_HEADER]);
    buf.push(kind);
    let path_len = u16::try_from(path.len()).unwrap_or(u16::MAX);
    buf.extend_from_slice(&path_len.to_le_bytes());
    buf.extend_from_slice(&path[..usize::from(path_len)]);
    if kind == KIND_WRITE {
        buf.extend_from_slice(&offset.to_le_bytes());
        buf.extend_from_slice(data);
    }
    let payload_len = (buf.len() - start - RECORD_HEADER) as u32;
    let crc = crc32c::crc32c(&buf[start + RECORD_HEADER..]);
    buf[start..start + 4].copy_from_slice(&payload_len.to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// A record read back.
enum Rec {
    Write {
        path: PathBuf,
        offset: u64,
        data: Vec<u8>,
    },
    Forget(PathBuf),
}

/// The records of one journal file, up to its first torn one; and whether
/// there was one.
fn decode_all(data: &[u8]) -> (Vec<Rec>, bool) {
    let mut recs = Vec::new();
    let mut pos = 0;
    while pos < data.len() {
        let Some(rec) = decode_one(&data[pos..]) else {
            // Zeros past the end are a preallocated or never-written tail,
            // not a torn record.
            return (recs, data[pos..].iter().any(|&b| b != 0));
        };
        pos += rec.0;
        recs.push(rec.1);
    }
    (recs, false)
}

fn decode_one(data: &[u8]) -> Option<(usize, Rec)> {
    let header = data.get(..RECORD_HEADER)?;
    let len = u32::from_le_bytes(header[..4].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[4..8].try_into().ok()?);
    let payload = data.get(RECORD_HEADER..RECORD_HEADER + len)?;
    if len < 3 || crc32c::crc32c(payload) != crc {
        return None;
    }
    let kind = payload[0];
    let path_len = usize::from(u16::from_le_bytes([payload[1], payload[2]]));
    let path_bytes = payload.get(3..3 + path_len)?;
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(path_bytes));
    let rest = &payload[3 + path_len..];
    let rec = match kind {
        KIND_WRITE => Rec::Write {
            path,
            offset: u64::from_le_bytes(rest.get(..8)?.try_into().ok()?),
            data: rest[8..].to_vec(),
        },
        KIND_FORGET => Rec::Forget(path),
        _ => return None,
    };
    Some((RECORD_HEADER + len, rec))
}

/// Removes a queue log's directory `dir`, forgetting it in `journal` first
/// ([`Journal::forget_dir`]): the one way a log's directory may go while a
/// journal may cover it. A directory already gone is no error.
pub fn remove_log_dir(
    storage: &dyn Storage,
    journal: Option<&Journal>,
    dir: &Path,
) -> Result<(), StoreError> {
    if let Some(journal) = journal {
        journal.forget_dir(dir)?;
    }
    match storage.remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::io(dir, e)),
        _ => Ok(()),
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Journal {
    /// Opens the journal in `dir` (creating it if needed): replays what an
    /// earlier run left into the files it names, syncs them, and starts an
    /// empty journal file. Call it before opening any log it covers.
    pub fn open(
        storage: Arc<dyn Storage>,
        dir: &Path,
    ) -> Result<(Arc<Journal>, JournalReport), StoreError> {
        Self::open_with_checkpoint(storage, dir, CHECKPOINT_BYTES)
    }

    /// [`open`](Self::open), checkpointing past `checkpoint_bytes`.
    pub fn open_with_checkpoint(
        storage: Arc<dyn Storage>,
        dir: &Path,
        checkpoint_bytes: u64,
    ) -> Result<(Arc<Journal>, JournalReport), StoreError> {
        storage
            .create_dir_all(dir)
            .map_err(|e| StoreError::io(dir, e))?;
        let mut old: Vec<(u64, PathBuf)> = storage
            .list(dir)
            .map_err(|e| StoreError::io(dir, e))?
            .into_iter()
            .filter_map(|p| Some((journal_number(&p)?, p)))
            .collect();
        old.sort();
        let mut report = JournalReport::default();
        let mut recs = Vec::new();
        for (_, path) in &old {
            let data = storage.read(path).map_err(|e| StoreError::io(path, e))?;
            let (mut file_recs, torn) = decode_all(&data);
            if torn {
                tracing::warn!(file = %path.display(), "cutting off the torn end of the journal");
                report.torn = true;
            }
            recs.append(&mut file_recs);
        }
        // A write is dropped if a later record forgets its directory (or
        // one above it): looked up by the write's ancestors, so that a node
        // that deleted 50,000 queues does not compare every write with
        // every forgotten directory.
        let mut forgotten: HashSet<&Path> = HashSet::new();
        let mut keep = vec![true; recs.len()];
        for (i, rec) in recs.iter().enumerate().rev() {
            match rec {
                Rec::Forget(dir) => {
                    forgotten.insert(dir);
                }
                Rec::Write { path, .. } => {
                    keep[i] = !path.ancestors().any(|d| forgotten.contains(d));
                }
            }
        }
        let mut touched: HashMap<&Path, Arc<dyn StorageFile>> = HashMap::new();
        for (rec, keep) in recs.iter().zip(keep) {
            let Rec::Write { path, offset, data } = rec else {
                continue;
            };
            if !keep {
                report.skipped += 1;
                continue;
            }
            let file = match touched.get(path.as_path()) {
                Some(f) => Arc::clone(f),
                None => match storage.open(path) {
                    Ok(f) => {
                        touched.insert(path, Arc::clone(&f));
                        f
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        report.skipped += 1;
                        continue;
                    }
                    Err(e) => return Err(StoreError::io(path, e)),
                },
            };
            file.write_at(data, *offset)
                .map_err(|e| StoreError::io(path, e))?;
            report.replayed += 1;
        }
        let files: Vec<(&Path, Arc<dyn StorageFile>)> = touched.into_iter().collect();
        let handles: Vec<&dyn StorageFile> = files.iter().map(|(_, f)| &**f).collect();
        for ((path, _), res) in files.iter().zip(storage.sync_files(&handles)) {
            res.map_err(|e| StoreError::io(*path, e))?;
        }
        let number = old.last().map_or(1, |(n, _)| n + 1);
        let path = journal_path(dir, number);
        let file = storage
            .create_new(&path)
            .map_err(|e| StoreError::io(&path, e))?;
        storage.sync_dir(dir).map_err(|e| StoreError::io(dir, e))?;
        for (_, p) in &old {
            storage.remove(p).map_err(|e| StoreError::io(p, e))?;
        }
        storage.sync_dir(dir).map_err(|e| StoreError::io(dir, e))?;
        if report.replayed > 0 || report.skipped > 0 {
            tracing::info!(
                replayed = report.replayed,
                skipped = report.skipped,
                "replayed the journal"
            );
        }
        let journal = Journal {
            storage,
            dir: dir.to_path_buf(),
            checkpoint_bytes,
            state: Mutex::new(State {
                file,
                path,
                number,
                len: 0,
                covered: BTreeMap::new(),
            }),
        };
        Ok((Arc::new(journal), report))
    }

    /// The storage the journal and the files it covers live on.
    pub(crate) fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Makes `writes` (already written to their files) durable with one
    /// append and one sync; then checkpoints if the journal is long. A
    /// failure fails these writes only (their logs must be reopened, as
    /// after a failed `fdatasync`): the next append goes to the same place.
    pub(crate) fn commit(&self, writes: &[JournalWrite<'_>]) -> Result<(), StoreError> {
        let mut buf = Vec::with_capacity(writes.iter().map(|w| w.data.len() + 64).sum());
        for w in writes {
            encode(&mut buf, KIND_WRITE, w.path, w.offset, w.data);
        }
        let mut st = lock(&self.state);
        Self::append(&mut st, &buf)?;
        for w in writes {
            if !st.covered.contains_key(w.path) {
                st.covered.insert(w.path.to_path_buf(), Arc::clone(w.file));
            }
        }
        if st.len >= self.checkpoint_bytes
            && let Err(e) = self.checkpoint(&mut st)
        {
            // The writes are durable; the journal just grows until a
            // checkpoint succeeds.
            tracing::warn!(error = %e, "journal checkpoint failed");
        }
        Ok(())
    }

    /// Records, durably, that directory `dir` is about to be removed, if any
    /// record of this journal names a file under it. Call it before the
    /// removal, and remove nothing if it fails
    /// ([`remove_log_dir`] does both).
    pub fn forget_dir(&self, dir: &Path) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        // A directory's files sort right after it, before anything else.
        let under: Vec<PathBuf> = st
            .covered
            .range::<Path, _>((Bound::Included(dir), Bound::Unbounded))
            .map(|(p, _)| p)
            .take_while(|p| p.starts_with(dir))
            .cloned()
            .collect();
        if under.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::new();
        encode(&mut buf, KIND_FORGET, dir, 0, &[]);
        Self::append(&mut st, &buf)?;
        for p in &under {
            st.covered.remove(p);
        }
        Ok(())
    }

    fn append(st: &mut State, buf: &[u8]) -> Result<(), StoreError> {
        st.file
            .write_at(buf, st.len)
            .and_then(|()| st.file.sync_data())
            .map_err(|e| StoreError::io(&st.path, e))?;
        st.len += buf.len() as u64;
        Ok(())
    }

    /// Syncs every file the journal covers, then starts a new journal file
    /// and removes the old one. On failure the old file stays the journal.
    fn checkpoint(&self, st: &mut State) -> Result<(), StoreError> {
        let files: Vec<(&PathBuf, &Arc<dyn StorageFile>)> = st.covered.iter().collect();
        let handles: Vec<&dyn StorageFile> = files.iter().map(|(_, f)| &***f).collect();
        for ((path, _), res) in files.iter().zip(self.storage.sync_files(&handles)) {
            res.map_err(|e| StoreError::io(*path, e))?;
        }
        let number = st.number + 1;
        let path = journal_path(&self.dir, number);
        let file = self
            .storage
            .create_new(&path)
            .map_err(|e| StoreError::io(&path, e))?;
        // The old journal is redundant now, and must not come back: a
        // directory it names may be removed and made again before the next
        // checkpoint, with no record forgetting it in the new file.
        let removed = self
            .storage
            .sync_dir(&self.dir)
            .and_then(|()| self.storage.remove(&st.path));
        if let Err(e) = removed {
            // The old file stays the journal (replay reads every journal
            // file in order: the new, empty one is harmless if it stays).
            let _ = self.storage.remove(&path);
            return Err(StoreError::io(&st.path, e));
        }
        let old = std::mem::replace(&mut st.path, path);
        st.file = file;
        st.number = number;
        st.len = 0;
        // Until the removal is durable the old file may come back: its
        // directories are still forgotten with a record.
        self.storage
            .sync_dir(&self.dir)
            .map_err(|e| StoreError::io(&old, e))?;
        st.covered.clear();
        Ok(())
    }
}
