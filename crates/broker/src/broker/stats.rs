//! Message counters and the confirm latency histogram that `/metrics` and
//! the management API show (RabbitMQ's `rabbitmq_global_messages_*` and
//! per-queue, per-connection and per-channel message stats; the API
//! samples them for its rates). Counting is plain integer arithmetic under
//! the broker lock; client connections and their channels keep their own
//! counts, a connection's folded into the node's totals when it closes.

/// The node's group commits since it started: how many ran, the time they
/// took (writing the logs' appends and syncing them) and how many queue
/// logs they covered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Group commits run (each one `syncfs` per file system).
    pub syncs: u64,
    /// Their total time in microseconds, as the shell timed them.
    pub sync_micros: u64,
    /// Queue logs written and synced, summed over the commits.
    pub logs_synced: u64,
}

/// Node-wide counts of client traffic since the node started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MessageCounters {
    /// Messages published by clients of this node.
    pub received: u64,
    /// Of those, published on channels in confirm mode.
    pub received_confirm: u64,
    /// Published messages routed to at least one queue.
    pub routed: u64,
    /// Unroutable mandatory messages returned to their publisher.
    pub unroutable_returned: u64,
    /// Unroutable messages dropped.
    pub unroutable_dropped: u64,
    /// Publisher confirms (`basic.ack`) sent.
    pub confirmed: u64,
    /// Messages delivered to consumers or fetched with `basic.get`.
    pub delivered: u64,
    /// Of those, redelivered.
    pub redelivered: u64,
    /// Deliveries acknowledged by clients.
    pub acknowledged: u64,
    /// `basic.get` answered with get-empty.
    pub get_empty: u64,
}

impl MessageCounters {
    /// Counts one publish: `routed` to a queue, else returned if
    /// `mandatory` or dropped; `confirm` if on a channel in confirm mode.
    pub fn count_publish(&mut self, routed: bool, mandatory: bool, confirm: bool) {
        self.received += 1;
        self.received_confirm += u64::from(confirm);
        if routed {
            self.routed += 1;
        } else if mandatory {
            self.unroutable_returned += 1;
        } else {
            self.unroutable_dropped += 1;
        }
    }

    /// Adds `other` to these counts.
    pub fn add(&mut self, other: &Self) {
        self.received += other.received;
        self.received_confirm += other.received_confirm;
        self.routed += other.routed;
        self.unroutable_returned += other.unroutable_returned;
        self.unroutable_dropped += other.unroutable_dropped;
        self.confirmed += other.confirmed;
        self.delivered += other.delivered;
        self.redelivered += other.redelivered;
        self.acknowledged += other.acknowledged;
        self.get_empty += other.get_empty;
    }
}

/// Bytes of one client connection's socket since it opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Octets {
    /// Read from the client (and consumed as frames).
    pub received: u64,
    /// Written to the client.
    pub sent: u64,
}

/// Counts of one queue's traffic, on the node that serves it (its master).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueCounters {
    /// Messages published into the queue.
    pub published: u64,
    /// Messages delivered or fetched from it.
    pub delivered: u64,
    /// Of those, redelivered.
    pub redelivered: u64,
    /// Deliveries acknowledged.
    pub acked: u64,
}

/// The upper bounds (milliseconds) of the confirm latency buckets.
pub const LATENCY_BUCKETS_MS: [u64; 12] = [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000];

/// How long publishes waited for their confirm: from the broker reading
/// the publish to the broker writing its `basic.ack`, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: [u64; LATENCY_BUCKETS_MS.len()],
    count: u64,
    sum_ms: u64,
}

impl LatencyHistogram {
    /// Records one confirm that took `ms`.
    pub fn observe(&mut self, ms: u64) {
        if let Some(i) = LATENCY_BUCKETS_MS.iter().position(|b| ms <= *b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum_ms += ms;
    }

    /// Adds `other`'s observations to these.
    pub fn add(&mut self, other: &Self) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ms += other.sum_ms;
    }

