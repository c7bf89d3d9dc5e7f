//! The metadata state machine: what the cluster knows, and the typed commands
//! that change it.
//!
//! [`Metadata::apply`] is a pure function of the current state and one
//! command (no clock, no I/O), so every replica that applies the same log
//! reaches the same state. Commands never fail at the Raft level: a command
//! that does not fit the state (a stale view version, an unknown queue) is
//! *rejected* in its [`CommandResponse`] and changes nothing.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use warren_policy::PolicySpec;

/// A Raft log index.
pub type LogIndex = u64;

/// A value in AMQP arguments (a field table), in a form every replica stores alike.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ArgValue {
    /// No value.
    Void,
    /// A boolean.
    Bool(bool),
    /// Any integer.
    Int(i64),
    /// A string (long or short).
    Str(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// A list.
    #[serde(deserialize_with = "nested")]
    List(Vec<ArgValue>),
    /// A nested table.
    #[serde(deserialize_with = "nested")]
    Table(BTreeMap<String, ArgValue>),
}

/// The deepest nesting of lists and tables inside [`Arguments`] that a
/// decoder accepts (AMQP clients are held to 32 levels, one fewer than this
/// counts): a peer's bytes can never make decoding recurse without bound.
pub const MAX_ARG_DEPTH: usize = 32;

std::thread_local! {
    /// How many lists and tables the decoder on this thread is inside.
    static ARG_DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Decodes a list or table inside an argument value, one level deeper;
/// refuses to go deeper than [`MAX_ARG_DEPTH`].
fn nested<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            ARG_DEPTH.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    let depth = ARG_DEPTH.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    let _leave = Leave;
    if depth > MAX_ARG_DEPTH {
        return Err(serde::de::Error::custom(format!(
            "arguments nested deeper than {MAX_ARG_DEPTH} levels"
        )));
    }
    T::deserialize(d)
}

/// AMQP arguments: a sorted field table.
pub type Arguments = BTreeMap<String, ArgValue>;

/// A cluster member as the metadata store records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's name (`warren@host`).
    pub name: String,
    /// The address it listens on for peers.
    pub peer_addr: String,
    /// The Raft log index of the membership change that first added it.
    pub joined_at: LogIndex,
    /// Where its GM node listens for queue rings (set by the node once its
    /// rings run: a Warren node's peer address, where they share the port).
    #[serde(default)]
    pub ring_addr: Option<String>,
    /// Where it listens for forwarded queue work (set by the node once its
    /// links run: a Warren node's peer address, where they share the port).
    #[serde(default)]
    pub link_addr: Option<String>,
    /// Its client-facing listeners (AMQP, AMQPS, management HTTP,
    /// Prometheus), as the node recorded them once listening; what the
    /// management API lists for the whole cluster.
    #[serde(default)]
    pub listeners: Vec<Listener>,
}

/// One client-facing listener of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listener {
    /// RabbitMQ's protocol name: `amqp`, `amqp/ssl`, `http`,
    /// `http/prometheus`.
    pub protocol: String,
    /// The address it is bound to, `IP:PORT`.
    pub addr: String,
}

/// A user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRecord {
    /// The user name.
    pub name: String,
    /// The password hash (opaque here; the broker hashes and checks).
    pub password_hash: String,
    /// Tags such as `administrator`.
    pub tags: Vec<String>,
}

/// A user's permissions in one vhost (regexes, as in RabbitMQ).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permissions {
    /// Resources the user may configure.
    pub configure: String,
    /// Resources the user may write to.
    pub write: String,
    /// Resources the user may read from.
    pub read: String,
}

/// A policy as stored: [`PolicySpec`] with its definition kept as JSON text
/// (so that every encoding of the log can carry it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRecord {
    /// The vhost.
    pub vhost: String,
    /// The policy name.
    pub name: String,
    /// The regex over entity names.
    pub pattern: String,
    /// `apply-to`, in its JSON spelling (`all`, `queues`, …).
    pub apply_to: String,
    /// Higher wins.
    pub priority: i64,
    /// The definition, as a JSON object's text.
    pub definition: String,
}

impl PolicyRecord {
    /// Stores a policy spec.
    pub fn from_spec(spec: &PolicySpec) -> Self {
        let apply_to = serde_json::to_value(spec.apply_to)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "all".to_owned());
        Self {
            vhost: spec.vhost.clone(),
            name: spec.name.clone(),
            pattern: spec.pattern.clone(),
            apply_to,
            priority: spec.priority,
            definition: spec.definition.to_string(),
        }
    }

    /// The policy spec back, for validation and matching by `warren-policy`.
    pub fn to_spec(&self) -> Result<PolicySpec, serde_json::Error> {
        let definition: serde_json::Value = serde_json::from_str(&self.definition)?;
        serde_json::from_value(serde_json::json!({
            "vhost": self.vhost,
            "name": self.name,
            "pattern": self.pattern,
            "apply-to": self.apply_to,
            "priority": self.priority,
            "definition": definition,
        }))
    }
}

