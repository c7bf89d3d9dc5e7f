//! The file operations the segment log needs, behind a trait: [`FsStorage`]
//! is the real file system; [`MemStorage`] keeps files in memory with a crash
//! model (only what was synced survives [`MemStorage::crash`]), for
//! deterministic simulation and tests without real I/O.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

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
}

/// The real file system (`std::fs`, positional I/O, `fdatasync`).
#[derive(Debug, Clone, Copy, Default)]
pub struct FsStorage;

#[derive(Debug)]
struct FsFile(File);

impl StorageFile for FsFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_all_at(buf, offset)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
}

impl Storage for FsStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        fs::read_dir(dir)?.map(|e| e.map(|e| e.path())).collect()
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Arc::new(FsFile(f)))
    }

    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        Ok(Arc::new(FsFile(f)))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

#[derive(Debug, Default)]
struct MemFileState {
    current: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Debug, Default)]
struct MemFile(Mutex<MemFileState>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the state half-updated in a
    // way that matters to a test double: carry on.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl StorageFile for MemFile {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut s = lock(&self.0);
        let end = offset as usize + buf.len();
        if s.current.len() < end {
            s.current.resize(end, 0);
        }
        s.current[offset as usize..end].copy_from_slice(buf);
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let s = lock(&self.0);
        let src = s
            .current
            .get(offset as usize..offset as usize + buf.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut s = lock(&self.0);
        s.durable = s.current.clone();
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        lock(&self.0).current.resize(len as usize, 0);
        Ok(())
    }
}

#[derive(Debug, Default)]
struct MemDirs {
    /// Directory entries as the running process sees them.
    current: BTreeMap<PathBuf, Arc<MemFile>>,
    /// Directory entries that survive a crash.
    durable: BTreeMap<PathBuf, Arc<MemFile>>,
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
            let mut s = lock(&f.0);
            s.current = s.durable.clone();
        }
        d.current = d.durable.clone();
    }

    /// The content of a file, if it exists (for tests that damage files).
    pub fn file(&self, path: &Path) -> Option<Vec<u8>> {
        lock(&self.0)
            .current
            .get(path)
            .map(|f| lock(&f.0).current.clone())
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
        Ok(lock(&self.get(path)?.0).current.clone())
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(self.get(path)?)
    }

    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let mut d = lock(&self.0);
        if d.current.contains_key(path) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        let f = Arc::new(MemFile::default());
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
        let MemDirs { current, durable } = &mut *d;
        durable.retain(|p, _| p.parent() != Some(dir));
        for (p, f) in current.iter() {
            if p.parent() == Some(dir) {
                durable.insert(p.clone(), Arc::clone(f));
            }
        }
        Ok(())
    }
}
