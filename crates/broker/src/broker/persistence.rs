//! Persistence: where a durable queue's log lives, the group commits
//! that make persistent messages durable before they are confirmed
//! (prepared under the broker's lock, run off it, completed under it), and
//! a queue whose log failed (a full or failing disk): its unconfirmed
//! publishes nacked, the queue held until its log opens again.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use sha2::{Digest as _, Sha256};
use warren_backing_queue::{
    BackingQueue, Journal, QueueConfig, RecoveryReport, Storage, StoreConfig, StoreError, SyncJob,
    UnsyncedHook,
};

use super::publish::confirm_one;
use super::{Broker, Elsewhere, Store, nack_one};

/// Where durable queue `name` of `vhost` keeps its log: a hash of the vhost,
/// a NUL, and the name. No vhost holds a NUL (see [`valid_name`](super::valid_name)), so the
/// first NUL splits the pair one way only and no two pairs share a directory.
pub(super) fn queue_dir(data_dir: &std::path::Path, vhost: &str, name: &str) -> PathBuf {
    data_dir.join("queues").join(dir_name(vhost, name))
}

/// Where non-durable queue `name` of `vhost` pages bodies out past its
/// memory budget (under [`TRANSIENT_DIR`], emptied when the broker opens).
pub(super) fn transient_dir(data_dir: &std::path::Path, vhost: &str, name: &str) -> PathBuf {
    data_dir.join(TRANSIENT_DIR).join(dir_name(vhost, name))
}

/// Under the data directory: the non-durable queues' logs, which no
/// restart reads.
pub(super) const TRANSIENT_DIR: &str = "transient";

/// How long acks and delivery marks may wait for a group commit that
/// nobody else asked for.
const LAZY_SYNC_MS: u64 = 100;

/// Under the data directory: the node's journal of group commits.
pub(super) const JOURNAL_DIR: &str = "journal";

fn dir_name(vhost: &str, name: &str) -> String {
    let mut h = Sha256::new();
    h.update(vhost.as_bytes());
    h.update([0]);
    h.update(name.as_bytes());
    let d = h.finalize();
    d[..12].iter().map(|b| format!("{b:02x}")).collect()
}

/// Group commits prepared by [`Broker::prepare_sync`], to run without the
/// broker's lock and hand back to [`Broker::complete_sync`].
#[derive(Debug, Default)]
pub struct SyncBatch {
    jobs: Vec<SyncEntry>,
    /// The node's journal, if it has one: many logs' commits made durable
    /// by one append to it.
    journal: Option<Arc<Journal>>,
    /// How long [`run`](Self::run) took, as the shell timed it
    /// ([`ran_for`](Self::ran_for)).
    took_micros: u64,
}

/// One queue's part of a [`SyncBatch`]: which declaration (vhost, name,
/// uid) it is for, its job, and the job's outcome once run.
#[derive(Debug)]
struct SyncEntry {
    vhost: String,
    queue: Arc<str>,
    uid: u64,
    job: SyncJob,
    /// `None` until [`SyncBatch::run`]; an error is logged at completion
    /// only if the queue still exists (deleting a queue removes its log
    /// while a commit may be running).
    outcome: Option<Result<(), StoreError>>,
}

impl SyncBatch {
    /// Whether there is nothing to sync.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Runs the fsyncs (blocking), all queues' together
    /// ([`SyncJob::run_all`]: one journal append and one `fdatasync` for
    /// many logs).
    pub fn run(&mut self) {
        let mut jobs: Vec<&mut SyncJob> = self.jobs.iter_mut().map(|j| &mut j.job).collect();
        let results = SyncJob::run_all(&mut jobs, self.journal.as_deref());
        for (entry, res) in self.jobs.iter_mut().zip(results) {
            entry.outcome = Some(res);
        }
    }

    /// Records how long [`run`](Self::run) took (the broker has no clock of
    /// its own), for [`Broker::io_stats`].
    pub fn ran_for(&mut self, took: std::time::Duration) {
        self.took_micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
    }
}

/// A durable queue's log to open again after this process's copy of the
/// queue failed: gathered under the broker's lock
/// ([`Broker::reopen_plan`], [`Broker::failed_logs`]), opened off it
/// ([`Reopen::open`]: it reads the whole log), and handed back
/// ([`Broker::reopened`], or `restore_queue` for a mirrored queue's master).
pub struct Reopen {
    /// The queue's vhost.
    pub vhost: String,
    /// The queue's name.
    pub name: String,
    /// Which declaration of the queue failed (a queue deleted and declared
    /// again meanwhile is not this one).
    uid: u64,
    dir: PathBuf,
    storage: Arc<dyn Storage>,
    store: StoreConfig,
    cfg: QueueConfig,
}

