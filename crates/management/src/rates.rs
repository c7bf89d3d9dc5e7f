//! Message rates as RabbitMQ's management plugin shows them with
//! `rates_mode: basic`.
//!
//! Every `collect_statistics_interval` (5 s by default, as RabbitMQ's) the
//! sampler reads the broker's counters and queue lengths; each object keeps
//! its last samples. A figure `X` is shown with `X_details: {"rate": R}`,
//! `R` the difference of the last two samples per second (0.0 until there
//! are two, and once the last is older than two intervals). With
//! `msg_rates_age`/`msg_rates_incr` (message counts), `lengths_age`/
//! `lengths_incr` (queue lengths) or `data_rates_age`/`data_rates_incr`
//! (connection octets) in the query, the details also carry the `samples`
//! in that range (newest first, `{"sample", "timestamp"}`) with `avg_rate`
//! and `avg`, as RabbitMQ's `rabbit_mgmt_stats:format_range` gives them.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use warren_broker::{ChannelInfo, ConnectionInfo, MessageCounters, QueueCounters};

use crate::Management;

/// RabbitMQ's default `collect_statistics_interval`.
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Samples kept of each object: a minute at the default interval
/// (RabbitMQ's default chart range), and the node-wide ones for ten.
const KEPT: usize = 13;
const KEPT_NODE: usize = 121;

/// The figures sampled of one kind of object, in sample order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kind {
    /// Counters (they only grow while the object lives): message counts or
    /// octets.
    pub(crate) counters: &'static [&'static str],
    /// Which query range the counters' samples follow: `msg_rates` or
    /// `data_rates`.
    counters_range: &'static str,
    /// Gauges (queue lengths), after the counters.
    pub(crate) gauges: &'static [&'static str],
}

/// The node-wide message counts and queue lengths (the overview).
pub(crate) const NODE: Kind = Kind {
    counters: &[
        "publish",
        "confirm",
        "return_unroutable",
        "drop_unroutable",
        "deliver_get",
        "redeliver",
        "ack",
        "get_empty",
    ],
    counters_range: "msg_rates",
    gauges: &["messages", "messages_ready", "messages_unacknowledged"],
};

/// A queue's message counts and lengths.
pub(crate) const QUEUE: Kind = Kind {
    counters: &["publish", "deliver_get", "redeliver", "ack"],
    counters_range: "msg_rates",
    gauges: &["messages", "messages_ready", "messages_unacknowledged"],
};

/// A channel's message counts.
pub(crate) const CHANNEL: Kind = Kind {
    gauges: &[],
    ..NODE
};

/// A connection's octets.
pub(crate) const CONNECTION: Kind = Kind {
    counters: &["recv_oct", "send_oct"],
    counters_range: "data_rates",
    gauges: &[],
};

/// A message counter set's values in [`NODE`]'s (and [`CHANNEL`]'s) order.
pub(crate) fn message_values(n: &MessageCounters) -> Vec<u64> {
    vec![
        n.received,
        n.confirmed,
        n.unroutable_returned,
        n.unroutable_dropped,
        n.delivered,
        n.redelivered,
        n.acknowledged,
        n.get_empty,
    ]
}

/// A queue's values in [`QUEUE`]'s order.
pub(crate) fn queue_values(c: &QueueCounters, ready: u64, unacked: u64) -> Vec<u64> {
    vec![
        c.published,
        c.delivered,
        c.redelivered,
        c.acked,
        ready + unacked,
        ready,
        unacked,
    ]
}

/// A connection's values in [`CONNECTION`]'s order.
pub(crate) fn connection_values(c: &ConnectionInfo) -> Vec<u64> {
    vec![c.octets.received, c.octets.sent]
}

/// One object's samples, oldest first: (milliseconds since the epoch,
/// values in its [`Kind`]'s order).
#[derive(Debug, Default)]
pub(crate) struct Series {
    samples: VecDeque<(u64, Vec<u64>)>,
}

impl Series {
    fn push(&mut self, at: u64, values: Vec<u64>, counters: usize, kept: usize) {
        // A counter that went down belongs to a new object of the same
        // name (a queue deleted and declared again, a new master): its
        // history starts again.
        if let Some((_, last)) = self.samples.back()
            && last.iter().zip(&values).take(counters).any(|(a, b)| b < a)
        {
            self.samples.clear();
        }
        self.samples.push_back((at, values));
        while self.samples.len() > kept {
            self.samples.pop_front();
        }
    }

    /// Field `i`'s rate per second over the last interval; 0.0 without two
    /// samples or when the last is older than `stale_ms`.
    fn rate(&self, i: usize, now: u64, stale_ms: u64) -> f64 {
        let n = self.samples.len();
        if n < 2 {
            return 0.0;
        }
        let ((t0, a), (t1, b)) = (&self.samples[n - 2], &self.samples[n - 1]);
        if now.saturating_sub(*t1) > stale_ms || t1 <= t0 {
            return 0.0;
        }
        (b[i] as f64 - a[i] as f64) * 1000.0 / (t1 - t0) as f64
    }
}

