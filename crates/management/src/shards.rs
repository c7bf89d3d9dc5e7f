//! A sharded node's brokers seen as one node: its clients, consumers and
//! counters are spread over the shards and listed or summed from all of
//! them; each queue's figures are its master shard's. Metadata (vhosts,
//! users, exchanges, bindings, policies) is the same on every shard and is
//! read from the first. An unsharded node has one shard.

use std::collections::HashMap;

use warren_broker::{
    ChannelInfo, ConnId, ConnectionInfo, ConsumerInfo, IoStats, LatencyHistogram, MessageCounters,
    Overview, QueueInfo, QueueSample,
};
use warren_lock::LockStats;

use crate::{Management, SharedBroker};

impl Management {
    /// Adds a sharded node's other shards (the first is the one given to
    /// [`Management::new`]).
    #[must_use]
    pub fn shards(mut self, others: Vec<SharedBroker>) -> Self {
        self.shards = others;
        self
    }

    /// Every shard's broker, the first first.
    fn all(&self) -> impl Iterator<Item = &SharedBroker> {
        std::iter::once(&self.broker).chain(&self.shards)
    }

    /// The node's client connections.
    pub(crate) fn connections(&self) -> Vec<ConnectionInfo> {
        self.all().flat_map(|b| b.lock().connections()).collect()
    }

    /// The node's client connections and their channels, each shard's read
    /// together.
    pub(crate) fn conns_and_channels(&self) -> (Vec<ConnectionInfo>, Vec<ChannelInfo>) {
        let (mut conns, mut channels) = (Vec::new(), Vec::new());
        for b in self.all() {
            let b = b.lock();
            conns.extend(b.connections());
            channels.extend(b.channels());
        }
        (conns, channels)
    }

    /// The node's client connections and the consumers on them (of
    /// `vhost`, or of all), sorted by vhost, queue and tag.
    pub(crate) fn conns_and_consumers(
        &self,
        vhost: Option<&str>,
    ) -> (Vec<ConnectionInfo>, Vec<ConsumerInfo>) {
        let (mut conns, mut consumers) = (Vec::new(), Vec::new());
        for b in self.all() {
            let b = b.lock();
            conns.extend(b.connections());
            consumers.extend(b.consumers(vhost));
        }
        consumers.sort_by(|a, b| (&a.vhost, &a.queue, &a.tag).cmp(&(&b.vhost, &b.queue, &b.tag)));
        (conns, consumers)
    }

    /// The overview's counts: clients, consumers and messages summed over
    /// the shards (a queue's messages are on its master shard alone), the
    /// definitions counted once.
    pub(crate) fn overview(&self) -> Overview {
        let mut all = self.all().map(|b| b.lock().overview());
        let mut o = all.next().unwrap_or_default();
        for s in all {
            o.connections += s.connections;
            o.channels += s.channels;
            o.consumers += s.consumers;
            o.messages_ready += s.messages_ready;
            o.messages_unacknowledged += s.messages_unacknowledged;
        }
        o
    }

    /// The message counters and confirm latencies of every shard's clients.
    pub(crate) fn message_stats(&self) -> (MessageCounters, LatencyHistogram) {
        let (mut n, mut h) = (MessageCounters::default(), LatencyHistogram::default());
        for b in self.all() {
            let (bn, bh) = b.lock().message_stats();
            n.add(&bn);
            h.add(&bh);
        }
        (n, h)
    }

    /// The group commits of every shard.
    pub(crate) fn io_stats(&self) -> IoStats {
        let mut io = IoStats::default();
        for b in self.all() {
            let s = b.lock().io_stats();
            io.syncs += s.syncs;
            io.sync_micros += s.sync_micros;
            io.logs_synced += s.logs_synced;
        }
        io
    }

    /// Every queue (of `vhost`, or of all), as its master shard shows it.
    pub(crate) fn queues(&self, vhost: Option<&str>) -> Vec<QueueInfo> {
        let mut all = self.all().map(|b| b.lock().queues(vhost));
        let mut out = all.next().unwrap_or_default();
        if self.shards.is_empty() {
            return out;
        }
        let at: HashMap<(String, String), usize> = out
            .iter()
            .enumerate()
            .map(|(i, q)| ((q.vhost.clone(), q.name.clone()), i))
            .collect();
        for shard in all {
            for q in shard.into_iter().filter(|q| q.served_here) {
                if let Some(&i) = at.get(&(q.vhost.clone(), q.name.clone())) {
                    out[i] = q;
                }
            }
        }
        out
    }

    /// Every shard's queue samples for the rates (each queue's counters
    /// where it is served).
    pub(crate) fn queue_samples(&self) -> Vec<QueueSample> {
        self.all()
            .flat_map(|b| b.lock().queue_samples())
            .filter(|q| q.served_here)
            .collect()
    }

    /// Closes client connection `id` on whichever shard has it.
    pub(crate) fn close_connection(&self, id: ConnId, reason: &str) -> bool {
        self.all().any(|b| b.lock().close_connection(id, reason))
    }

    /// The shards' broker locks' accounts, summed.
    pub(crate) fn lock_stats(&self) -> LockStats {
        let mut l = LockStats::default();
        for b in self.all() {
            let s = b.stats();
            l.acquisitions += s.acquisitions;
            l.contended += s.contended;
            l.wait += s.wait;
            l.held += s.held;
        }
        l
    }
}