impl std::fmt::Debug for Reopen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reopen")
            .field("vhost", &self.vhost)
            .field("name", &self.name)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Reopen {
    /// Opens the queue's log again (blocking). Every message it recovers
    /// comes back marked delivered: the marks in memory went with the
    /// failed copy (`BackingQueue::reopen_in`).
    pub fn open(&self) -> Result<(BackingQueue, RecoveryReport), StoreError> {
        BackingQueue::reopen_in(self.storage.clone(), &self.dir, self.cfg, self.store)
    }
}

impl Broker {
    /// What opening durable queue `name`'s log again takes; `None` for a
    /// queue this node does not have or one with no log.
    #[must_use]
    pub fn reopen_plan(&self, vhost: &str, name: &str) -> Option<Reopen> {
        let q = self.vhosts.get(vhost)?.queues.get(name)?;
        Some(Reopen {
            vhost: vhost.to_owned(),
            name: name.to_owned(),
            uid: q.uid,
            dir: q.dir.clone()?,
            storage: self.cfg.storage.clone(),
            store: super::args::store_config(q.lazy),
            cfg: q.queue_config(),
        })
    }

    /// The durable queues served here whose log failed, to open again
    /// ([`Reopen::open`], then [`Self::reopened`]). The node's shell asks
    /// every second; until a log opens, its queue nacks publishes, gets
    /// come back empty and consumers wait.
    pub fn failed_logs(&mut self) -> Vec<Reopen> {
        let failed = std::mem::take(&mut self.failed_logs);
        let mut plans = Vec::new();
        for ((vhost, name), uid) in failed {
            // A queue deleted (or declared anew) meanwhile has nothing to open.
            if let Some(plan) = self.reopen_plan(&vhost, &name).filter(|p| p.uid == uid) {
                plans.push(plan);
                self.failed_logs.insert((vhost, name), uid);
            }
        }
        plans
    }

    /// Serves the queue of `plan` again from `bq`, its log opened again
    /// after the failure. Returns false (and drops `bq`) if the queue was
    /// deleted or declared anew meanwhile.
    pub fn reopened(&mut self, plan: &Reopen, bq: BackingQueue) -> bool {
        let key = (plan.vhost.clone(), Arc::from(plan.name.as_str()));
        if self.failed_logs.get(&key) != Some(&plan.uid) {
            return false;
        }
        self.failed_logs.remove(&key);
        if self
            .queue_mut(&plan.vhost, &plan.name)
            .is_none_or(|q| q.uid != plan.uid)
        {
            return false;
        }
        self.restore_queue(&plan.vhost, &plan.name, bq, true)
    }

    /// Durable queue `name`'s log failed (a write, a sync or a commit:
    /// ENOSPC, EIO). Nothing more can be promised from this copy of it:
    /// the publishes waiting for their confirm are nacked (the publisher
    /// resends, as after RabbitMQ's queue crashed), deliveries made from it
    /// are void, and the queue is held, as while it has no master, until
    /// [`Self::failed_logs`] opens its log again. Without this the queue
    /// took publishes it could never confirm, for good.
    pub(super) fn fail_log(&mut self, vhost: &str, name: &str) {
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        if q.dir.is_none() || q.remote.is_some() || !matches!(q.store, Store::Local(_)) {
            return;
        }
        tracing::error!(%vhost, queue = %name, "the queue's log failed: its unconfirmed publishes are nacked, and it is held until its log opens again");
        q.store = Store::Local(BackingQueue::in_memory(q.queue_config()));
        q.kept_held = warren_mirror::HeldPublishes::unknown();
        q.handed_over = true;
        q.remote = Some(Elsewhere::Nowhere);
        let pending: Vec<_> = q.confirms.drain(..).collect();
        let (key, uid) = ((vhost.to_owned(), q.name.clone()), q.uid);
        self.failed_logs.insert(key, uid);
        self.void_deliveries(vhost, name);
        for (_, conn, ch, cseq) in pending {
            nack_one(&mut self.conns, conn, ch, cseq);
        }
        self.wake_clients();
    }

    /// Writes and fsyncs every durable queue's log inline (at shutdown, after
    /// the sync task stopped).
    pub fn sync_all(&mut self) {
        for (vname, v) in &mut self.vhosts {
            for q in v.queues.values_mut() {
                if q.store.needs_sync()
                    && let Err(e) = q.store.sync()
                {
                    tracing::error!(vhost = %vname, queue = %q.name, error = %e, "final sync failed");
                }
            }
        }
    }