/// An exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExchangeRecord {
    /// The vhost.
    pub vhost: String,
    /// The exchange name.
    pub name: String,
    /// The type (`direct`, `fanout`, `topic`, `headers`).
    pub kind: String,
    /// Survives a restart.
    pub durable: bool,
    /// Deleted when its last binding goes.
    pub auto_delete: bool,
    /// Clients cannot publish to it directly.
    pub internal: bool,
    /// Declaration arguments.
    pub arguments: Arguments,
}

/// What a binding routes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DestinationKind {
    /// A queue.
    Queue,
    /// An exchange (exchange-to-exchange binding).
    Exchange,
}

/// A binding from an exchange to a queue or exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingRecord {
    /// The vhost.
    pub vhost: String,
    /// The source exchange.
    pub source: String,
    /// The destination's kind.
    pub destination_kind: DestinationKind,
    /// The destination's name.
    pub destination: String,
    /// The routing key.
    pub routing_key: String,
    /// Binding arguments.
    pub arguments: Arguments,
}

/// A queue: its declaration and where its master and mirrors live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRecord {
    /// The vhost.
    pub vhost: String,
    /// The queue name.
    pub name: String,
    /// Survives a restart.
    pub durable: bool,
    /// The owning connection of an exclusive queue (never mirrored).
    pub exclusive_owner: Option<String>,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// Declaration arguments.
    pub arguments: Arguments,
    /// The node of the queue master.
    pub master: String,
    /// Mirror nodes, oldest first (join order).
    pub mirrors: Vec<String>,
    /// The synchronised subset of `mirrors`, in join order.
    pub synchronised: Vec<String>,
    /// The version of the queue's ring view; grows by one at every change of
    /// master or mirrors.
    pub view_version: u64,
    /// Which declaration of this name the record is: set when the queue is
    /// created (the metadata's count of queues declared so far), so a queue
    /// deleted and declared again is told apart from its predecessor.
    pub serial: u64,
}

impl QueueRecord {
    /// The name of this queue's GM ring: one per declaration, so the
    /// members of a deleted queue never meet those of its successor.
    #[must_use]
    pub fn ring(&self) -> String {
        format!(
            "queue:{}:{}/{}#{}",
            self.vhost.len(),
            self.vhost,
            self.name,
            self.serial
        )
    }
}

/// A queue's placement: master, mirrors and synchronised mirrors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueView {
    /// The master's node.
    pub master: String,
    /// Mirror nodes in join order.
    pub mirrors: Vec<String>,
    /// Synchronised mirrors (a subset of `mirrors`).
    pub synchronised: Vec<String>,
}

/// A typed change to the metadata. Applied in log order on every replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Command {
    /// Creates a vhost (no-op if it exists).
    PutVhost {
        /// The vhost name.
        name: String,
    },
    /// Deletes a vhost and everything in it.
    DeleteVhost {
        /// The vhost name.
        name: String,
    },
    /// Creates or replaces a user.
    PutUser(UserRecord),
    /// Deletes a user and its permissions.
    DeleteUser {
        /// The user name.
        name: String,
    },
    /// Sets a user's permissions in a vhost.
    SetPermissions {
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
        /// The permissions.
        permissions: Permissions,
    },
    /// Clears a user's permissions in a vhost.
    ClearPermissions {
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
    },
    /// Creates or replaces a policy.
    PutPolicy(PolicyRecord),
    /// Deletes a policy.
    DeletePolicy {
        /// The vhost.
        vhost: String,
        /// The policy name.
        name: String,
    },
    /// Declares an exchange; an existing one is left as it is and returned.
    DeclareExchange(ExchangeRecord),
    /// Deletes an exchange and its bindings.
    DeleteExchange {
        /// The vhost.
        vhost: String,
        /// The exchange name.
        name: String,
    },
    /// Adds a binding (no-op if present).
    Bind(BindingRecord),
    /// Removes a binding.
    Unbind(BindingRecord),
    /// Declares a queue; an existing one is left as it is and returned.
    /// A new queue's view version is 1.
    DeclareQueue(QueueRecord),
    /// Deletes a queue (and its bindings) if its view is at `expected_version`
    /// (or unconditionally when `None`).
    DeleteQueue {
        /// The vhost.
        vhost: String,
        /// The queue name.
        name: String,
        /// Compare-and-set guard on the view version.
        expected_version: Option<u64>,
    },
    /// Compare-and-set on a queue's view: replaces master, mirrors and
    /// synchronised mirrors if the view is still at `expected_version`; the
    /// version then grows by one. A queue of another `serial` (declared
    /// again since) is refused as no queue.
    SetQueueView {
        /// The vhost.
        vhost: String,
        /// The queue name.
        name: String,
        /// The declaration the proposer speaks of ([`QueueRecord::serial`]).
        serial: u64,
        /// The version the proposer based its change on.
        expected_version: u64,
        /// The new placement.
        view: QueueView,
    },
    /// Compare-and-set on a GM ring's view, stored opaque (the ring's own
    /// encoding): replaces it if the ring is at `expected_version`; the ring
    /// is then at `expected_version + 1`. A ring never set is at version 0.
    /// This is what a GM `ViewAuthority` is backed by.
    SetRingView {
        /// The ring's name.
        ring: String,
        /// The version the proposer based its change on.
        expected_version: u64,
        /// The new view, encoded by its owner.
        view: Vec<u8>,
    },
    /// Drops a ring's view (when its queue is deleted).
    DeleteRingView {
        /// The ring's name.
        ring: String,
    },
    /// Records where a member node listens for queue rings and for
    /// forwarded queue work.
    SetNodeServices {
        /// The node.
        node: String,
        /// Its GM (ring) listener's address.
        ring_addr: String,
        /// Its forwarding listener's address.
        link_addr: String,
    },
    /// Records a member node's client-facing listeners.
    SetNodeListeners {
        /// The node.
        node: String,
        /// Its listeners.
        listeners: Vec<Listener>,
    },
    /// Several commands in one log entry, applied in order, each as if it
    /// were an entry of its own (one's rejection changes nothing for the
    /// others); answered with [`Outcome::Batch`]. A node's pending metadata
    /// changes go to the log together this way.
    Batch(Vec<Command>),
}

