//! The replica hub: one task that moves the ring traffic of every replica
//! on the node, in turns that serve all the replicas ready at once.
//!
//! A turn takes the replicas marked ready (ring events arrived, or the
//! broker has output for them), feeds all their ring events to the broker
//! under one hold of its lock, lets the clients whose input is ready go
//! first, then takes every ready replica's output under a second hold and
//! sends it. With 1,000 queues at 10 msg/s each, a replica's own task was
//! woken and polled several times for each message; a turn of the hub
//! serves every replica that has something, with two holds of the lock.
//!
//! What is rare stays with each replica's own task (`driver.rs`): a view
//! change (read from the view authority, an await), record changes,
//! majority changes, ticks, the stop. That task feeds the broker itself and
//! marks the replica ready, so that the hub, the one place that sends a
//! replica's output, sends it in order.
//!
//! One task for every replica is one place where a panic would stall them
//! all with the node still up: the driver aborts the process if the hub
//! panics (fail-stop), so that the cluster fails over from the node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{Notify, mpsc, oneshot};
use warren_broker::MirrorInput;
use warren_gm::{RingEvent, RingHandle};
use warren_mirror::RecordView;

use crate::driver::{Clock, Shared, lock};

/// Starts a compare-and-set of the queue record (expected version, the
/// record wanted); its outcome goes back to the replica's task.
pub(crate) type Propose = Box<dyn Fn(u64, RecordView) + Send + Sync>;

/// One replica as the hub serves it.
pub(crate) struct Entry {
    /// The queue's vhost.
    pub vhost: String,
    /// The queue's name.
    pub name: String,
    /// The replica's ring member.
    pub ring: Arc<RingHandle>,
    /// Set by the replica's task once a view is installed: broadcasts wait
    /// until then.
    pub joined: Arc<AtomicBool>,
    /// Set while the replica's task feeds a view change and the events
    /// after it (`slow`): the hub takes none of the ring's events meanwhile.
    pub slow: Arc<AtomicBool>,
    /// Where the events from a view change on go, to the replica's task.
    pub slow_tx: mpsc::UnboundedSender<Vec<RingEvent>>,
    /// The record compare-and-sets the replica asks for.
    pub propose: Propose,
    /// Told when the replica has stopped: whether its disk failed.
    pub done: oneshot::Sender<bool>,
}

/// What the other tasks hand the hub.
#[derive(Default)]
struct Inbox {
    /// Replicas with something to do, in the order they became ready.
    ready: Vec<u64>,
    /// The same, to mark each once.
    queued: BTreeSet<u64>,
    /// Replicas started since the last turn.
    added: Vec<(u64, Entry)>,
}

/// The hub's shared side: what marks replicas ready and adds them.
#[derive(Default)]
pub(crate) struct Hub {
    inbox: Mutex<Inbox>,
    bell: Notify,
    /// Turns taken so far (that served at least one replica).
    turns: AtomicU64,
    /// Replicas served, summed over the turns.
    served: AtomicU64,
}

/// What the hub has done since the node started (`/metrics`): served per
/// turn is how many replicas a turn batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Turns the hub has taken that served at least one replica.
    pub turns: u64,
    /// Replicas it served, summed over its turns.
    pub replicas_served: u64,
}

impl Hub {
    fn inbox(&self) -> std::sync::MutexGuard<'_, Inbox> {
        self.inbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the hub has done so far.
    pub(crate) fn stats(&self) -> HubStats {
        HubStats {
            turns: self.turns.load(Ordering::Relaxed),
            replicas_served: self.served.load(Ordering::Relaxed),
        }
    }

    /// Marks replica `id` as having something to do.
    pub(crate) fn ready(&self, id: u64) {
        let mut inbox = self.inbox();
        if inbox.queued.insert(id) {
            inbox.ready.push(id);
            if inbox.ready.len() == 1 {
                self.bell.notify_one();
            }
        }
    }

    /// Adds a started replica (ready at once).
    pub(crate) fn add(&self, id: u64, entry: Entry) {
        self.inbox().added.push((id, entry));
        self.ready(id);
        self.bell.notify_one();
    }

