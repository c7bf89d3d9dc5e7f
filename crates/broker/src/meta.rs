//! Durable entities (vhosts, users, permissions, durable exchanges, queues
//! and bindings) behind [`MetadataStore`], with a file-backed implementation.
//!
//! A clustered node (`warren --peer-addr …`) implements the same trait over
//! the Raft-replicated cluster metadata.

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
/// and not exclusive.
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
    /// Declare arguments (`x-message-ttl`, …).
    pub arguments: FieldTable,
}

fn yes() -> bool {
    true
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
                self.exchanges
                    .retain(|x| !(x.vhost == e.vhost && x.name == e.name));
                self.exchanges.push(e.clone());
            }
            Change::DeleteExchange { vhost, name } => {
                self.exchanges
                    .retain(|x| !(&x.vhost == vhost && &x.name == name));
                self.bindings.retain(|b| {
                    !(&b.vhost == vhost
                        && (&b.source == name
                            || (b.destination_is_exchange && &b.destination == name)))
                });
            }
            Change::PutQueue(q) => {
                self.queues
                    .retain(|x| !(x.vhost == q.vhost && x.name == q.name));
                self.queues.push(q.clone());
            }
            Change::DeleteQueue { vhost, name } => {
                self.queues
                    .retain(|x| !(&x.vhost == vhost && &x.name == name));
                self.bindings.retain(|b| {
                    !(&b.vhost == vhost && !b.destination_is_exchange && &b.destination == name)
                });
            }
            Change::PutBinding(b) => {
                if !self.bindings.contains(b) {
                    self.bindings.push(b.clone());
                }
            }
            Change::DeleteBinding(b) => self.bindings.retain(|x| x != b),
            Change::DeleteVhost(v) => {
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
    /// Tells every node of a change to a transient entity (a non-durable,
    /// non-exclusive queue or exchange, or a binding with such an end),
    /// which RabbitMQ shares across its cluster but forgets on restart.
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

/// A JSON snapshot file, rewritten atomically (write, fsync, rename, fsync
/// the directory) on every change, or on every batch of changes once its
/// writes are handed to the shell ([`committer`](Self::committer)).
#[derive(Debug)]
pub struct FileStore {
    file: Arc<Mutex<DefinitionsFile>>,
    /// The shell commits the changes, off the broker's lock.
    deferred: bool,
}

/// The file and what it holds.
#[derive(Debug)]
struct DefinitionsFile {
    path: PathBuf,
    defs: Definitions,
}

impl FileStore {
    /// Opens (or starts empty) the store at `path`.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, MetaError> {
        let path = path.into();
        let io = |source| MetaError::Io {
            path: path.clone(),
            source,
        };
        let defs = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| MetaError::Invalid {
                path: path.clone(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Definitions::default(),
            Err(e) => return Err(io(e)),
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io)?;
        }
        Ok(Self {
            file: Arc::new(Mutex::new(DefinitionsFile { path, defs })),
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

    fn file(&self) -> std::sync::MutexGuard<'_, DefinitionsFile> {
        self.file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Writes a [`FileStore`]'s changes, off the broker's lock.
#[derive(Debug, Clone)]
pub struct FileCommitter {
    file: Arc<Mutex<DefinitionsFile>>,
}

impl FileCommitter {
    /// Applies `changes` in order and writes the file once. A write that
    /// fails changes nothing: the same changes may be committed again.
    /// The store's readers never wait for the disk: the file is written
    /// from a copy, which replaces the definitions once it is durable.
    pub fn commit(&self, changes: &[Change]) -> Result<(), MetaError> {
        let (path, mut defs) = {
            let f = self
                .file
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (f.path.clone(), f.defs.clone())
        };
        for change in changes {
            defs.apply(change);
        }
        write_definitions(&path, &defs)?;
        self.file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .defs = defs;
        Ok(())
    }
}

/// Writes `defs` to `path` atomically and durably: a temporary file,
/// fsynced, renamed over it, then the directory fsynced.
fn write_definitions(path: &Path, defs: &Definitions) -> Result<(), MetaError> {
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
    if let Some(dir) = path.parent() {
        let d = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        fs::File::open(d)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(d, e))?;
    }
    Ok(())
}

impl MetadataStore for FileStore {
    fn load(&self) -> Definitions {
        self.file().defs.clone()
    }

    fn apply(&mut self, change: Change) -> Result<(), MetaError> {
        // A change the file did not take (a full disk) is not kept either:
        // the client was told it failed, and the next write must not carry
        // it to the file after all.
        let mut f = self.file();
        let mut defs = f.defs.clone();
        defs.apply(&change);
        write_definitions(&f.path, &defs)?;
        f.defs = defs;
        Ok(())
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
        let queue = |name: &str| {
            Change::PutQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable: true,
                master: None,
                auto_delete: false,
                arguments: FieldTable::default(),
            })
        };
        // The file cannot be written: its temporary's name is a directory.
        let tmp = path.with_extension("json.tmp");
        fs::create_dir(&tmp).unwrap();
        assert!(s.apply(queue("refused")).is_err());
        let before = s.load();
        assert!(!before.queues.iter().any(|q| q.name == "refused"));
        fs::remove_dir(&tmp).unwrap();
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
}