/// A GM ring's view as the metadata store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingRecord {
    /// The view's version.
    pub version: u64,
    /// The view, encoded by the ring's owner.
    pub view: Vec<u8>,
}

/// Why a command changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The vhost does not exist.
    #[error("no vhost {0:?}")]
    NoVhost(String),
    /// The user does not exist.
    #[error("no user {0:?}")]
    NoUser(String),
    /// The node is not a cluster member.
    #[error("no node {0:?} in the cluster")]
    NoNode(String),
    /// The queue does not exist.
    #[error("no queue {name:?} in vhost {vhost:?}")]
    NoQueue {
        /// The vhost.
        vhost: String,
        /// The queue.
        name: String,
    },
    /// The exchange does not exist.
    #[error("no exchange {name:?} in vhost {vhost:?}")]
    NoExchange {
        /// The vhost.
        vhost: String,
        /// The exchange.
        name: String,
    },
    /// A compare-and-set lost: the view moved on.
    #[error("view conflict: expected version {expected}, current is {current}")]
    ViewConflict {
        /// The version the proposer expected.
        expected: u64,
        /// The current version.
        current: u64,
    },
    /// The proposed view is malformed (a synchronised node that is not a
    /// mirror, the master listed as a mirror, or a duplicate).
    #[error("invalid queue view: {0}")]
    InvalidView(String),
    /// An exclusive queue cannot have mirrors.
    #[error("exclusive queues are never mirrored")]
    ExclusiveMirrored,
}

/// What applying a command produced.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Outcome {
    /// Applied; nothing to return.
    #[default]
    Done,
    /// A queue record (after declare or view change; on declare, the existing
    /// record if there was one).
    Queue(QueueRecord),
    /// An exchange record (after declare; the existing one if there was one).
    Exchange(ExchangeRecord),
    /// A ring's view after a successful compare-and-set.
    Ring(RingRecord),
    /// The command was a no-op because the thing already existed or was absent.
    Unchanged,
    /// A [`Command::Batch`]'s commands' results, in its order.
    Batch(Vec<Result<Outcome, Rejection>>),
}

/// The state machine's answer to one log entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResponse {
    /// The outcome, or why nothing changed.
    pub result: Result<Outcome, Rejection>,
}

impl Default for CommandResponse {
    fn default() -> Self {
        Self {
            result: Ok(Outcome::Done),
        }
    }
}

/// The whole replicated metadata: the state machine's state.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Metadata {
    /// Cluster members by name (from Raft membership; see [`Metadata::apply_membership`]).
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Vhost names.
    pub vhosts: BTreeSet<String>,
    /// Users by name.
    pub users: BTreeMap<String, UserRecord>,
    /// Permissions by (vhost, user).
    pub permissions: BTreeMap<(String, String), Permissions>,
    /// Policies by (vhost, name).
    pub policies: BTreeMap<(String, String), PolicyRecord>,
    /// Exchanges by (vhost, name).
    pub exchanges: BTreeMap<(String, String), ExchangeRecord>,
    /// Bindings, in a canonical order.
    pub bindings: Vec<BindingRecord>,
    /// Queues by (vhost, name).
    pub queues: imbl::OrdMap<(String, String), QueueRecord>,
    /// GM ring views by ring name.
    pub rings: imbl::OrdMap<String, RingRecord>,
    /// Queues declared so far (the last [`QueueRecord::serial`] given).
    pub queues_declared: u64,
}

fn key(vhost: &str, name: &str) -> (String, String) {
    (vhost.to_owned(), name.to_owned())
}

fn check_view(view: &QueueView, exclusive: bool) -> Result<(), Rejection> {
    if exclusive && !view.mirrors.is_empty() {
        return Err(Rejection::ExclusiveMirrored);
    }
    let mut seen = BTreeSet::new();
    for m in &view.mirrors {
        if m == &view.master {
            return Err(Rejection::InvalidView(format!(
                "the master {m} is also listed as a mirror"
            )));
        }
        if !seen.insert(m) {
            return Err(Rejection::InvalidView(format!(
                "mirror {m} is listed twice"
            )));
        }
    }
    let mut synced = BTreeSet::new();
    for s in &view.synchronised {
        if !seen.contains(s) {
            return Err(Rejection::InvalidView(format!(
                "synchronised node {s} is not a mirror"
            )));
        }
        if !synced.insert(s) {
            return Err(Rejection::InvalidView(format!(
                "synchronised node {s} is listed twice"
            )));
        }
    }
    Ok(())
}