    /// Serves the replicas until the task is aborted.
    pub(crate) async fn run(self: Arc<Self>, node: String, broker: Shared, clock: Clock) {
        let mut entries: BTreeMap<u64, Served> = BTreeMap::new();
        // Replicas whose broadcast could not be handed to the ring's node.
        let mut failed: Vec<u64> = Vec::new();
        // View changes and the events after them, for the replicas' tasks.
        let mut slow: Vec<(u64, Vec<RingEvent>)> = Vec::new();
        loop {
            self.bell.notified().await;
            let (ready, added) = {
                let mut inbox = self.inbox();
                inbox.queued.clear();
                (
                    std::mem::take(&mut inbox.ready),
                    std::mem::take(&mut inbox.added),
                )
            };
            if !ready.is_empty() {
                self.turns.fetch_add(1, Ordering::Relaxed);
                self.served.fetch_add(ready.len() as u64, Ordering::Relaxed);
            }
            for (id, entry) in added {
                entries.insert(
                    id,
                    Served {
                        entry,
                        outgoing: Vec::new(),
                        closed: false,
                    },
                );
            }
            let mut inputs: Vec<(u64, Vec<RingEvent>)> = std::mem::take(&mut failed)
                .into_iter()
                .map(|id| (id, vec![RingEvent::Removed]))
                .collect();
            for &id in &ready {
                let Some(s) = entries.get_mut(&id) else {
                    continue;
                };
                if s.entry.slow.load(Ordering::SeqCst) || s.closed {
                    continue;
                }
                let mut events = Vec::new();
                if !s.entry.ring.try_events(&mut events) {
                    s.closed = true;
                    events.push(RingEvent::Removed);
                }
                if let Some(i) = events
                    .iter()
                    .position(|e| matches!(e, RingEvent::View { .. }))
                {
                    s.entry.slow.store(true, Ordering::SeqCst);
                    slow.push((id, events.split_off(i)));
                }
                if !events.is_empty() {
                    inputs.push((id, events));
                }
            }
            if !inputs.is_empty() {
                let batch = inputs
                    .into_iter()
                    .filter_map(|(id, events)| {
                        let e = &entries.get(&id)?.entry;
                        Some((e.vhost.as_str(), e.name.as_str(), MirrorInput::Ring(events)))
                    })
                    .collect();
                let now = clock();
                lock(&broker).mirror_inputs(batch, now);
            }
            // Only now, after the events before it are in: the replica's
            // task runs on another thread and would otherwise feed the view
            // change first (the messages of the old view then arrive in the
            // new one).
            for (id, tail) in slow.drain(..) {
                if let Some(s) = entries.get(&id) {
                    let _ = s.entry.slow_tx.send(tail);
                }
            }
            // Let the clients whose input is ready go first: what they
            // publish, fetch and settle meanwhile joins this turn's
            // broadcasts, so that one-frame-per-write clients (lapin, pika)
            // do not cost a ring round each (docs/benchmarks.md, "Replica
            // turns after the ready clients").
            tokio::task::yield_now().await;
            let ios: Vec<_> = {
                let mut b = lock(&broker);
                ready
                    .iter()
                    .filter_map(|id| {
                        let e = &entries.get(id)?.entry;
                        Some((*id, b.take_mirror_io(&e.vhost, &e.name)))
                    })
                    .collect()
            };
            for (id, io) in ios {
                let Some(s) = entries.get_mut(&id) else {
                    continue;
                };
                s.outgoing.extend(io.broadcasts);
                if s.entry.joined.load(Ordering::SeqCst) && !s.outgoing.is_empty() {
                    let batch = std::mem::take(&mut s.outgoing);
                    if let Err(e) = s.entry.ring.broadcast_later(batch).await {
                        tracing::warn!(node = %node, vhost = %s.entry.vhost, queue = %s.entry.name, error = %e, "ring broadcast failed");
                        failed.push(id);
                    }
                }
                for (to, payload) in io.sends {
                    // Lost only with the link; a new link has the replica report again.
                    let _ = s.entry.ring.send(to, payload).await;
                }
                for (expected, view) in io.proposals {
                    (s.entry.propose)(expected, view);
                }
                if io.stopped
                    && let Some(s) = entries.remove(&id)
                {
                    let _ = s.entry.done.send(io.storage_failed);
                }
            }
            for &id in &failed {
                self.ready(id);
            }
        }
    }
}

/// A replica the hub serves, with what it holds for it.
struct Served {
    entry: Entry,
    /// Broadcasts taken before the replica joined its ring.
    outgoing: Vec<Bytes>,
    /// Its ring's node stopped: no more events.
    closed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(hub: &Hub) -> Vec<u64> {
        let mut inbox = hub.inbox();
        inbox.queued.clear();
        std::mem::take(&mut inbox.ready)
    }

    #[test]
    fn a_replica_is_ready_once_per_turn_in_the_order_it_became_ready() {
        let hub = Hub::default();
        for id in [3, 1, 3, 2, 1] {
            hub.ready(id);
        }
        assert_eq!(taken(&hub), vec![3, 1, 2]);
        // Taken: the next turn sees it again when it is marked again.
        hub.ready(3);
        assert_eq!(taken(&hub), vec![3]);
        assert!(taken(&hub).is_empty());
    }

    #[tokio::test]
    async fn the_first_ready_replica_rings_the_bell() {
        let hub = Hub::default();
        hub.ready(7);
        // A permit is stored: the hub's wait ends at once.
        tokio::time::timeout(std::time::Duration::from_secs(1), hub.bell.notified())
            .await
            .expect("the bell rang");
        assert_eq!(taken(&hub), vec![7]);
    }
}