    /// Asks for a group commit within [`LAZY_SYNC_MS`] (what nobody waits
    /// for: acks, delivery marks), unless one comes sooner.
    pub(super) fn want_lazy_sync(&mut self) {
        if !self.sync_wanted && self.lazy_sync_since.is_none() {
            self.lazy_sync_since = Some(self.now);
        }
    }

    /// Asks for the commit [`want_lazy_sync`](Self::want_lazy_sync) put off,
    /// once it is due (called by the tick).
    pub(super) fn lazy_sync_due(&mut self, now_ms: u64) {
        if self
            .lazy_sync_since
            .is_some_and(|t| now_ms.saturating_sub(t) >= LAZY_SYNC_MS)
        {
            self.want_sync();
        }
    }

    pub(super) fn want_sync(&mut self) {
        self.lazy_sync_since = None;
        if !self.sync_wanted {
            self.sync_wanted = true;
            if let Some(w) = &self.sync_waker {
                w();
            }
        }
    }

    /// Sets the unsynced hook of queue `name`'s store (one it was given
    /// after it was made: a log opened again, a replica's end).
    pub(super) fn hook_unsynced(&mut self, vhost: &str, name: &str) {
        let unsynced = self.unsynced.clone();
        if let Some(q) = self.queue_mut(vhost, name) {
            q.store.on_unsynced(unsynced.hook(vhost, &q.name, q.uid));
        }
    }

    /// Checks, once a second, that every log with something to sync told
    /// its hook: one that did not (a change that failed to, a store given
    /// no hook) would wait for a commit that never looks at it.
    pub(super) fn check_unsynced(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.last_unsynced_check_ms) < UNSYNCED_CHECK_MS {
            return;
        }
        self.last_unsynced_check_ms = now_ms;
        let (mut missed, mut owed) = (0, false);
        for (vname, v) in &mut self.vhosts {
            for q in v.queues.values_mut() {
                if q.store.tell_unsynced() {
                    missed += 1;
                } else if q.store.needs_sync() {
                    // Listed already, or told by a copy of the queue that
                    // the commit could not see then (a mirror's sync).
                    self.unsynced.push(vname, &q.name, q.uid);
                    owed = true;
                }
            }
        }
        if missed > 0 {
            tracing::warn!(
                queues = missed,
                "logs with something to sync were missing from the group commit's list"
            );
        }
        if missed > 0 || owed {
            self.want_lazy_sync();
        }
    }

    /// Starts a group commit of every durable queue with unsynced appends:
    /// those whose logs said so since their last commit.
    pub fn prepare_sync(&mut self) -> SyncBatch {
        self.sync_wanted = false;
        self.lazy_sync_since = None;
        let mut batch = SyncBatch {
            journal: self.journal.clone(),
            ..SyncBatch::default()
        };
        let mut failed = Vec::new();
        let mut seen = HashSet::new();
        for (vname, qname, uid) in self.unsynced.take() {
            if !seen.insert(uid) {
                continue;
            }
            let Some(q) = self.queue_mut(&vname, &qname).filter(|q| q.uid == uid) else {
                continue;
            };
            if q.store.needs_sync() {
                match q.store.prepare_sync() {
                    Ok(Some(job)) => batch.jobs.push(SyncEntry {
                        vhost: vname.clone(),
                        queue: q.name.clone(),
                        uid: q.uid,
                        job,
                        outcome: None,
                    }),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::error!(vhost = %vname, queue = %q.name, error = %e, "preparing a group commit failed");
                        failed.push((vname.clone(), q.name.clone()));
                    }
                }
            }
            // Still on the list while its commit is in flight.
            q.store.arm_unsynced();
        }
        for (vhost, name) in failed {
            self.fail_log(&vhost, &name);
        }
        batch
    }

    /// Finishes a group commit: confirms the publishes it made durable and
    /// wakes their connections. Returns whether another commit is due.
    pub fn complete_sync(&mut self, batch: SyncBatch, now_ms: u64) -> bool {
        self.now = now_ms;
        self.current = 0;
        self.io.syncs += 1;
        self.io.sync_micros += batch.took_micros;
        self.io.logs_synced += batch.jobs.len() as u64;
        let mut seqs = Vec::new();
        let mut replicas = Vec::new();
        let mut failed = Vec::new();
        for entry in batch.jobs {
            let SyncEntry {
                vhost: vname,
                queue: qname,
                uid,
                job,
                outcome,
            } = entry;
            let Some(q) = self
                .vhosts
                .get_mut(&vname)
                .and_then(|v| v.queues.get_mut(&qname))
            else {
                continue;
            };
            if q.uid != uid {
                continue;
            }
            // The queue is still this declaration, so a failure is its own
            // (a deleted queue's log vanishing under its commit is not).
            let ok = match outcome {
                Some(Ok(())) => true,
                Some(Err(e)) => {
                    tracing::error!(vhost = %vname, queue = %qname, error = %e, "group commit failed");
                    false
                }
                None => false,
            };
            let bq = match &mut q.store {
                Store::Local(bq) if !ok => {
                    // The queue's log failed, unless the job was of a log
                    // the queue no longer has (completing it says which).
                    if bq.complete_sync(&job).is_err() {
                        failed.push((vname, qname));
                    }
                    continue;
                }
                Store::Local(bq) => bq,
                Store::Replica(m) => {
                    // A failed job too: a mirror whose disk failed drops
                    // its state and asks for a sync at once, instead of
                    // counting as synchronised (and promotable) until its
                    // next job.
                    if let Err(e) = m.replica.complete_storage_sync(&job) {
                        tracing::error!(vhost = %vname, queue = %qname, error = %e, "completing a group commit failed");
                    }
                    // Publishes the queue took before it became mirrored
                    // are confirmed by its own disk, as they were promised.
                    let synced = m.replica.synced_seq().unwrap_or(0);
                    while let Some(&(seq, conn, ch, cseq)) = q.confirms.front() {
                        if seq > synced {
                            break;
                        }
                        q.confirms.pop_front();
                        confirm_one(&mut self.conns, conn, ch, cseq);
                    }
                    replicas.push((vname.clone(), qname.clone()));
                    continue;
                }
            };
            if let Err(e) = bq.complete_sync(&job) {
                tracing::error!(vhost = %vname, queue = %qname, error = %e, "completing a group commit failed");
                failed.push((vname, qname));
                continue;
            }
            seqs.clear();
            bq.drain_confirmed(&mut seqs);
            let Some(&max) = seqs.last() else {
                continue;
            };
            while let Some(&(seq, conn, ch, cseq)) = q.confirms.front() {
                if seq > max {
                    break;
                }
                q.confirms.pop_front();
                confirm_one(&mut self.conns, conn, ch, cseq);
            }
        }
        for (vname, qname) in replicas {
            self.mirror_turn(&vname, &qname);
        }
        for (vname, qname) in failed {
            self.fail_log(&vname, &qname);
        }
        for (id, c) in &mut self.conns {
            if !c.confirm_dirty.is_empty() {
                c.wake(0, *id);
            }
        }
        // Whether a commit is awaited, else whether one is owed: of the
        // queues on the list, as every queue with something to sync is.
        let (mut more, mut owed) = (false, false);
        for (vname, qname, uid) in self.unsynced.peek() {
            let Some(q) = self.queue_mut(&vname, &qname).filter(|q| q.uid == uid) else {
                continue;
            };
            if q.store.awaits_sync() {
                more = true;
                break;
            }
            owed |= q.store.needs_sync();
        }
        if more {
            self.sync_wanted = true;
        } else if owed {
            self.want_lazy_sync();
        }
        more
    }
}

