//! Durable entities (vhosts, users, permissions, durable exchanges, queues
//! and bindings) behind [`MetadataStore`], with a file-backed implementation.
//!
//! A clustered node (`warren --peer-addr …`) implements the same trait over
//! the Raft-replicated cluster metadata.

use std::collections::HashMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use warren_amqp::amq_protocol::types::FieldTable;

use crate::auth::{PermissionDef, UserDef};

/// An exchange that every node knows: durable, or (in a cluster) transient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeDef {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// direct, fanout, topic or headers.
    pub kind: String,
    /// Survives a restart (else it is shared through the cluster only, as
    /// RabbitMQ's transient exchanges are).
    #[serde(default = "yes")]
    pub durable: bool,
    /// Deleted when its last binding goes.
    pub auto_delete: bool,
    /// Clients may not publish to it.
    pub internal: bool,
    /// Declare arguments (`alternate-exchange`, …).
    pub arguments: FieldTable,
}

/// A queue that every node knows: durable, or (in a cluster) non-durable
/// or exclusive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueDef {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// Survives a restart (else it is shared through the cluster only).
    #[serde(default = "yes")]
    pub durable: bool,
    /// The node to serve it when a `queue-master-locator` chose another
    /// than the declaring one (in a cluster; `None`: the declaring node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<String>,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// Exclusive to the connection that declared it (in a cluster: the
    /// other nodes refuse it to their clients and route to it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub exclusive: bool,
    /// Declare arguments (`x-message-ttl`, …).
    pub arguments: FieldTable,
}

fn yes() -> bool {
    true
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
fn is_false(b: &bool) -> bool {
    !*b
}

/// A binding between two shared entities (durable when both ends are).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BindingDef {
    /// Its vhost.
    pub vhost: String,
    /// The source exchange.
    pub source: String,
    /// The destination's name.
    pub destination: String,
    /// Whether the destination is an exchange (else a queue).
    pub destination_is_exchange: bool,
    /// The binding key.
    pub routing_key: String,
    /// Binding arguments (headers exchanges).
    pub arguments: FieldTable,
}

/// A stored policy or operator policy, as the management API shows it.
///
/// The broker keeps it as given; validation (`warren-policy`) happens
/// before it is stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyDef {
    /// Its vhost.
    pub vhost: String,
    /// Its name, unique per vhost and kind.
    pub name: String,
    /// The regex over entity names.
    pub pattern: String,
    /// `all`, `queues`, `classic_queues` or `exchanges`.
    #[serde(rename = "apply-to")]
    pub apply_to: String,
    /// Higher wins.
    pub priority: i64,
    /// The definition, a JSON object.
    pub definition: serde_json::Value,
    /// An operator policy (else a regular one).
    #[serde(default)]
    pub operator: bool,
}

/// Every durable entity: what a [`MetadataStore`] holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Definitions {
    /// Vhost names.
    pub vhosts: Vec<String>,
    /// Users.
    pub users: Vec<UserDef>,
    /// Permissions.
    pub permissions: Vec<PermissionDef>,
    /// Durable exchanges (not the built-in ones).
    pub exchanges: Vec<ExchangeDef>,
    /// Durable queues.
    pub queues: Vec<QueueDef>,
    /// Bindings between durable entities.
    pub bindings: Vec<BindingDef>,
    /// Policies and operator policies.
    #[serde(default)]
    pub policies: Vec<PolicyDef>,
    /// Where each queue, exchange and binding sits in the lists above.
    #[serde(skip)]
    positions: Positions,
}

/// A queue's or exchange's key: vhost and name.
type Named = (String, String);

/// A binding's destination: vhost, whether it is an exchange, name.
type Destination = (String, bool, String);

/// Where each queue, exchange and binding sits in a [`Definitions`]' lists,
/// so that a change finds what it replaces or deletes without looking at
/// every entry (a node with 50,000 queues replayed its metadata log in
/// O(changes x queues) before). Built by the first change that needs it;
/// a change that touches many entries (a vhost's deletion) drops it to be
/// built again. Not part of the definitions' value: never compared or
/// stored.
#[derive(Clone, Default)]
struct Positions {
    built: bool,
    queues: HashMap<Named, usize>,
    exchanges: HashMap<Named, usize>,
    bindings_to: HashMap<Destination, Vec<usize>>,
}

