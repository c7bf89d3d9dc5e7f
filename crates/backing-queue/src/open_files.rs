//! [`FsStorage`](crate::FsStorage)'s files, opened when used and closed
//! when too many are open: a node with tens of thousands of durable queues
//! would otherwise hold one descriptor per queue's segment and run out
//! (RabbitMQ's classic queues share a file-handle budget the same way).
//!
//! Every open file is in one ring; a file's use sets its `used` bit without
//! taking any shared lock. A file opened past the budget sweeps the ring
//! once (the CLOCK algorithm): a used file loses its bit and stays, an
//! unused one is closed. A closed file keeps its path and opens again on its
//! next use: data written through a closed descriptor stays in the page
//! cache and a later `fdatasync` through a new one makes it durable, and
//! the group commit's `syncfs` reports write-back errors through a
//! directory handle the storage keeps anyway.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Bound;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::storage::StorageFile;

/// The budget of open files, the ring of those open, and every file by
/// path (to tell a closed one that its path was removed or replaced).
#[derive(Debug)]
pub(crate) struct OpenFiles {
    max: AtomicUsize,
    open: AtomicUsize,
    ring: Mutex<VecDeque<Weak<FsFile>>>,
    by_path: Mutex<BTreeMap<PathBuf, Vec<Weak<FsFile>>>>,
}