/// A range asked for in the query: how far back and how far apart
/// (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    age_ms: u64,
    incr_ms: u64,
}

/// The ranges a request asks for, by family (`msg_rates`, `lengths`,
/// `data_rates`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Ranges(HashMap<&'static str, Range>);

impl Ranges {
    /// Reads `{family}_age` and `{family}_incr` (seconds) from the query.
    pub(crate) fn from_query(q: &HashMap<String, String>) -> Self {
        let mut out = HashMap::new();
        for family in ["msg_rates", "lengths", "data_rates"] {
            let secs = |k: &str| q.get(&format!("{family}_{k}"))?.parse::<u64>().ok();
            if let (Some(age), Some(incr)) = (secs("age"), secs("incr"))
                && incr > 0
            {
                let r = Range {
                    age_ms: age.saturating_mul(1000),
                    incr_ms: incr.saturating_mul(1000),
                };
                out.insert(family, r);
            }
        }
        Self(out)
    }
}

/// Every object's samples, as the sampler keeps them.
#[derive(Debug)]
pub(crate) struct Rates {
    interval_ms: u64,
    node: Series,
    queues: HashMap<(String, String), Series>,
    connections: HashMap<u64, Series>,
    channels: HashMap<(u64, u16), Series>,
}

/// What one sample reads from the broker (under its lock).
struct Reading {
    node: Vec<u64>,
    queues: Vec<((String, String), Vec<u64>)>,
    connections: Vec<(u64, Vec<u64>)>,
    channels: Vec<((u64, u16), Vec<u64>)>,
}

impl Reading {
    fn take(s: &Management) -> Self {
        let (n, _) = s.message_stats();
        let o = s.overview();
        let (connections, channels) = s.conns_and_channels();
        let mut node = message_values(&n);
        node.extend([
            o.messages_ready + o.messages_unacknowledged,
            o.messages_ready,
            o.messages_unacknowledged,
        ]);
        Self {
            node,
            queues: s
                .queue_samples()
                .into_iter()
                .map(|q| {
                    let v = queue_values(&q.counters, q.ready, q.unacked);
                    ((q.vhost, q.name), v)
                })
                .collect(),
            connections: connections
                .iter()
                .map(|c| (c.id, connection_values(c)))
                .collect(),
            channels: channels
                .iter()
                .map(|c: &ChannelInfo| ((c.conn, c.number), message_values(&c.counters)))
                .collect(),
        }
    }
}

/// Pushes `readings` into `series`, dropping the series of objects gone.
fn push_all<K: std::hash::Hash + Eq>(
    series: &mut HashMap<K, Series>,
    readings: Vec<(K, Vec<u64>)>,
    at: u64,
    kind: Kind,
) {
    let mut seen = HashMap::with_capacity(readings.len());
    for (k, v) in readings {
        let mut s = series.remove(&k).unwrap_or_default();
        s.push(at, v, kind.counters.len(), KEPT);
        seen.insert(k, s);
    }
    *series = seen;
}

impl Rates {
    /// No samples yet, taken every `interval`.
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval_ms: u64::try_from(interval.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            node: Series::default(),
            queues: HashMap::new(),
            connections: HashMap::new(),
            channels: HashMap::new(),
        }
    }

    fn record(&mut self, r: Reading, at: u64) {
        self.node.push(at, r.node, NODE.counters.len(), KEPT_NODE);
        push_all(&mut self.queues, r.queues, at, QUEUE);
        push_all(&mut self.connections, r.connections, at, CONNECTION);
        push_all(&mut self.channels, r.channels, at, CHANNEL);
    }

    /// The node-wide series.
    pub(crate) fn node(&self) -> &Series {
        &self.node
    }

    /// A queue's series (of a queue this node serves).
    pub(crate) fn queue(&self, vhost: &str, name: &str) -> Option<&Series> {
        self.queues.get(&(vhost.to_owned(), name.to_owned()))
    }

    /// A connection's series.
    pub(crate) fn connection(&self, id: u64) -> Option<&Series> {
        self.connections.get(&id)
    }

    /// A channel's series.
    pub(crate) fn channel(&self, conn: u64, number: u16) -> Option<&Series> {
        self.channels.get(&(conn, number))
    }

    /// Field `i`'s rate in `series` now (0.0 without one).
    pub(crate) fn rate(&self, series: Option<&Series>, i: usize) -> f64 {
        series.map_or(0.0, |s| s.rate(i, now_ms(), 2 * self.interval_ms))
    }

    /// `{X: value, X_details: {...}}` for each counter `X` of `kind`, with
    /// `values` the current counts in its order: RabbitMQ's
    /// `message_stats` (or a connection's octets).
    pub(crate) fn counters(
        &self,
        series: Option<&Series>,
        kind: Kind,
        values: &[u64],
        ranges: &Ranges,
    ) -> Map<String, Value> {
        let mut obj = Map::new();
        for (i, (field, v)) in kind.counters.iter().zip(values).enumerate() {
            obj.insert((*field).to_owned(), json!(v));
            let d = self.detail(series, i, kind.counters_range, ranges);
            obj.insert(format!("{field}_details"), d);
        }
        obj
    }

    /// Inserts `X_details` into `obj` for each gauge `X` of `kind` (queue
    /// lengths).
    pub(crate) fn gauges(
        &self,
        obj: &mut Map<String, Value>,
        series: Option<&Series>,
        kind: Kind,
        ranges: &Ranges,
    ) {
        for (i, field) in kind.gauges.iter().enumerate() {
            let d = self.detail(series, kind.counters.len() + i, "lengths", ranges);
            obj.insert(format!("{field}_details"), d);
        }
    }

    /// Field `i`'s details: its rate, and the samples of a range `ranges`
    /// asks for of `family`.
    fn detail(&self, series: Option<&Series>, i: usize, family: &str, ranges: &Ranges) -> Value {
        let mut d = Map::new();
        d.insert("rate".into(), json!(self.rate(series, i)));
        if let (Some(r), Some(s)) = (ranges.0.get(family), series) {
            range_samples(&mut d, s, i, *r, now_ms());
        }
        Value::Object(d)
    }
}