/// The exchanges every vhost has from its creation (RabbitMQ's `amq.*`;
/// the broker's `builtin_exchanges` makes them): each node's broker makes
/// them itself, so the metadata holds no record of them, yet bindings name
/// them.
pub const BUILTIN_EXCHANGES: [&str; 5] = [
    "amq.direct",
    "amq.fanout",
    "amq.topic",
    "amq.headers",
    "amq.match",
];

impl Metadata {
    /// Whether exchange `name` exists in `vhost`: declared, or built in.
    fn has_exchange(&self, vhost: &str, name: &str) -> bool {
        self.exchanges.contains_key(&key(vhost, name))
            || (BUILTIN_EXCHANGES.contains(&name) && self.vhosts.contains(vhost))
    }

    /// Applies one command; rejected commands change nothing.
    pub fn apply(&mut self, cmd: &Command) -> CommandResponse {
        CommandResponse {
            result: self.apply_inner(cmd),
        }
    }

    fn apply_inner(&mut self, cmd: &Command) -> Result<Outcome, Rejection> {
        match cmd {
            Command::Batch(cmds) => Ok(Outcome::Batch(
                cmds.iter().map(|c| self.apply_inner(c)).collect(),
            )),
            Command::PutVhost { name } => Ok(if self.vhosts.insert(name.clone()) {
                Outcome::Done
            } else {
                Outcome::Unchanged
            }),
            Command::DeleteVhost { name } => {
                if !self.vhosts.remove(name) {
                    return Err(Rejection::NoVhost(name.clone()));
                }
                self.permissions.retain(|(v, _), _| v != name);
                self.policies.retain(|(v, _), _| v != name);
                self.exchanges.retain(|(v, _), _| v != name);
                let gone: Vec<_> = self
                    .queues
                    .keys()
                    .filter(|(v, _)| v == name)
                    .cloned()
                    .collect();
                for k in gone {
                    if let Some(q) = self.queues.remove(&k) {
                        self.rings.remove(&q.ring());
                    }
                }
                self.bindings.retain(|b| &b.vhost != name);
                Ok(Outcome::Done)
            }
            Command::PutUser(user) => {
                self.users.insert(user.name.clone(), user.clone());
                Ok(Outcome::Done)
            }
            Command::DeleteUser { name } => {
                if self.users.remove(name).is_none() {
                    return Err(Rejection::NoUser(name.clone()));
                }
                self.permissions.retain(|(_, u), _| u != name);
                Ok(Outcome::Done)
            }
            Command::SetPermissions {
                vhost,
                user,
                permissions,
            } => {
                if !self.vhosts.contains(vhost) {
                    return Err(Rejection::NoVhost(vhost.clone()));
                }
                if !self.users.contains_key(user) {
                    return Err(Rejection::NoUser(user.clone()));
                }
                self.permissions
                    .insert(key(vhost, user), permissions.clone());
                Ok(Outcome::Done)
            }
            Command::ClearPermissions { vhost, user } => {
                Ok(match self.permissions.remove(&key(vhost, user)) {
                    Some(_) => Outcome::Done,
                    None => Outcome::Unchanged,
                })
            }
            Command::PutPolicy(p) => {
                if !self.vhosts.contains(&p.vhost) {
                    return Err(Rejection::NoVhost(p.vhost.clone()));
                }
                self.policies.insert(key(&p.vhost, &p.name), p.clone());
                Ok(Outcome::Done)
            }
            Command::DeletePolicy { vhost, name } => {
                Ok(match self.policies.remove(&key(vhost, name)) {
                    Some(_) => Outcome::Done,
                    None => Outcome::Unchanged,
                })
            }
            Command::DeclareExchange(x) => {
                if !self.vhosts.contains(&x.vhost) {
                    return Err(Rejection::NoVhost(x.vhost.clone()));
                }
                let entry = self
                    .exchanges
                    .entry(key(&x.vhost, &x.name))
                    .or_insert_with(|| x.clone());
                Ok(Outcome::Exchange(entry.clone()))
            }
            Command::DeleteExchange { vhost, name } => {
                if self.exchanges.remove(&key(vhost, name)).is_none() {
                    return Err(Rejection::NoExchange {
                        vhost: vhost.clone(),
                        name: name.clone(),
                    });
                }
                self.bindings.retain(|b| {
                    !(&b.vhost == vhost
                        && (&b.source == name
                            || (b.destination_kind == DestinationKind::Exchange
                                && &b.destination == name)))
                });
                Ok(Outcome::Done)
            }
            Command::Bind(b) => {
                if !self.has_exchange(&b.vhost, &b.source) {
                    return Err(Rejection::NoExchange {
                        vhost: b.vhost.clone(),
                        name: b.source.clone(),
                    });
                }
                let dest_exists = match b.destination_kind {
                    DestinationKind::Queue => {
                        self.queues.contains_key(&key(&b.vhost, &b.destination))
                    }
                    DestinationKind::Exchange => self.has_exchange(&b.vhost, &b.destination),
                };
                if !dest_exists {
                    return Err(match b.destination_kind {
                        DestinationKind::Queue => Rejection::NoQueue {
                            vhost: b.vhost.clone(),
                            name: b.destination.clone(),
                        },
                        DestinationKind::Exchange => Rejection::NoExchange {
                            vhost: b.vhost.clone(),
                            name: b.destination.clone(),
                        },
                    });
                }
                if self.bindings.contains(b) {
                    return Ok(Outcome::Unchanged);
                }
                self.bindings.push(b.clone());
                Ok(Outcome::Done)
            }
            Command::Unbind(b) => {
                let before = self.bindings.len();
                self.bindings.retain(|x| x != b);
                Ok(if self.bindings.len() < before {
                    Outcome::Done
                } else {
                    Outcome::Unchanged
                })
            }
            Command::DeclareQueue(q) => {
                if !self.vhosts.contains(&q.vhost) {
                    return Err(Rejection::NoVhost(q.vhost.clone()));
                }
                if let Some(existing) = self.queues.get(&key(&q.vhost, &q.name)) {
                    return Ok(Outcome::Queue(existing.clone()));
                }
                let view = QueueView {
                    master: q.master.clone(),
                    mirrors: q.mirrors.clone(),
                    synchronised: q.synchronised.clone(),
                };
                check_view(&view, q.exclusive_owner.is_some())?;
                let mut q = q.clone();
                q.view_version = 1;
                self.queues_declared += 1;
                q.serial = self.queues_declared;
                self.queues.insert(key(&q.vhost, &q.name), q.clone());
                Ok(Outcome::Queue(q))
            }
            Command::DeleteQueue {
                vhost,
                name,
                expected_version,
            } => {
                let k = key(vhost, name);
                let Some(q) = self.queues.get(&k) else {
                    return Err(Rejection::NoQueue {
                        vhost: vhost.clone(),
                        name: name.clone(),
                    });
                };
                if let Some(expected) = *expected_version
                    && expected != q.view_version
                {
                    return Err(Rejection::ViewConflict {
                        expected,
                        current: q.view_version,
                    });
                }
                self.remove_queue(&k);
                Ok(Outcome::Done)
            }
            Command::SetQueueView {
                vhost,
                name,
                serial,
                expected_version,
                view,
            } => {
                let found = self.queues.get_mut(&key(vhost, name));
                let Some(q) = found.filter(|q| q.serial == *serial) else {
                    return Err(Rejection::NoQueue {
                        vhost: vhost.clone(),
                        name: name.clone(),
                    });
                };
                if q.view_version != *expected_version {
                    return Err(Rejection::ViewConflict {
                        expected: *expected_version,
                        current: q.view_version,
                    });
                }
                check_view(view, q.exclusive_owner.is_some())?;
                q.master = view.master.clone();
                q.mirrors = view.mirrors.clone();
                q.synchronised = view.synchronised.clone();
                q.view_version += 1;
                Ok(Outcome::Queue(q.clone()))
            }
            Command::SetRingView {
                ring,
                expected_version,
                view,
            } => {
                let current = self.rings.get(ring).map_or(0, |r| r.version);
                if current != *expected_version {
                    return Err(Rejection::ViewConflict {
                        expected: *expected_version,
                        current,
                    });
                }
                let rec = RingRecord {
                    version: current + 1,
                    view: view.clone(),
                };
                self.rings.insert(ring.clone(), rec.clone());
                Ok(Outcome::Ring(rec))
            }
            Command::DeleteRingView { ring } => Ok(match self.rings.remove(ring) {
                Some(_) => Outcome::Done,
                None => Outcome::Unchanged,
            }),
            Command::SetNodeServices {
                node,
                ring_addr,
                link_addr,
            } => match self.nodes.get_mut(node) {
                Some(n)
                    if n.ring_addr.as_ref() == Some(ring_addr)
                        && n.link_addr.as_ref() == Some(link_addr) =>
                {
                    Ok(Outcome::Unchanged)
                }
                Some(n) => {
                    n.ring_addr = Some(ring_addr.clone());
                    n.link_addr = Some(link_addr.clone());
                    Ok(Outcome::Done)
                }
                None => Err(Rejection::NoNode(node.clone())),
            },
            Command::SetNodeListeners { node, listeners } => match self.nodes.get_mut(node) {
                Some(n) if n.listeners == *listeners => Ok(Outcome::Unchanged),
                Some(n) => {
                    n.listeners.clone_from(listeners);
                    Ok(Outcome::Done)
                }
                None => Err(Rejection::NoNode(node.clone())),
            },
        }
    }