impl PartialEq for Positions {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Positions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Positions")
    }
}

fn named(vhost: &str, name: &str) -> Named {
    (vhost.to_owned(), name.to_owned())
}

fn destination(b: &BindingDef) -> Destination {
    (
        b.vhost.clone(),
        b.destination_is_exchange,
        b.destination.clone(),
    )
}

impl Positions {
    fn build(&mut self, queues: &[QueueDef], exchanges: &[ExchangeDef], bindings: &[BindingDef]) {
        if self.built {
            return;
        }
        self.queues = (queues.iter().enumerate())
            .map(|(i, q)| (named(&q.vhost, &q.name), i))
            .collect();
        self.exchanges = (exchanges.iter().enumerate())
            .map(|(i, x)| (named(&x.vhost, &x.name), i))
            .collect();
        self.bindings_to.clear();
        for (i, b) in bindings.iter().enumerate() {
            self.bindings_to.entry(destination(b)).or_default().push(i);
        }
        self.built = true;
    }

    /// Puts `item` in place of the entry named `key`, or adds it.
    fn put<T>(map: &mut HashMap<Named, usize>, list: &mut Vec<T>, key: Named, item: T) {
        match map.get(&key) {
            Some(&i) => list[i] = item,
            None => {
                map.insert(key, list.len());
                list.push(item);
            }
        }
    }

    /// Removes the entry named `key`; the last entry takes its place.
    fn remove<T>(
        map: &mut HashMap<Named, usize>,
        list: &mut Vec<T>,
        key: &Named,
        key_of: impl Fn(&T) -> Named,
    ) {
        let Some(i) = map.remove(key) else { return };
        list.swap_remove(i);
        if let Some(moved) = list.get(i) {
            map.insert(key_of(moved), i);
        }
    }

    /// The position of binding `b`, if present.
    fn binding(&self, bindings: &[BindingDef], b: &BindingDef) -> Option<usize> {
        let to = self.bindings_to.get(&destination(b))?;
        to.iter().copied().find(|&i| bindings[i] == *b)
    }

    /// Removes the bindings at `positions`; the last ones take their places.
    fn remove_bindings(&mut self, bindings: &mut Vec<BindingDef>, mut positions: Vec<usize>) {
        // From the highest: the last binding is then never one still to go.
        positions.sort_unstable();
        for &i in positions.iter().rev() {
            let gone = bindings.swap_remove(i);
            if let Some(to) = self.bindings_to.get_mut(&destination(&gone)) {
                to.retain(|&p| p != i);
                if to.is_empty() {
                    self.bindings_to.remove(&destination(&gone));
                }
            }
            if let Some(moved) = bindings.get(i) {
                let last = bindings.len();
                if let Some(to) = self.bindings_to.get_mut(&destination(moved)) {
                    for p in to.iter_mut().filter(|p| **p == last) {
                        *p = i;
                    }
                }
            }
        }
    }
}

/// One change to the durable entities.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Change {
    /// Add a vhost.
    PutVhost(String),
    /// Add or replace a user.
    PutUser(UserDef),
    /// Set a user's permissions in a vhost.
    PutPermission(PermissionDef),
    /// Add or replace a durable exchange.
    PutExchange(ExchangeDef),
    /// Delete a durable exchange (and its bindings).
    DeleteExchange {
        /// Its vhost.
        vhost: String,
        /// Its name.
        name: String,
    },
    /// Add or replace a durable queue.
    PutQueue(QueueDef),
    /// Delete a durable queue (and its bindings).
    DeleteQueue {
        /// Its vhost.
        vhost: String,
        /// Its name.
        name: String,
    },
    /// Add a binding.
    PutBinding(BindingDef),
    /// Remove a binding.
    DeleteBinding(BindingDef),
    /// Delete a vhost with everything in it.
    DeleteVhost(String),
    /// Delete a user and their permissions.
    DeleteUser(String),
    /// Clear a user's permissions in a vhost.
    DeletePermission {
        /// The user.
        user: String,
        /// The vhost.
        vhost: String,
    },
    /// Add or replace a policy (same vhost, name and kind).
    PutPolicy(PolicyDef),
    /// Delete a policy.
    DeletePolicy {
        /// Its vhost.
        vhost: String,
        /// Its name.
        name: String,
        /// An operator policy (else a regular one).
        operator: bool,
    },
}

