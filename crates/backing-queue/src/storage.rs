//! The file operations the segment log needs, behind a trait: [`FsStorage`]
//! is the real file system; [`MemStorage`] keeps files in memory with a crash
//! model (only what was synced survives [`MemStorage::crash`]), for
//! deterministic simulation and tests without real I/O.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use crate::open_files::{FsFile, OpenFiles};

/// An open file of a [`Storage`].
pub trait StorageFile: Send + Sync + Debug {
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Fills `buf` from `offset`; an error if the file is shorter.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Makes the file's data durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// Truncates or extends the file.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// The file system holding the file (its device number), if the storage
    /// has several: files on one are synced together by
    /// [`Storage::sync_files`].
    fn file_system(&self) -> Option<u64> {
        None
    }
}

/// A directory of files, as the segment log uses it.
pub trait Storage: Send + Sync + Debug {
    /// Creates `dir` and its parents if missing.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The paths of the files in `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// The whole content of a file.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Creates a new file; an error if it exists.
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Removes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Renames a file (replacing `to` if it exists).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creations, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Removes `dir` and everything in it.
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Makes the data of every file durable, as `sync_data` on each would;
    /// one result per file, in order. The default syncs them one by one.
    fn sync_files(&self, files: &[&dyn StorageFile]) -> Vec<io::Result<()>> {
        files.iter().map(|f| f.sync_data()).collect()
    }
    /// Names this boot of the machine: it changes when unsynced writes may
    /// have been lost (a power loss, a kernel crash), never at a process's
    /// restart. Empty when unknown (never changes then).
    fn boot_id(&self) -> Vec<u8> {
        Vec::new()
    }
}

/// Files synced together past which [`FsStorage::sync_files`] syncs their
/// whole file system at once instead.
const SYNCFS_MIN_FILES: usize = 2;

/// The real file system (`std::fs`, positional I/O, `fdatasync`).
///
/// Many files are synced with one `syncfs(2)` of the file system that holds
/// them, instead of one `fdatasync` each: one journal commit and one device
/// cache flush instead of one per file, which is what a node with a thousand
/// durable queues needs. `syncfs` reports the write-back errors seen since its
/// descriptor was opened, so each file system gets a directory handle when a
/// log first creates its directory there, before any file in it is written,
/// and keeps it.
///
/// Files are closed when more than [`FsStorage::set_open_files_max`] are
/// open (those not used lately) and opened again when next used
/// (`open_files.rs`).
#[derive(Debug, Default)]
pub struct FsStorage {
    /// A directory handle per file system (by device number), for `syncfs`.
    file_systems: Mutex<HashMap<u64, Arc<File>>>,
    open_files: Arc<OpenFiles>,
}

impl FsStorage {
    /// The process's shared real file system: logs that use it have their
    /// group commits batched into one `syncfs` per file system (see
    /// [`SyncJob::run_all`](crate::SyncJob::run_all)).
    pub fn shared() -> Arc<FsStorage> {
        static SHARED: LazyLock<Arc<FsStorage>> = LazyLock::new(Arc::default);
        Arc::clone(&SHARED)
    }

    /// Keeps at most `max` of its files open (unlimited until set).
    pub fn set_open_files_max(&self, max: usize) {
        self.open_files.set_max(max);
    }

    /// How many of its files are open now.
    pub fn open_files(&self) -> usize {
        self.open_files.open()
    }

    fn file_system(&self, dev: u64) -> Option<Arc<File>> {
        lock(&self.file_systems).get(&dev).cloned()
    }

    fn wrap(&self, file: File, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(FsFile::new(file, path.to_owned(), &self.open_files)?)
    }
}

impl Storage for FsStorage {
    fn boot_id(&self) -> Vec<u8> {
        fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default()
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)?;
        let dev = fs::metadata(dir)?.dev();
        if let std::collections::hash_map::Entry::Vacant(e) = lock(&self.file_systems).entry(dev) {
            e.insert(Arc::new(File::open(dir)?));
        }
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        fs::read_dir(dir)?.map(|e| e.map(|e| e.path())).collect()
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        self.wrap(OpenOptions::new().read(true).write(true).open(path)?, path)
    }

    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        self.wrap(file, path)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.open_files.gone(path);
        fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.open_files.gone(from);
        self.open_files.gone(to);
        fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.open_files.gone(dir);
        fs::remove_dir_all(dir)
    }

    fn sync_files(&self, files: &[&dyn StorageFile]) -> Vec<io::Result<()>> {
        let mut results: Vec<Option<io::Result<()>>> = files.iter().map(|_| None).collect();
        let mut by_dev: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, file) in files.iter().enumerate() {
            if let Some(dev) = file.file_system() {
                by_dev.entry(dev).or_default().push(i);
            }
        }
        for (dev, idx) in by_dev {
            if idx.len() < SYNCFS_MIN_FILES {
                continue;
            }
            let Some(handle) = self.file_system(dev) else {
                continue;
            };
            let res = rustix::fs::syncfs(&*handle);
            for i in idx {
                results[i] = Some(res.map_err(io::Error::from));
            }
        }
        results
            .into_iter()
            .zip(files)
            .map(|(r, f)| r.unwrap_or_else(|| f.sync_data()))
            .collect()
    }
}