    /// Applies a Raft membership change committed at `index`: new members are
    /// recorded as joined at `index`; members no longer in the membership are
    /// forgotten, and so are their places in queue views (a forgotten master is
    /// replaced by its oldest synchronised mirror, or failing that its oldest
    /// mirror; a queue with no mirror left is deleted, as RabbitMQ's
    /// `forget_cluster_node` does).
    pub fn apply_membership(&mut self, index: LogIndex, members: &BTreeMap<String, String>) {
        self.apply_membership_with(index, members, None);
    }

    /// [`apply_membership`](Self::apply_membership), where a forgotten master
    /// with no mirror left is replaced by `fallback` (a member) rather than
    /// its queue deleted: the offline forget run on a stopped node's data
    /// makes that node serve whatever it still holds (RabbitMQ does the same).
    pub fn apply_membership_with(
        &mut self,
        index: LogIndex,
        members: &BTreeMap<String, String>,
        fallback: Option<&str>,
    ) {
        for (name, addr) in members {
            self.nodes
                .entry(name.clone())
                .and_modify(|n| n.peer_addr.clone_from(addr))
                .or_insert_with(|| NodeRecord {
                    name: name.clone(),
                    peer_addr: addr.clone(),
                    joined_at: index,
                    ring_addr: None,
                    link_addr: None,
                    listeners: Vec::new(),
                });
        }
        let gone: Vec<String> = self
            .nodes
            .keys()
            .filter(|n| !members.contains_key(*n))
            .cloned()
            .collect();
        for node in gone {
            self.nodes.remove(&node);
            let fallback = fallback.filter(|f| members.contains_key(*f));
            self.forget_node_in_queues(&node, fallback);
        }
    }