impl Default for OpenFiles {
    fn default() -> Self {
        Self {
            max: AtomicUsize::new(usize::MAX),
            open: AtomicUsize::new(0),
            ring: Mutex::default(),
            by_path: Mutex::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl OpenFiles {
    /// Keeps at most `max` files open (at least one).
    pub(crate) fn set_max(&self, max: usize) {
        self.max.store(max.max(1), Ordering::Relaxed);
    }

    /// How many files are open now.
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Marks the files at `path`, and under it if it is a directory, gone:
    /// call it before removing or replacing what is there. One that is open
    /// keeps its descriptor (to the old file); a closed one never opens
    /// the path again.
    pub(crate) fn gone(&self, path: &Path) {
        let files: Vec<Arc<FsFile>> = lock(&self.by_path)
            .range::<Path, _>((Bound::Included(path), Bound::Unbounded))
            .take_while(|(p, _)| p.starts_with(path))
            .flat_map(|(_, fs)| fs.iter().filter_map(Weak::upgrade))
            .collect();
        for f in files {
            // Under its lock: a reopen is before this or sees it.
            let _slot = lock(&f.file);
            f.gone.store(true, Ordering::Relaxed);
        }
    }

    /// Counts `file` as open, closing unused ones past the budget.
    fn opened(&self, file: Weak<FsFile>) {
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        let mut ring = lock(&self.ring);
        ring.push_back(file);
        // Dropped files leave their entries: cleared when they are as many
        // as the open ones.
        if ring.len() > 2 * open + 64 {
            ring.retain(|w| w.strong_count() > 0);
        }
        if open <= self.max.load(Ordering::Relaxed) {
            return;
        }
        // Twice round at most: the first clears the bits the second reads.
        for _ in 0..ring.len() * 2 {
            if self.open.load(Ordering::Relaxed) <= self.max.load(Ordering::Relaxed) {
                break;
            }
            let Some(weak) = ring.pop_front() else { break };
            let Some(f) = weak.upgrade() else {
                continue; // dropped: its drop counted it closed
            };
            if f.used.swap(false, Ordering::Relaxed) || !f.close() {
                ring.push_back(weak);
            }
        }
    }
}

/// A file of the real file system that may be closed between uses.
#[derive(Debug)]
pub(crate) struct FsFile {
    path: PathBuf,
    /// The device number of the file system holding it.
    dev: u64,
    /// Its path was removed or now names another file ([`OpenFiles::gone`]).
    gone: AtomicBool,
    /// Open, or closed to keep within the budget. I/O runs on a clone of
    /// the handle, outside this lock, so a slow sync holds up nobody.
    file: Mutex<Option<Arc<File>>>,
    used: AtomicBool,
    me: Weak<FsFile>,
    open_files: Arc<OpenFiles>,
}

impl FsFile {
    /// Wraps `file`, just opened at `path`, and counts it open.
    pub(crate) fn new(
        file: File,
        path: PathBuf,
        open_files: &Arc<OpenFiles>,
    ) -> io::Result<Arc<Self>> {
        let dev = file.metadata()?.dev();
        let f = Arc::new_cyclic(|me| FsFile {
            path,
            dev,
            gone: AtomicBool::new(false),
            file: Mutex::new(Some(Arc::new(file))),
            used: AtomicBool::new(true),
            me: me.clone(),
            open_files: Arc::clone(open_files),
        });
        lock(&open_files.by_path)
            .entry(f.path.clone())
            .or_default()
            .push(f.me.clone());
        open_files.opened(f.me.clone());
        Ok(f)
    }

    /// The open handle, opening the file again if it was closed; `None` if
    /// it was closed and is gone (as an open descriptor would still reach
    /// the old file, the path perhaps another's now).
    fn handle(&self) -> io::Result<Option<Arc<File>>> {
        self.used.store(true, Ordering::Relaxed);
        let mut slot = lock(&self.file);
        if let Some(f) = &*slot {
            return Ok(Some(Arc::clone(f)));
        }
        if self.gone.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let f = Arc::new(OpenOptions::new().read(true).write(true).open(&self.path)?);
        *slot = Some(Arc::clone(&f));
        drop(slot);
        self.open_files.opened(self.me.clone());
        Ok(Some(f))
    }

    /// Closes the file unless it is closed or in use; whether it closed it.
    /// The descriptor goes when the last I/O on it ends.
    fn close(&self) -> bool {
        let Ok(mut slot) = self.file.try_lock() else {
            return false;
        };
        if slot.take().is_none() {
            return false;
        }
        self.open_files.open.fetch_sub(1, Ordering::Relaxed);
        true
    }
}

impl Drop for FsFile {
    fn drop(&mut self) {
        let slot = self.file.get_mut().unwrap_or_else(PoisonError::into_inner);
        if slot.take().is_some() {
            self.open_files.open.fetch_sub(1, Ordering::Relaxed);
        }
        let mut by_path = lock(&self.open_files.by_path);
        if let Some(files) = by_path.get_mut(&self.path) {
            files.retain(|w| !w.ptr_eq(&self.me));
            if files.is_empty() {
                by_path.remove(&self.path);
            }
        }
    }
}

/// What an unlinked file's descriptor would do: take writes and syncs that
/// no one will read.
impl StorageFile for FsFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.handle()?
            .map_or(Ok(()), |f| f.write_all_at(buf, offset))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self.handle()? {
            Some(f) => f.read_exact_at(buf, offset),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} was removed", self.path.display()),
            )),
        }
    }

    fn sync_data(&self) -> io::Result<()> {
        self.handle()?.map_or(Ok(()), |f| f.sync_data())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.handle()?.map_or(Ok(()), |f| f.set_len(len))
    }

    fn file_system(&self) -> Option<u64> {
        Some(self.dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(
        names: std::ops::Range<usize>,
        open_files: &Arc<OpenFiles>,
        dir: &Path,
    ) -> Vec<Arc<FsFile>> {
        names
            .map(|i| {
                let path = dir.join(format!("{i}"));
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .expect("create");
                FsFile::new(f, path, open_files).expect("stat")
            })
            .collect()
    }

    fn budget(max: usize) -> (tempfile::TempDir, Arc<OpenFiles>) {
        let open_files = Arc::new(OpenFiles::default());
        open_files.set_max(max);
        (tempfile::tempdir().expect("tempdir"), open_files)
    }

    /// Past the budget the files not used lately are closed; each opens
    /// again on its next use, with what was written through it.
    #[test]
    fn files_past_the_budget_close_and_open_again_when_used() {
        let (dir, open_files) = budget(4);
        let fs = files(0..10, &open_files, dir.path());
        assert!(open_files.open() <= 4, "{} open", open_files.open());
        for (i, f) in fs.iter().enumerate() {
            f.write_at(&[i as u8; 3], 0).expect("write");
            assert!(open_files.open() <= 4);
        }
        for (i, f) in fs.iter().enumerate().rev() {
            let mut buf = [0; 3];
            f.read_at(&mut buf, 0).expect("read");
            assert_eq!(buf, [i as u8; 3]);
            f.sync_data().expect("sync");
        }
        assert!(open_files.open() <= 4);
        drop(fs);
        assert_eq!(open_files.open(), 0);
        for _ in 0..200 {
            drop(files(10..11, &open_files, dir.path()));
            std::fs::remove_file(dir.path().join("10")).expect("remove");
        }
        assert!(
            lock(&open_files.ring).len() <= 64 + 2,
            "dropped files are forgotten"
        );
    }

    /// A closed file whose path was removed and now names another file does
    /// not open that one (the same inode number may well be used again):
    /// writes and syncs go nowhere (as through an unlinked file's
    /// descriptor), reads fail, and the new file keeps what it holds.
    #[test]
    fn a_closed_file_never_opens_another_at_its_path() {
        let (dir, open_files) = budget(1);
        let old = files(0..1, &open_files, dir.path());
        let _other = files(1..2, &open_files, dir.path());
        assert!(lock(&old[0].file).is_none(), "closed past the budget");
        let path = dir.path().join("0");
        open_files.gone(&path);
        std::fs::remove_file(&path).expect("remove");
        std::fs::write(&path, b"new").expect("a new file at the path");
        old[0].write_at(b"old", 0).expect("write goes nowhere");
        old[0].sync_data().expect("sync of nothing");
        assert!(old[0].read_at(&mut [0; 3], 0).is_err());
        assert_eq!(std::fs::read(&path).expect("read"), b"new");
        std::fs::remove_file(&path).expect("remove");
        old[0].write_at(b"old", 0).expect("write goes nowhere");
        assert!(!path.exists());
    }

    /// A file in use (its lock held) is passed over, not closed under it.
    #[test]
    fn a_busy_file_is_not_closed() {
        let (dir, open_files) = budget(1);
        let fs = files(0..1, &open_files, dir.path());
        fs[0].used.store(false, Ordering::Relaxed);
        let held = lock(&fs[0].file);
        let more = files(1..2, &open_files, dir.path());
        drop(held);
        assert!(lock(&fs[0].file).is_some(), "the busy one stays open");
        drop(more);
        assert_eq!(open_files.open(), 1);
    }
}