impl Definitions {
    /// Applies one change.
    pub fn apply(&mut self, change: &Change) {
        match change {
            Change::PutVhost(v) => {
                if !self.vhosts.contains(v) {
                    self.vhosts.push(v.clone());
                }
            }
            Change::PutUser(u) => {
                self.users.retain(|x| x.name != u.name);
                self.users.push(u.clone());
            }
            Change::PutPermission(p) => {
                self.permissions
                    .retain(|x| !(x.user == p.user && x.vhost == p.vhost));
                self.permissions.push(p.clone());
            }
            Change::PutExchange(e) => {
                self.positions
                    .build(&self.queues, &self.exchanges, &self.bindings);
                let key = named(&e.vhost, &e.name);
                Positions::put(
                    &mut self.positions.exchanges,
                    &mut self.exchanges,
                    key,
                    e.clone(),
                );
            }
            Change::DeleteExchange { vhost, name } => {
                self.positions
                    .build(&self.queues, &self.exchanges, &self.bindings);
                let key = named(vhost, name);
                Positions::remove(
                    &mut self.positions.exchanges,
                    &mut self.exchanges,
                    &key,
                    |x| named(&x.vhost, &x.name),
                );
                let gone: Vec<usize> = (self.bindings.iter().enumerate())
                    .filter(|(_, b)| {
                        &b.vhost == vhost
                            && (&b.source == name
                                || (b.destination_is_exchange && &b.destination == name))
                    })
                    .map(|(i, _)| i)
                    .collect();
                self.positions.remove_bindings(&mut self.bindings, gone);
            }
            Change::PutQueue(q) => {
                self.positions
                    .build(&self.queues, &self.exchanges, &self.bindings);
                let key = named(&q.vhost, &q.name);
                Positions::put(&mut self.positions.queues, &mut self.queues, key, q.clone());
            }
            Change::DeleteQueue { vhost, name } => {
                self.positions
                    .build(&self.queues, &self.exchanges, &self.bindings);
                let key = named(vhost, name);
                Positions::remove(&mut self.positions.queues, &mut self.queues, &key, |q| {
                    named(&q.vhost, &q.name)
                });
                let to = (vhost.clone(), false, name.clone());
                let gone = self.positions.bindings_to.get(&to).cloned();
                self.positions
                    .remove_bindings(&mut self.bindings, gone.unwrap_or_default());
            }
            Change::PutBinding(b) => {
                self.positions
                    .build(&self.queues, &self.exchanges, &self.bindings);
                if self.positions.binding(&self.bindings, b).is_none() {
                    (self
                        .positions
                        .bindings_to
                        .entry(destination(b))
                        .or_default())
                    .push(self.bindings.len());
                    self.bindings.push(b.clone());
                }
            }
            Change::DeleteBinding(b) => {
                self.positions
                    .build(&self.queues, &self.exchanges, &self.bindings);
                if let Some(i) = self.positions.binding(&self.bindings, b) {
                    self.positions.remove_bindings(&mut self.bindings, vec![i]);
                }
            }
            Change::DeleteVhost(v) => {
                self.positions = Positions::default();
                self.vhosts.retain(|x| x != v);
                self.permissions.retain(|x| &x.vhost != v);
                self.exchanges.retain(|x| &x.vhost != v);
                self.queues.retain(|x| &x.vhost != v);
                self.bindings.retain(|x| &x.vhost != v);
                self.policies.retain(|x| &x.vhost != v);
            }
            Change::DeleteUser(u) => {
                self.users.retain(|x| &x.name != u);
                self.permissions.retain(|x| &x.user != u);
            }
            Change::DeletePermission { user, vhost } => {
                self.permissions
                    .retain(|x| !(&x.user == user && &x.vhost == vhost));
            }
            Change::PutPolicy(p) => {
                self.policies.retain(|x| {
                    !(x.vhost == p.vhost && x.name == p.name && x.operator == p.operator)
                });
                self.policies.push(p.clone());
            }
            Change::DeletePolicy {
                vhost,
                name,
                operator,
            } => {
                self.policies
                    .retain(|x| !(&x.vhost == vhost && &x.name == name && &x.operator == operator));
            }
        }
    }
}