#[derive(Debug, Default)]
struct MemFileState {
    current: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Debug, Default)]
struct MemFile {
    state: Mutex<MemFileState>,
    /// The storage's fault switch ([`MemStorage::set_failing`]).
    failing: Arc<AtomicBool>,
    /// The storage's read fault switch ([`MemStorage::set_failing_reads`]).
    failing_reads: Arc<AtomicBool>,
}

impl MemFile {
    fn check(&self) -> io::Result<()> {
        if self.failing.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected storage fault"));
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the state half-updated in a
    // way that matters to a test double: carry on.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl StorageFile for MemFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check()?;
        let mut s = lock(&self.state);
        let end = offset as usize + buf.len();
        if s.current.len() < end {
            s.current.resize(end, 0);
        }
        s.current[offset as usize..end].copy_from_slice(buf);
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.failing_reads.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected read fault"));
        }
        let s = lock(&self.state);
        let src = s
            .current
            .get(offset as usize..offset as usize + buf.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.check()?;
        let mut s = lock(&self.state);
        s.durable = s.current.clone();
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check()?;
        lock(&self.state).current.resize(len as usize, 0);
        Ok(())
    }
}

#[derive(Debug, Default)]
struct MemDirs {
    /// Directory entries as the running process sees them.
    current: BTreeMap<PathBuf, Arc<MemFile>>,
    /// Directory entries that survive a crash.
    durable: BTreeMap<PathBuf, Arc<MemFile>>,
    /// While set, writes, syncs and creations fail.
    failing: Arc<AtomicBool>,
    /// While set, reads of files fail.
    failing_reads: Arc<AtomicBool>,
    /// Power losses so far: the boot id.
    boots: u64,
}

/// In-memory files with a crash model (like turmoil's file system): file data
/// survives [`crash`](Self::crash) only up to its last `sync_data`, and a
/// file's creation or removal only once its directory was synced. Clones
/// share the same files.
#[derive(Debug, Clone, Default)]
pub struct MemStorage(Arc<Mutex<MemDirs>>);

impl MemStorage {
    /// An empty storage.
    pub fn new() -> Self {
        Self::default()
    }

    /// Simulates power loss: every file goes back to its synced content, and
    /// the directories to their synced entries. Drop the queues using this
    /// storage first.
    pub fn crash(&self) {
        let mut d = lock(&self.0);
        for f in d.durable.values() {
            let mut s = lock(&f.state);
            s.current = s.durable.clone();
        }
        d.current = d.durable.clone();
        d.boots += 1;
    }

    /// The content of a file, if it exists (for tests that damage files).
    pub fn file(&self, path: &Path) -> Option<Vec<u8>> {
        lock(&self.0)
            .current
            .get(path)
            .map(|f| lock(&f.state).current.clone())
    }

    /// Makes every write, sync and file creation fail with an I/O error
    /// (a full or failing disk) while `failing` holds.
    pub fn set_failing(&self, failing: bool) {
        lock(&self.0).failing.store(failing, Ordering::Relaxed);
    }

    /// Makes every read of a file fail with an I/O error (a bad sector, a
    /// failing disk) while `failing` holds; writes go on.
    pub fn set_failing_reads(&self, failing: bool) {
        lock(&self.0)
            .failing_reads
            .store(failing, Ordering::Relaxed);
    }

    fn get(&self, path: &Path) -> io::Result<Arc<MemFile>> {
        lock(&self.0)
            .current
            .get(path)
            .cloned()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }
}

impl Storage for MemStorage {
    fn boot_id(&self) -> Vec<u8> {
        lock(&self.0).boots.to_le_bytes().to_vec()
    }

    fn create_dir_all(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        Ok(lock(&self.0)
            .current
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect())
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        if lock(&self.0).failing_reads.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected read fault"));
        }
        Ok(lock(&self.get(path)?.state).current.clone())
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(self.get(path)?)
    }

    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let mut d = lock(&self.0);
        if d.failing.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected storage fault"));
        }
        if d.current.contains_key(path) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        let f = Arc::new(MemFile {
            state: Mutex::default(),
            failing: Arc::clone(&d.failing),
            failing_reads: Arc::clone(&d.failing_reads),
        });
        d.current.insert(path.to_path_buf(), Arc::clone(&f));
        Ok(f)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        lock(&self.0)
            .current
            .remove(path)
            .map(drop)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut d = lock(&self.0);
        let f = d
            .current
            .remove(from)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        d.current.insert(to.to_path_buf(), f);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut d = lock(&self.0);
        let MemDirs {
            current, durable, ..
        } = &mut *d;
        durable.retain(|p, _| p.parent() != Some(dir));
        for (p, f) in current.iter() {
            if p.parent() == Some(dir) {
                durable.insert(p.clone(), Arc::clone(f));
            }
        }
        Ok(())
    }

    /// Removes the files under `dir` as the running process sees them (the
    /// removal is durable once the directory is synced, as on a disk).
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        lock(&self.0).current.retain(|p, _| !p.starts_with(dir));
        Ok(())
    }
}