    fn forget_node_in_queues(&mut self, node: &str, fallback: Option<&str>) {
        let mut deleted = Vec::new();
        let in_view: Vec<_> = self
            .queues
            .iter()
            .filter(|(_, q)| q.master == node || q.mirrors.iter().any(|m| m == node))
            .map(|(k, _)| k.clone())
            .collect();
        for k in in_view {
            let Some(q) = self.queues.get_mut(&k) else {
                continue;
            };
            q.mirrors.retain(|m| m != node);
            q.synchronised.retain(|m| m != node);
            if q.master == node {
                // The oldest synchronised mirror, else the oldest mirror: an
                // explicit forget of the master keeps what a mirror holds
                // (RabbitMQ promotes a stopped mirror here too).
                match q
                    .synchronised
                    .first()
                    .or_else(|| q.mirrors.first())
                    .cloned()
                    .or_else(|| fallback.map(str::to_owned))
                {
                    Some(promoted) => {
                        q.mirrors.retain(|m| m != &promoted);
                        q.synchronised.retain(|m| m != &promoted);
                        q.master = promoted;
                    }
                    None => deleted.push(k),
                }
            }
            q.view_version += 1;
        }
        for k in deleted {
            self.remove_queue(&k);
        }
    }

    /// Removes a queue with its bindings and its ring's view.
    fn remove_queue(&mut self, k: &(String, String)) {
        if let Some(q) = self.queues.remove(k) {
            self.rings.remove(&q.ring());
        }
        self.bindings.retain(|b| {
            !(b.vhost == k.0
                && b.destination_kind == DestinationKind::Queue
                && b.destination == k.1)
        });
    }