/// An error of a metadata store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetaError {
    /// Reading or writing the store failed.
    #[error("metadata store I/O error on {path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The stored definitions could not be decoded.
    #[error("metadata file {path} is not valid: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The cluster's metadata store could not commit the change.
    #[error("cluster metadata change failed: {0}")]
    Cluster(String),
}

/// Where the broker keeps its durable entities. A change is durable when
/// [`MetadataStore::apply`] returns.
///
/// Contract: `load` holds what [`Definitions::apply`] makes of every change
/// applied so far, from empty (the order of its lists is the store's), and
/// so does the store reopened after any `apply` returned. The broker sends
/// only changes that make sense (entities in vhosts that exist, permissions
/// of users that exist), but deletions may name what is already gone. The
/// suite `conformance::metadata_store` (feature `conformance`) checks this.
pub trait MetadataStore: Send + std::fmt::Debug {
    /// Everything stored.
    fn load(&self) -> Definitions;
    /// Applies and persists one change.
    fn apply(&mut self, change: Change) -> Result<(), MetaError>;
    /// Tells every node of a change to a transient entity (a non-durable
    /// or exclusive queue, a non-durable exchange, or a binding with such
    /// an end), which RabbitMQ shares across its cluster but forgets on
    /// restart.
    /// Stores that keep durable entities only (a single node's) ignore it.
    fn share(&mut self, change: Change) -> Result<(), MetaError> {
        let _ = change;
        Ok(())
    }
    /// Whether [`share`](Self::share) keeps anything: false for a store
    /// of durable entities only, which is then never handed transient ones.
    fn shares(&self) -> bool {
        false
    }
    /// The nodes that can take a new queue's master now (running, in the
    /// cluster), each with how many queue masters it hosts: what a
    /// `queue-master-locator` chooses from. `None` alone (a single node's
    /// store): every queue is served here.
    fn master_candidates(&self) -> Option<Vec<(String, usize)>> {
        None
    }
    /// Whether `node` is another member of this node's cluster (where a
    /// direct reply-to may be sent). A single node's store has none.
    fn is_member(&self, node: &str) -> bool {
        let _ = node;
        false
    }
    /// Whether the changes a client's command makes are committed by the
    /// shell, off the broker's lock, instead of by [`apply`](Self::apply)
    /// and [`share`](Self::share): the broker then keeps them for
    /// [`Broker::take_commits`](crate::Broker::take_commits) and holds the
    /// client's reply until [`Broker::commit_done`](crate::Broker::commit_done).
    /// For a store whose commit waits on other nodes (the cluster's).
    fn defers(&self) -> bool {
        false
    }
    /// Whether a store that [defers](Self::defers) takes every change
    /// through the commits, also those no client waits for (a channel's
    /// auto-delete, the tick), queued behind the commits in flight instead
    /// of applied at once: so it sees every change in the order the broker
    /// made them. For a store whose one committer writes them all (a
    /// single node's file).
    fn defers_all(&self) -> bool {
        false
    }
    /// Whether a client's connection.close-ok waits, for a store that
    /// [defers](Self::defers), until what the connection's end deletes (its
    /// exclusive queues) is committed, so that the client's next
    /// connection finds them gone whichever broker serves it: for a
    /// sharded node's store, whose commits every shard has applied once
    /// done.
    fn close_waits(&self) -> bool {
        false
    }
}

/// Keeps everything in memory (tests, transient nodes).
#[derive(Debug, Default)]
pub struct MemoryStore {
    defs: Definitions,
}

impl MetadataStore for MemoryStore {
    fn load(&self) -> Definitions {
        self.defs.clone()
    }

    fn apply(&mut self, change: Change) -> Result<(), MetaError> {
        self.defs.apply(&change);
        Ok(())
    }
}

/// The definitions on disk: a JSON snapshot (`metadata.json`, rewritten
/// atomically: write, fsync, rename, fsync the directory) and a log of the
/// changes since (`metadata.log` beside it: one JSON line per batch of
/// changes, appended and fdatasynced). A commit costs what it changes, not
/// the size of the definitions; the snapshot is rewritten (and the log
/// emptied) once the log outgrows it. Changes go to the file one at a time
/// ([`MetadataStore::apply`]), or in batches once its writes are handed to
/// the shell ([`committer`](Self::committer)).
#[derive(Debug)]
pub struct FileStore {
    file: Arc<Mutex<DefinitionsFile>>,
    /// The shell commits the changes, off the broker's lock.
    deferred: bool,
}