/// `samples` (newest first, at least `incr` apart, within `age`), and with
/// two or more `avg_rate` and `avg`, of field `i`.
fn range_samples(d: &mut Map<String, Value>, s: &Series, i: usize, r: Range, now: u64) {
    let mut picked: Vec<(u64, u64)> = Vec::new();
    for (at, v) in s.samples.iter().rev() {
        if now.saturating_sub(*at) > r.age_ms {
            break;
        }
        if picked.last().is_none_or(|(t, _)| t - at >= r.incr_ms) {
            picked.push((*at, v[i]));
        }
    }
    if let (Some((t_new, new)), Some((t_old, old))) = (picked.first(), picked.last())
        && picked.len() > 1
    {
        let avg_rate = (*new as f64 - *old as f64) * 1000.0 / (t_new - t_old) as f64;
        let avg = picked.iter().map(|(_, v)| *v as f64).sum::<f64>() / picked.len() as f64;
        d.insert("avg_rate".into(), json!(avg_rate));
        d.insert("avg".into(), json!(avg));
    }
    let samples: Vec<Value> = picked
        .iter()
        .map(|(at, v)| json!({"sample": v, "timestamp": at}))
        .collect();
    d.insert("samples".into(), Value::Array(samples));
}

/// Milliseconds since the Unix epoch (RabbitMQ's sample timestamps).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Aborts a task when dropped.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Takes a sample every interval, for as long as the task runs.
pub(crate) async fn sample_forever(s: Management) {
    let mut every = tokio::time::interval(s.stats_interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        // Timed once read (the shards' locks may have kept the sampler
        // waiting).
        let (reading, at) = (Reading::take(&s), now_ms());
        s.rates().record(reading, at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates_with(samples: &[(u64, Vec<u64>)]) -> Series {
        let mut s = Series::default();
        for (at, v) in samples {
            s.push(*at, v.clone(), 1, KEPT);
        }
        s
    }

    #[test]
    fn a_rate_is_the_last_difference_per_second() {
        let s = rates_with(&[
            (1_000, vec![0, 5]),
            (6_000, vec![10, 5]),
            (11_000, vec![60, 2]),
        ]);
        assert_eq!(s.rate(0, 11_000, 10_000), 10.0);
        assert_eq!(s.rate(1, 11_000, 10_000), -0.6, "a gauge may fall");
        assert_eq!(s.rate(0, 30_000, 10_000), 0.0, "stale");
        assert_eq!(
            rates_with(&[(1_000, vec![7, 0])]).rate(0, 1_000, 10_000),
            0.0
        );
    }

    #[test]
    fn a_counter_going_down_starts_a_new_history() {
        let s = rates_with(&[(1_000, vec![50, 0]), (6_000, vec![3, 0])]);
        assert_eq!(s.samples.len(), 1);
        assert_eq!(s.rate(0, 6_000, 10_000), 0.0);
    }

    #[test]
    fn ranges_pick_samples_newest_first_with_averages() {
        let s = rates_with(&[
            (0, vec![0]),
            (5_000, vec![10]),
            (10_000, vec![30]),
            (15_000, vec![60]),
        ]);
        let mut d = Map::new();
        let r = Range {
            age_ms: 10_000,
            incr_ms: 5_000,
        };
        range_samples(&mut d, &s, 0, r, 15_000);
        assert_eq!(
            d["samples"],
            json!([{"sample": 60, "timestamp": 15_000}, {"sample": 30, "timestamp": 10_000}, {"sample": 10, "timestamp": 5_000}])
        );
        assert_eq!(d["avg_rate"], json!(5.0));
        assert_eq!(d["avg"], json!(100.0 / 3.0));
        let q: HashMap<String, String> = [
            ("lengths_age", "60"),
            ("lengths_incr", "5"),
            ("msg_rates_age", "x"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let ranges = Ranges::from_query(&q);
        assert_eq!(
            ranges.0.get("lengths"),
            Some(&Range {
                age_ms: 60_000,
                incr_ms: 5_000
            })
        );
        assert!(!ranges.0.contains_key("msg_rates"));
    }
}
