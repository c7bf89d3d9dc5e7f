//! The `MetadataStore` conformance suite on the broker's stores: in memory,
//! and the JSON file (reopened from disk).

use std::path::PathBuf;

use tempfile::TempDir;
use warren_broker::conformance::{StoreHarness, metadata_store};
use warren_broker::meta::{FileStore, MemoryStore};

struct Memory;

impl StoreHarness for Memory {
    type Store = MemoryStore;

    fn open(&mut self) -> MemoryStore {
        MemoryStore::default()
    }

    fn reopen(&mut self, store: MemoryStore) -> MemoryStore {
        store
    }
}

/// Each `open` takes a fresh directory; `reopen` reads the file again.
#[derive(Default)]
struct File {
    dirs: Vec<TempDir>,
}

impl File {
    fn path(&self) -> PathBuf {
        self.dirs
            .last()
            .expect("opened")
            .path()
            .join("definitions.json")
    }
}

impl StoreHarness for File {
    type Store = FileStore;

    fn open(&mut self) -> FileStore {
        self.dirs.push(tempfile::tempdir().unwrap());
        FileStore::open(self.path()).unwrap()
    }

    fn reopen(&mut self, store: FileStore) -> FileStore {
        drop(store);
        FileStore::open(self.path()).unwrap()
    }
}

#[test]
fn memory_store_keeps_the_metadata_store_contract() {
    for seed in 0..16 {
        metadata_store(&mut Memory, seed);
    }
}

#[test]
fn file_store_keeps_the_metadata_store_contract() {
    let mut harness = File::default();
    for seed in 0..4 {
        metadata_store(&mut harness, seed);
    }
}