    /// Each bucket's upper bound (ms) with the observations at or under it
    /// (cumulative, as Prometheus wants them).
    pub fn cumulative(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        LATENCY_BUCKETS_MS
            .iter()
            .zip(self.counts.iter().scan(0, |acc, c| {
                *acc += c;
                Some(*acc)
            }))
            .map(|(b, c)| (*b, c))
    }

    /// How many confirms were observed.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Their total latency in milliseconds.
    #[must_use]
    pub fn sum_ms(&self) -> u64 {
        self.sum_ms
    }
}

/// One queue's counters and lengths, as the management API samples them
/// for its rates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSample {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// This node serves it (it is not forwarded to another node's master):
    /// its counters are the queue's.
    pub served_here: bool,
    /// Its traffic, counted where it is served.
    pub counters: QueueCounters,
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and not yet acked.
    pub unacked: u64,
}

impl super::Conn {
    /// Counts on this connection and on its channel `ch`.
    pub(super) fn count(&mut self, ch: super::ChannelId, f: impl Fn(&mut MessageCounters)) {
        f(&mut self.counters);
        if let Some(c) = self.channels.get_mut(&ch) {
            f(&mut c.counters);
        }
    }

    /// Counts a message this client connection is sent on channel `ch`
    /// (deliver or get-ok).
    pub(super) fn count_delivery(&mut self, ch: super::ChannelId, redelivered: bool) {
        self.count(ch, |n| {
            n.delivered += 1;
            n.redelivered += u64::from(redelivered);
        });
    }
}

impl crate::Broker {
    /// Client traffic counts and confirm latencies since the node started.
    #[must_use]
    pub fn message_stats(&self) -> (MessageCounters, LatencyHistogram) {
        let (mut n, mut h) = (self.retired_counters, self.retired_latency);
        for c in self.client_conns() {
            n.add(&c.counters);
            h.add(&c.latency);
        }
        (n, h)
    }

    /// The group commits run since the node started.
    #[must_use]
    pub fn io_stats(&self) -> IoStats {
        self.io
    }

    /// The connections of clients of this node (not the forwarding links
    /// other nodes' brokers open here).
    pub(super) fn client_conns(&self) -> impl Iterator<Item = &super::Conn> {
        self.conns.values().filter(|c| c.link.is_none())
    }

    /// How many of `q`'s consumers are on this node's client connections
    /// (a consumer forwarded here is counted on its client's node).
    pub(super) fn client_consumers(&self, q: &super::Queue) -> usize {
        q.consumers
            .iter()
            .filter(|c| self.conns.get(&c.conn).is_some_and(|c| c.link.is_none()))
            .count()
    }

    /// Every queue's counters and lengths, cheaply (no arguments, no
    /// policies), for sampling rates.
    #[must_use]
    pub fn queue_samples(&self) -> Vec<QueueSample> {
        let mut out = Vec::new();
        for (vn, v) in &self.vhosts {
            for q in v.queues.values() {
                let s = q.store.stats();
                out.push(QueueSample {
                    vhost: vn.clone(),
                    name: q.name.to_string(),
                    served_here: q.remote.is_none(),
                    counters: q.counters,
                    ready: s.ready,
                    unacked: s.unacked,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = LatencyHistogram::default();
        for ms in [0, 1, 3, 40, 20_000] {
            h.observe(ms);
        }
        let mut other = LatencyHistogram::default();
        other.observe(2);
        h.add(&other);
        let b: Vec<(u64, u64)> = h.cumulative().collect();
        assert_eq!(b[0], (1, 2));
        assert_eq!(b[1], (2, 3));
        assert_eq!(b[2], (5, 4));
        assert_eq!(b[5], (50, 5));
        assert_eq!(b.last(), Some(&(10_000, 5)), "20 s is only in +Inf");
        assert_eq!((h.count(), h.sum_ms()), (6, 20_046));
    }
}