    /// A queue's record.
    pub fn queue(&self, vhost: &str, name: &str) -> Option<&QueueRecord> {
        self.queues.get(&key(vhost, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(name: &str, master: &str, mirrors: &[&str], synced: &[&str]) -> QueueRecord {
        QueueRecord {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: Arguments::new(),
            master: master.into(),
            mirrors: mirrors.iter().map(|s| s.to_string()).collect(),
            synchronised: synced.iter().map(|s| s.to_string()).collect(),
            view_version: 0,
            serial: 0,
        }
    }

    fn md() -> Metadata {
        let mut m = Metadata::default();
        m.apply(&Command::PutVhost { name: "/".into() });
        m
    }

    #[test]
    fn node_listeners_are_recorded_for_members_only() {
        let mut m = md();
        let members = BTreeMap::from([("a".to_owned(), "127.0.0.1:25672".to_owned())]);
        m.apply_membership(1, &members);
        let set = |node: &str| Command::SetNodeListeners {
            node: node.into(),
            listeners: vec![Listener {
                protocol: "amqp".into(),
                addr: "127.0.0.1:5672".into(),
            }],
        };
        assert_eq!(m.apply(&set("a")).result, Ok(Outcome::Done));
        assert_eq!(m.apply(&set("a")).result, Ok(Outcome::Unchanged));
        assert_eq!(m.nodes["a"].listeners[0].protocol, "amqp");
        assert_eq!(
            m.apply(&set("b")).result,
            Err(Rejection::NoNode("b".into()))
        );
        let bytes = postcard::to_stdvec(&set("a")).unwrap();
        assert_eq!(postcard::from_bytes::<Command>(&bytes).unwrap(), set("a"));
    }

    #[test]
    fn queue_view_compare_and_set() {
        let mut m = md();
        let r = m.apply(&Command::DeclareQueue(queue("q", "a", &["b"], &[])));
        let Ok(Outcome::Queue(q)) = r.result else {
            panic!("{r:?}")
        };
        assert_eq!(q.view_version, 1);
        let set = |v, synced: &[&str]| Command::SetQueueView {
            vhost: "/".into(),
            name: "q".into(),
            serial: 1,
            expected_version: v,
            view: QueueView {
                master: "a".into(),
                mirrors: vec!["b".into()],
                synchronised: synced.iter().map(|s| s.to_string()).collect(),
            },
        };
        assert!(m.apply(&set(1, &["b"])).result.is_ok());
        assert_eq!(
            m.apply(&set(1, &[])).result,
            Err(Rejection::ViewConflict {
                expected: 1,
                current: 2
            })
        );
        assert_eq!(m.queue("/", "q").unwrap().synchronised, vec!["b"]);
        assert!(matches!(
            m.apply(&set(2, &["c"])).result,
            Err(Rejection::InvalidView(_))
        ));
    }

    /// A queue deleted and declared again is another declaration: a new
    /// serial and ring, its predecessor's ring view gone, and a change
    /// meant for the predecessor refused.
    #[test]
    fn a_queue_declared_again_is_a_new_declaration() {
        let mut m = md();
        let declare = |m: &mut Metadata| match m
            .apply(&Command::DeclareQueue(queue("q", "a", &[], &[])))
            .result
        {
            Ok(Outcome::Queue(q)) => q,
            other => panic!("{other:?}"),
        };
        let first = declare(&mut m);
        assert_eq!(first.serial, 1);
        m.apply(&Command::SetRingView {
            ring: first.ring(),
            expected_version: 0,
            view: vec![1],
        });
        m.apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "q".into(),
            expected_version: None,
        });
        assert!(m.rings.is_empty(), "the deleted queue's ring view stays");
        let second = declare(&mut m);
        assert_eq!(second.serial, 2);
        assert_ne!(first.ring(), second.ring());
        let stale = Command::SetQueueView {
            vhost: "/".into(),
            name: "q".into(),
            serial: first.serial,
            expected_version: 1,
            view: QueueView {
                master: "b".into(),
                mirrors: vec![],
                synchronised: vec![],
            },
        };
        assert!(matches!(
            m.apply(&stale).result,
            Err(Rejection::NoQueue { .. })
        ));
        assert_eq!(m.queue("/", "q").unwrap().master, "a");
    }

    #[test]
    fn ring_views_compare_and_set_from_version_zero() {
        let mut m = Metadata::default();
        let set = |v: u64, b: u8| Command::SetRingView {
            ring: "/q".into(),
            expected_version: v,
            view: vec![b],
        };
        assert_eq!(
            m.apply(&set(0, 1)).result,
            Ok(Outcome::Ring(RingRecord {
                version: 1,
                view: vec![1]
            }))
        );
        assert_eq!(
            m.apply(&set(0, 2)).result,
            Err(Rejection::ViewConflict {
                expected: 0,
                current: 1
            })
        );
        assert!(m.apply(&set(1, 3)).result.is_ok());
        assert_eq!(m.rings["/q"].view, vec![3]);
    }

    #[test]
    fn redeclare_returns_the_existing_queue() {
        let mut m = md();
        m.apply(&Command::DeclareQueue(queue("q", "a", &[], &[])));
        let r = m.apply(&Command::DeclareQueue(queue("q", "b", &[], &[])));
        let Ok(Outcome::Queue(q)) = r.result else {
            panic!()
        };
        assert_eq!(q.master, "a");
    }

    #[test]
    fn exclusive_queues_are_never_mirrored() {
        let mut m = md();
        let mut q = queue("q", "a", &["b"], &[]);
        q.exclusive_owner = Some("conn-1".into());
        assert_eq!(
            m.apply(&Command::DeclareQueue(q)).result,
            Err(Rejection::ExclusiveMirrored)
        );
    }

    #[test]
    fn forgetting_a_node_promotes_the_oldest_synchronised_mirror_or_mirror_or_deletes() {
        let mut m = md();
        m.apply(&Command::DeclareQueue(queue(
            "q1",
            "a",
            &["b", "c"],
            &["c", "b"],
        )));
        m.apply(&Command::DeclareQueue(queue("q2", "a", &["b"], &[])));
        m.apply(&Command::DeclareQueue(queue("q3", "b", &["a"], &[])));
        m.apply(&Command::DeclareQueue(queue("q4", "a", &[], &[])));
        let members = |names: &[&str]| {
            names
                .iter()
                .map(|n| (n.to_string(), format!("{n}:1")))
                .collect::<BTreeMap<_, _>>()
        };
        m.apply_membership(1, &members(&["a", "b", "c"]));
        assert_eq!(m.nodes["a"].joined_at, 1);
        m.apply_membership(5, &members(&["b", "c"]));
        assert!(!m.nodes.contains_key("a"));
        let q1 = m.queue("/", "q1").unwrap();
        assert_eq!(q1.master, "c");
        assert_eq!(q1.mirrors, vec!["b"]);
        assert_eq!(q1.view_version, 2);
        let q2 = m.queue("/", "q2").unwrap();
        assert_eq!((q2.master.as_str(), q2.mirrors.len()), ("b", 0));
        assert!(m.queue("/", "q4").is_none());
        let q3 = m.queue("/", "q3").unwrap();
        assert_eq!((q3.master.as_str(), q3.mirrors.len()), ("b", 0));
    }

    #[test]
    fn deleting_things_cascades() {
        let mut m = md();
        m.apply(&Command::DeclareExchange(ExchangeRecord {
            vhost: "/".into(),
            name: "x".into(),
            kind: "direct".into(),
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: Arguments::new(),
        }));
        m.apply(&Command::DeclareQueue(queue("q", "a", &[], &[])));
        let b = BindingRecord {
            vhost: "/".into(),
            source: "x".into(),
            destination_kind: DestinationKind::Queue,
            destination: "q".into(),
            routing_key: "k".into(),
            arguments: Arguments::new(),
        };
        assert_eq!(m.apply(&Command::Bind(b.clone())).result, Ok(Outcome::Done));
        assert_eq!(m.apply(&Command::Bind(b)).result, Ok(Outcome::Unchanged));
        m.apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "q".into(),
            expected_version: None,
        });
        assert!(m.bindings.is_empty());
        m.apply(&Command::DeleteVhost { name: "/".into() });
        assert!(m.exchanges.is_empty());
    }

    #[test]
    fn argument_decoding_stops_at_the_depth_bound() {
        // Postcard: a Table (variant 6) of one entry "k" per level, Void inside.
        let encoded = |levels: usize| {
            let mut b = [6u8, 1, 1, b'k'].repeat(levels);
            b.push(0);
            b
        };
        let ok: ArgValue = postcard::from_bytes(&encoded(MAX_ARG_DEPTH)).unwrap();
        assert_eq!(postcard::to_stdvec(&ok).unwrap(), encoded(MAX_ARG_DEPTH));
        assert!(postcard::from_bytes::<ArgValue>(&encoded(MAX_ARG_DEPTH + 1)).is_err());
        // A peer's 200,000 levels: an error, not a stack overflow.
        assert!(postcard::from_bytes::<ArgValue>(&encoded(200_000)).is_err());
        // The counter is left at zero for the next decode.
        assert!(postcard::from_bytes::<ArgValue>(&encoded(MAX_ARG_DEPTH)).is_ok());
    }

    #[test]
    fn policies_round_trip_through_their_stored_form() {
        let spec = PolicySpec::new(
            "/",
            "ha-all",
            "^ha\\.",
            serde_json::json!({"ha-mode": "all", "ha-sync-mode": "automatic"}),
        )
        .priority(3);
        let rec = PolicyRecord::from_spec(&spec);
        assert_eq!(rec.to_spec().unwrap(), spec);
        let bytes = postcard::to_stdvec(&Command::PutPolicy(rec.clone())).unwrap();
        assert_eq!(
            postcard::from_bytes::<Command>(&bytes).unwrap(),
            Command::PutPolicy(rec)
        );
    }

    #[test]
    fn a_batch_applies_each_command_in_order_as_its_own_entry() {
        let mut m = md();
        let batch = Command::Batch(vec![
            Command::DeclareQueue(queue("q", "a", &[], &[])),
            Command::DeleteVhost {
                name: "nowhere".into(),
            },
            Command::DeleteQueue {
                vhost: "/".into(),
                name: "q".into(),
                expected_version: None,
            },
            Command::PutVhost { name: "v".into() },
        ]);
        // It travels as one entry, like any command.
        let bytes = postcard::to_allocvec(&batch).unwrap();
        assert_eq!(postcard::from_bytes::<Command>(&bytes).unwrap(), batch);
        let Ok(Outcome::Batch(results)) = m.apply(&batch).result else {
            panic!("not a batch outcome");
        };
        assert!(matches!(results[0], Ok(Outcome::Queue(_))), "{results:?}");
        // The rejected one changed nothing, and the ones after it applied
        // on the state the ones before left.
        assert_eq!(results[1], Err(Rejection::NoVhost("nowhere".into())));
        assert!(results[2].is_ok(), "{results:?}");
        assert_eq!(results[3], Ok(Outcome::Done));
        assert!(m.queues.is_empty());
        assert!(m.vhosts.contains("v"));
    }

    #[test]
    fn the_built_in_exchanges_of_a_vhost_take_bindings() {
        let mut m = md();
        m.apply(&Command::DeclareQueue(queue("q", "a", &[], &[])));
        let bind = |vhost: &str, source: &str, kind, dest: &str| {
            Command::Bind(BindingRecord {
                vhost: vhost.into(),
                source: source.into(),
                destination_kind: kind,
                destination: dest.into(),
                routing_key: "k".into(),
                arguments: Arguments::new(),
            })
        };
        for x in BUILTIN_EXCHANGES {
            let r = m.apply(&bind("/", x, DestinationKind::Queue, "q")).result;
            assert_eq!(r, Ok(Outcome::Done), "{x}");
        }
        let e2e = bind("/", "amq.topic", DestinationKind::Exchange, "amq.fanout");
        assert_eq!(m.apply(&e2e).result, Ok(Outcome::Done));
        // Only in a vhost that exists, and only those names.
        assert!(matches!(
            m.apply(&bind("nowhere", "amq.direct", DestinationKind::Queue, "q"))
                .result,
            Err(Rejection::NoExchange { .. })
        ));
        assert!(matches!(
            m.apply(&bind("/", "amq.other", DestinationKind::Queue, "q"))
                .result,
            Err(Rejection::NoExchange { .. })
        ));
        // Deleting the queue takes its bindings with it.
        m.apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "q".into(),
            expected_version: None,
        });
        assert_eq!(m.bindings.len(), 1, "{:?}", m.bindings);
    }
}