/// The snapshot and log, and what they hold.
#[derive(Debug)]
struct DefinitionsFile {
    path: PathBuf,
    defs: Definitions,
    /// The log, once opened for appending.
    log: Option<fs::File>,
    /// Bytes in the log.
    log_len: u64,
    /// Bytes of the last snapshot written or read (`None`: there is none).
    snapshot_len: Option<u64>,
}

/// The log is folded into a new snapshot past this size, or past the
/// snapshot's own size if that is larger.
const LOG_COMPACT_BYTES: u64 = 1 << 20;

/// The change log beside the snapshot at `path`.
fn log_path(path: &Path) -> PathBuf {
    path.with_extension("log")
}

impl FileStore {
    /// Opens (or starts empty) the store at `path`, replaying the changes
    /// logged since its snapshot (a torn last line, a crash in its append,
    /// is cut off).
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, MetaError> {
        let path = path.into();
        let io = |path: &Path, source| MetaError::Io {
            path: path.to_owned(),
            source,
        };
        let invalid = |path: &Path, reason: String| MetaError::Invalid {
            path: path.to_owned(),
            reason,
        };
        let (mut defs, snapshot_len) = match fs::read(&path) {
            Ok(bytes) => (
                serde_json::from_slice(&bytes).map_err(|e| invalid(&path, e.to_string()))?,
                Some(bytes.len() as u64),
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Definitions::default(), None),
            Err(e) => return Err(io(&path, e)),
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        let log = log_path(&path);
        let mut log_len = 0;
        match fs::read(&log) {
            Ok(bytes) => {
                let mut lines = bytes.split_inclusive(|&b| b == b'\n').peekable();
                while let Some(line) = lines.next() {
                    let last = lines.peek().is_none();
                    let batch = line
                        .strip_suffix(b"\n")
                        .and_then(|l| serde_json::from_slice::<Vec<Change>>(l).ok());
                    match batch {
                        Some(batch) => {
                            for change in &batch {
                                defs.apply(change);
                            }
                            log_len += line.len() as u64;
                        }
                        None if last => {
                            tracing::warn!(file = %log.display(), offset = log_len, "cutting off a torn last line of the metadata log");
                            let f = fs::OpenOptions::new()
                                .write(true)
                                .open(&log)
                                .map_err(|e| io(&log, e))?;
                            f.set_len(log_len).map_err(|e| io(&log, e))?;
                            f.sync_all().map_err(|e| io(&log, e))?;
                        }
                        None => {
                            return Err(invalid(
                                &log,
                                format!("a line at byte {log_len} is not a batch of changes"),
                            ));
                        }
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&log, e)),
        }
        Ok(Self {
            file: Arc::new(Mutex::new(DefinitionsFile {
                path,
                defs,
                log: None,
                log_len,
                snapshot_len,
            })),
            deferred: false,
        })
    }

    /// Hands the file's writes to the caller: from now on the broker keeps
    /// every change for [`Broker::take_commits`](crate::Broker::take_commits),
    /// in the order it made them, and the caller writes them with
    /// [`FileCommitter::commit`] off the broker's lock (one write for many
    /// clients' changes) before it reports them done.
    pub fn committer(&mut self) -> FileCommitter {
        self.deferred = true;
        FileCommitter {
            file: Arc::clone(&self.file),
        }
    }
}

fn lock_file(file: &Mutex<DefinitionsFile>) -> std::sync::MutexGuard<'_, DefinitionsFile> {
    file.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes a [`FileStore`]'s changes, off the broker's lock.
#[derive(Debug, Clone)]
pub struct FileCommitter {
    file: Arc<Mutex<DefinitionsFile>>,
}

impl FileCommitter {
    /// Makes `changes` durable, in order, with one append to the log (or
    /// one new snapshot). A write that fails changes nothing: the same
    /// changes may be committed again. Only this committer writes, so the
    /// store's readers wait for no disk: the definitions change once the
    /// write is durable.
    pub fn commit(&self, changes: &[Change]) -> Result<(), MetaError> {
        let mut f = lock_file(&self.file);
        if changes.is_empty() {
            return Ok(());
        }
        let compact = f
            .snapshot_len
            .is_none_or(|snapshot| f.log_len >= snapshot.max(LOG_COMPACT_BYTES));
        if compact {
            let mut defs = f.defs.clone();
            for change in changes {
                defs.apply(change);
            }
            f.snapshot_len = Some(write_definitions(&f.path, &defs)?);
            f.defs = defs;
            // The snapshot holds everything logged: the log starts again.
            // Until it is emptied a restart replays it onto the snapshot,
            // which changes nothing (each change sets what it names).
            if f.log_len > 0 {
                let log = log_path(&f.path);
                let emptied = fs::OpenOptions::new()
                    .write(true)
                    .open(&log)
                    .and_then(|l| l.set_len(0).and_then(|()| l.sync_all()));
                match emptied {
                    Ok(()) => f.log_len = 0,
                    Err(e) => {
                        tracing::warn!(file = %log.display(), error = %e, "could not empty the metadata log")
                    }
                }
            }
            return Ok(());
        }
        let mut line = serde_json::to_vec(changes).map_err(|e| MetaError::Invalid {
            path: f.path.clone(),
            reason: e.to_string(),
        })?;
        line.push(b'\n');
        let log = log_path(&f.path);
        let io = |source| MetaError::Io {
            path: log.clone(),
            source,
        };
        if f.log.is_none() {
            let file = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&log)
                .map_err(io)?;
            // Whatever a failed append left past the last whole line goes.
            if file.metadata().map_err(io)?.len() > f.log_len {
                file.set_len(f.log_len).map_err(io)?;
            }
            // Its name made durable before anything in it counts.
            sync_parent(&log).map_err(io)?;
            f.log = Some(file);
        }
        let at = f.log_len;
        let written = f.log.as_ref().map_or(Ok(()), |file| {
            std::os::unix::fs::FileExt::write_all_at(file, &line, at)
                .and_then(|()| file.sync_data())
        });
        if let Err(e) = written {
            // What may have reached the file past `at` is cut off when the
            // log is opened again, for the next append (or at start, as a
            // torn line).
            f.log = None;
            return Err(io(e));
        }
        f.log_len += line.len() as u64;
        for change in changes {
            f.defs.apply(change);
        }
        Ok(())
    }
}

/// Fsyncs the directory holding `path`.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::File::open(dir)?.sync_all()
}

