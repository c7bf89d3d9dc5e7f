//! Metadata commits a client waits for, made off the broker's lock.
//!
//! With a store that [defers](crate::meta::MetadataStore::defers) (the
//! cluster's, whose commit waits for a Raft majority), a client's declare,
//! delete, bind or unbind changes the broker at once but its reply waits:
//! the changes it recorded are kept as one commit, the reply the command
//! encoded is set aside, and the connection reads no further command. The
//! shell takes the commit ([`Broker::take_commits`]), makes it without the
//! broker's lock, and reports ([`Broker::commit_done`]): the reply goes out
//! and the connection goes on, or, if the cluster refused, the connection
//! is closed with 541 as when the commit was made under the lock (the shell
//! then brings the broker back in line with the cluster's metadata). Other
//! clients of the node never wait for it.

use std::collections::BTreeMap;

use bytes::BytesMut;

use super::{Broker, ConnId, Waker};
use crate::meta::{Change, MetaError};

/// The commits in flight and the one being recorded.
#[derive(Default)]
pub(super) struct Commits {
    /// The changes of the command being handled, when the store defers.
    recording: Option<Vec<Change>>,
    /// By ticket: the commits not yet reported.
    pending: BTreeMap<u64, Pending>,
    next: u64,
    waker: Option<Waker>,
}

/// Who waits for a commit.
enum Waiter {
    /// Nobody (a closed channel's auto-delete, the tick).
    Nobody,
    /// A client connection, parked (`Conn::committing`).
    Conn(ConnId),
    /// A caller of [`Broker::recorded`] (the management API).
    Done(CommitDone),
}

/// Called with the outcome of a commit made for [`Broker::recorded`].
pub type CommitDone = Box<dyn FnOnce(Result<(), MetaError>) + Send>;

struct Pending {
    waiter: Waiter,
    changes: Vec<Change>,
    /// Handed to the shell.
    taken: bool,
}

/// A connection's command waiting for its commit.
#[derive(Debug)]
pub(super) struct Parked {
    ticket: u64,
    /// The reply (and whatever else the command encoded), sent once committed.
    held: BytesMut,
    /// The command's class and method, for the error if the commit fails.
    method: (u16, u16),
}

/// Metadata changes of one client command, for the shell to commit in order.
#[derive(Debug)]
pub struct MetaCommit {
    /// Names the commit in [`Broker::commit_done`].
    pub ticket: u64,
    /// The changes, in the order the command made them.
    pub changes: Vec<Change>,
}

impl Broker {
    /// Sets the waker of the task that makes metadata commits
    /// ([`take_commits`](Self::take_commits)), and wakes it at once if
    /// commits wait already.
    pub fn set_commit_waker(&mut self, waker: Waker) {
        if self.commits.pending.values().any(|p| !p.taken) {
            waker();
        }
        self.commits.waker = Some(waker);
    }

    /// Hands out the commits not yet handed out; report each with
    /// [`commit_done`](Self::commit_done).
    pub fn take_commits(&mut self) -> Vec<MetaCommit> {
        self.commits
            .pending
            .iter_mut()
            .filter(|(_, p)| !p.taken)
            .map(|(&ticket, p)| {
                p.taken = true;
                MetaCommit {
                    ticket,
                    changes: p.changes.clone(),
                }
            })
            .collect()
    }

    /// Every change made here but not yet committed, oldest first: the
    /// cluster's metadata plus these is what this broker should hold (a
    /// replay of the cluster's metadata must not undo them meanwhile).
    #[must_use]
    pub fn changes_in_flight(&self) -> Vec<Change> {
        self.commits
            .pending
            .values()
            .flat_map(|p| p.changes.iter().cloned())
            .collect()
    }

    /// The commit `ticket` is made (or refused, `Err`): its client gets its
    /// reply (or a connection error) and goes on with the commands it sent
    /// behind it.
    pub fn commit_done(&mut self, ticket: u64, result: Result<(), MetaError>) {
        let Some(p) = self.commits.pending.remove(&ticket) else {
            return;
        };
        let id = match p.waiter {
            Waiter::Conn(id) => id,
            Waiter::Done(done) => return done(result),
            Waiter::Nobody => {
                if let Err(e) = result {
                    tracing::warn!(error = %e, "a metadata change nobody waited for was refused");
                }
                return;
            }
        };
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(parked) = c.committing.take_if(|w| w.ticket == ticket) else {
            return;
        };
        match result {
            Ok(()) => c.amqp.push_output(&parked.held),
            // A closing client gets its close-ok whatever the commit did.
            Err(_) if c.closed => c.amqp.push_output(&parked.held),
            Err(e) => {
                let (class, method) = parked.method;
                c.amqp
                    .connection_error(super::topology::meta_err(e).with_method(class, method));
            }
        }
        self.process_events(id, None);
        if let Some(c) = self.conns.get_mut(&id) {
            c.woken = true;
            (c.waker)();
        }
    }