/// How often the tick checks that every log with something to sync is on
/// the group commit's list ([`Broker::check_unsynced`]).
const UNSYNCED_CHECK_MS: u64 = 1_000;

/// A queue on the list: vhost, name and the declaration's uid.
type UnsyncedQueue = (String, Arc<str>, u64);

/// The queues whose logs have something to sync: each log's hook
/// ([`BackingQueue::on_unsynced`]) puts its queue here once, until the next
/// group commit takes the list and arms the hooks again. A commit then
/// looks at the queues that changed, not at every queue of the node (with
/// 50,000 idle durable queues, two passes over all of them per commit took
/// 70 % of the node's CPU and a sixth of its throughput).
#[derive(Debug, Clone, Default)]
pub(super) struct Unsynced(Arc<Mutex<Vec<UnsyncedQueue>>>);

impl Unsynced {
    /// The hook of queue `name` (declaration `uid`) in `vhost`.
    pub(super) fn hook(&self, vhost: &str, name: &Arc<str>, uid: u64) -> UnsyncedHook {
        let (list, key) = (
            Arc::clone(&self.0),
            (vhost.to_owned(), Arc::clone(name), uid),
        );
        Arc::new(move || {
            list.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(key.clone());
        })
    }

    fn push(&self, vhost: &str, name: &Arc<str>, uid: u64) {
        (self.0.lock().unwrap_or_else(PoisonError::into_inner)).push((
            vhost.to_owned(),
            Arc::clone(name),
            uid,
        ));
    }

    fn take(&self) -> Vec<UnsyncedQueue> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn peek(&self) -> Vec<UnsyncedQueue> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