/// Writes `defs` to `path` atomically and durably: a temporary file,
/// fsynced, renamed over it, then the directory fsynced. Returns its size.
fn write_definitions(path: &Path, defs: &Definitions) -> Result<u64, MetaError> {
    let io = |path: &Path, source| MetaError::Io {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(defs).map_err(|e| MetaError::Invalid {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let mut f = fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(&bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| io(path, e))?;
    sync_parent(path).map_err(|e| io(path, e))?;
    Ok(bytes.len() as u64)
}

impl MetadataStore for FileStore {
    fn load(&self) -> Definitions {
        lock_file(&self.file).defs.clone()
    }

    fn apply(&mut self, change: Change) -> Result<(), MetaError> {
        // A change the file did not take (a full disk) is not kept either:
        // the client was told it failed, and the next write must not carry
        // it to the file after all.
        FileCommitter {
            file: Arc::clone(&self.file),
        }
        .commit(&[change])
    }

    fn defers(&self) -> bool {
        self.deferred
    }

    fn defers_all(&self) -> bool {
        self.deferred
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The changes that [`Positions`] serves, applied by looking at every
    /// entry, as `apply` did before it; the others as `apply` does.
    fn by_scan(d: &mut Definitions, change: &Change) {
        match change {
            Change::PutExchange(e) => {
                d.exchanges
                    .retain(|x| !(x.vhost == e.vhost && x.name == e.name));
                d.exchanges.push(e.clone());
            }
            Change::DeleteExchange { vhost, name } => {
                d.exchanges
                    .retain(|x| !(&x.vhost == vhost && &x.name == name));
                d.bindings.retain(|b| {
                    !(&b.vhost == vhost
                        && (&b.source == name
                            || (b.destination_is_exchange && &b.destination == name)))
                });
            }
            Change::PutQueue(q) => {
                d.queues
                    .retain(|x| !(x.vhost == q.vhost && x.name == q.name));
                d.queues.push(q.clone());
            }
            Change::DeleteQueue { vhost, name } => {
                d.queues.retain(|x| !(&x.vhost == vhost && &x.name == name));
                d.bindings.retain(|b| {
                    !(&b.vhost == vhost && !b.destination_is_exchange && &b.destination == name)
                });
            }
            Change::PutBinding(b) => {
                if !d.bindings.contains(b) {
                    d.bindings.push(b.clone());
                }
            }
            Change::DeleteBinding(b) => d.bindings.retain(|x| x != b),
            other => d.apply(other),
        }
    }

    /// Thousands of seeded random changes (those a broker makes) leave the
    /// same definitions applied through the positions as by scanning.
    #[test]
    fn positions_apply_changes_as_a_scan_does() {
        use rand::SeedableRng;
        for seed in 0..8 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let (mut indexed, mut scanned) = (Definitions::default(), Definitions::default());
            for step in 0..2_000 {
                let c = crate::conformance::change(&mut rng, &scanned);
                indexed.apply(&c);
                by_scan(&mut scanned, &c);
                assert_eq!(
                    crate::conformance::normalised(&indexed),
                    crate::conformance::normalised(&scanned),
                    "seed {seed}, step {step}, after {c:?}"
                );
            }
        }
    }

    #[test]
    fn file_store_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.json");
        let mut s = FileStore::open(&path).unwrap();
        s.apply(Change::PutVhost("/".into())).unwrap();
        s.apply(Change::PutQueue(QueueDef {
            vhost: "/".into(),
            name: "q".into(),
            durable: true,
            master: None,
            auto_delete: false,
            exclusive: false,
            arguments: FieldTable::default(),
        }))
        .unwrap();
        s.apply(Change::PutBinding(BindingDef {
            vhost: "/".into(),
            source: "amq.direct".into(),
            destination: "q".into(),
            destination_is_exchange: false,
            routing_key: "k".into(),
            arguments: FieldTable::default(),
        }))
        .unwrap();
        let s2 = FileStore::open(&path).unwrap();
        assert_eq!(s2.load(), s.load());
        let mut s3 = s2;
        s3.apply(Change::DeleteQueue {
            vhost: "/".into(),
            name: "q".into(),
        })
        .unwrap();
        let d = FileStore::open(&path).unwrap().load();
        assert!(d.queues.is_empty() && d.bindings.is_empty());
        assert_eq!(d.vhosts, vec!["/".to_string()]);
    }

    #[test]
    fn a_change_the_file_did_not_take_is_not_written_later() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.json");
        let mut s = FileStore::open(&path).unwrap();
        s.apply(Change::PutVhost("/".into())).unwrap();
        // The log cannot be written: its name is a directory.
        let log = path.with_extension("log");
        fs::create_dir(&log).unwrap();
        assert!(s.apply(queue("refused")).is_err());
        let before = s.load();
        assert!(!before.queues.iter().any(|q| q.name == "refused"));
        fs::remove_dir(&log).unwrap();
        s.apply(queue("taken")).unwrap();
        let names: Vec<String> = FileStore::open(&path)
            .unwrap()
            .load()
            .queues
            .into_iter()
            .map(|q| q.name)
            .collect();
        assert_eq!(names, ["taken"]);
    }

    #[test]
    fn a_committer_writes_batches_and_a_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("defs").join("meta.json");
        let mut s = FileStore::open(&path).unwrap();
        assert!(!s.defers() && !s.defers_all());
        let committer = s.committer();
        assert!(s.defers() && s.defers_all(), "handed to the shell");
        let batch = [
            Change::PutVhost("v".into()),
            Change::PutVhost("w".into()),
            Change::DeleteVhost("v".into()),
        ];
        // The file's directory is gone: the write fails, nothing changes.
        fs::remove_dir_all(dir.path().join("defs")).unwrap();
        assert!(committer.commit(&batch).is_err());
        assert!(s.load().vhosts.is_empty());
        // Tried again once it can be written: the whole batch, in order.
        fs::create_dir_all(dir.path().join("defs")).unwrap();
        committer.commit(&batch).unwrap();
        assert_eq!(s.load().vhosts, vec!["w".to_owned()]);
        assert_eq!(
            FileStore::open(&path).unwrap().load().vhosts,
            vec!["w".to_owned()]
        );
    }

    fn queue(name: &str) -> Change {
        Change::PutQueue(QueueDef {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            master: None,
            auto_delete: false,
            exclusive: false,
            arguments: FieldTable::default(),
        })
    }

    fn names(s: &FileStore) -> Vec<String> {
        s.load().queues.into_iter().map(|q| q.name).collect()
    }

    #[test]
    fn changes_are_logged_and_replayed_and_a_torn_last_line_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let log = dir.path().join("metadata.log");
        let mut s = FileStore::open(&path).unwrap();
        // The first change writes the snapshot; the next ones the log.
        s.apply(Change::PutVhost("/".into())).unwrap();
        assert!(path.exists() && !log.exists());
        let committer = s.committer();
        committer.commit(&[queue("a"), queue("b")]).unwrap();
        committer
            .commit(&[Change::DeleteQueue {
                vhost: "/".into(),
                name: "a".into(),
            }])
            .unwrap();
        let logged = fs::read(&log).unwrap();
        assert_eq!(logged.iter().filter(|&&b| b == b'\n').count(), 2);
        assert_eq!(names(&FileStore::open(&path).unwrap()), ["b"]);
        // A crash in an append: half a line. It is cut, the rest kept.
        let mut torn = logged.clone();
        torn.extend_from_slice(br#"[{"PutQueue":{"vhost":"/","na"#);
        fs::write(&log, &torn).unwrap();
        let reopened = FileStore::open(&path).unwrap();
        assert_eq!(names(&reopened), ["b"]);
        assert_eq!(fs::read(&log).unwrap(), logged, "the torn line is cut off");
        // A bad line before the last is corruption, not a torn write.
        let mut bad = b"not json\n".to_vec();
        bad.extend_from_slice(&logged);
        fs::write(&log, &bad).unwrap();
        assert!(matches!(
            FileStore::open(&path),
            Err(MetaError::Invalid { .. })
        ));
    }

    #[test]
    fn a_log_larger_than_the_snapshot_is_folded_into_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let log = dir.path().join("metadata.log");
        let mut s = FileStore::open(&path).unwrap();
        let committer = s.committer();
        committer.commit(&[Change::PutVhost("/".into())]).unwrap();
        let mut folded = false;
        for batch in 0..120 {
            let queues: Vec<Change> = (0..100).map(|i| queue(&format!("q{batch}.{i}"))).collect();
            committer.commit(&queues).unwrap();
            folded |= batch > 0 && fs::metadata(&log).map_or(0, |m| m.len()) == 0;
        }
        assert!(folded, "the log was never folded into the snapshot");
        assert_eq!(FileStore::open(&path).unwrap().load(), s.load());
        assert_eq!(s.load().queues.len(), 12_000);
    }

    #[test]
    fn a_log_replayed_onto_the_snapshot_that_holds_it_changes_nothing() {
        // A crash after a new snapshot, before its log was emptied.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let mut s = FileStore::open(&path).unwrap();
        let committer = s.committer();
        committer.commit(&[Change::PutVhost("/".into())]).unwrap();
        let exchange = |name: &str| {
            Change::PutExchange(ExchangeDef {
                vhost: "/".into(),
                name: name.into(),
                kind: "direct".into(),
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: FieldTable::default(),
            })
        };
        let binding = BindingDef {
            vhost: "/".into(),
            source: "x".into(),
            destination: "q".into(),
            destination_is_exchange: false,
            routing_key: "k".into(),
            arguments: FieldTable::default(),
        };
        for batch in [
            vec![
                exchange("x"),
                queue("q"),
                Change::PutBinding(binding.clone()),
            ],
            vec![Change::DeleteQueue {
                vhost: "/".into(),
                name: "q".into(),
            }],
            vec![queue("q"), Change::PutVhost("v".into())],
            vec![Change::DeleteVhost("v".into())],
        ] {
            committer.commit(&batch).unwrap();
        }
        let log = fs::read(dir.path().join("metadata.log")).unwrap();
        let want = s.load();
        write_definitions(&path, &want).unwrap();
        let replayed = FileStore::open(&path).unwrap().load();
        assert_eq!(replayed, want);
        assert!(!log.is_empty());
    }
}