    /// Starts recording the changes of a command of client connection `id`
    /// when the store defers them; returns the output mark to set the
    /// reply aside from.
    pub(super) fn begin_recording(&mut self, id: ConnId) -> Option<usize> {
        let c = self.conns.get(&id)?;
        if c.link.is_some() || !self.meta.defers() {
            return None;
        }
        self.commits.recording = Some(Vec::new());
        Some(c.amqp.output_len())
    }

    /// Ends recording: if the command changed metadata, its reply is set
    /// aside and connection `id` waits for the commit.
    pub(super) fn end_recording(&mut self, id: ConnId, mark: usize, method: (u16, u16)) {
        let changes = self.commits.recording.take().unwrap_or_default();
        if changes.is_empty() {
            return;
        }
        let ticket = self.queue_commit(Waiter::Conn(id), changes);
        if let Some(c) = self.conns.get_mut(&id) {
            c.committing = Some(Parked {
                ticket,
                held: c.amqp.split_output(mark),
                method,
            });
        }
    }

    /// Queues `changes` for the shell's commit task; returns its ticket.
    fn queue_commit(&mut self, waiter: Waiter, changes: Vec<Change>) -> u64 {
        let ticket = self.commits.next;
        self.commits.next += 1;
        self.commits.pending.insert(
            ticket,
            Pending {
                waiter,
                changes,
                taken: false,
            },
        );
        if let Some(w) = &self.commits.waker {
            w();
        }
        ticket
    }

    /// Runs `f` (an operator's change: the management API's declares,
    /// deletes, users, policies), whose metadata changes are committed off
    /// the lock like a client's; `done` gets the commit's outcome (at once
    /// if there was nothing to commit or the store does not defer). The
    /// caller answers once `done` is called, without holding the lock.
    pub fn recorded<R>(&mut self, f: impl FnOnce(&mut Self) -> R, done: CommitDone) -> R {
        self.recording(f, Waiter::Done(done))
    }

    /// Runs `f`, work no client waits on (a channel or connection closed,
    /// the tick): the metadata changes it makes (an auto-delete or expired
    /// queue deleted) are committed off the lock too, nobody waiting.
    pub(super) fn detached<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        self.recording(f, Waiter::Nobody)
    }

    fn recording<R>(&mut self, f: impl FnOnce(&mut Self) -> R, waiter: Waiter) -> R {
        if self.commits.recording.is_some() || !self.meta.defers() {
            let r = f(self);
            if let Waiter::Done(done) = waiter {
                done(Ok(()));
            }
            return r;
        }
        self.commits.recording = Some(Vec::new());
        let r = f(self);
        let changes = self.commits.recording.take().unwrap_or_default();
        if changes.is_empty() {
            if let Waiter::Done(done) = waiter {
                done(Ok(()));
            }
        } else {
            self.queue_commit(waiter, changes);
        }
        r
    }

    /// Commits `changes` off the lock, nobody waiting for them.
    pub(super) fn commit_nobody_waits(&mut self, changes: Vec<Change>) {
        self.queue_commit(Waiter::Nobody, changes);
    }

    /// Records `change` to a vhost, user, permission or policy: kept for
    /// the commit while recording, else applied to the store now.
    pub(super) fn store_change(&mut self, change: Change) -> Result<(), MetaError> {
        match self.defer(change) {
            None => Ok(()),
            Some(change) => self.meta.apply(change),
        }
    }

    /// Keeps `change` for the command's commit when recording, or as a
    /// commit nobody waits for when the store takes every change that way
    /// ([`defers_all`](crate::meta::MetadataStore::defers_all)); gives it
    /// back otherwise.
    pub(super) fn defer(&mut self, change: Change) -> Option<Change> {
        match &mut self.commits.recording {
            Some(changes) => {
                changes.push(change);
                None
            }
            None if self.meta.defers_all() => {
                self.queue_commit(Waiter::Nobody, vec![change]);
                None
            }
            None => Some(change),
        }
    }
}
