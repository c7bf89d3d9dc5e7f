//! Prometheus text exposition at `/metrics`, with RabbitMQ's metric names
//! (`rabbitmq_queue_messages_ready`, `rabbitmq_global_messages_*`, …)
//! plus Warren's ring gauges and confirm latency histogram.
//!
//! As rabbitmq_prometheus does, each node exports what is its own: the
//! queues it serves (a mirrored queue's master, a queue not forwarded
//! elsewhere), its client connections, channels and consumers, its
//! clients' message counts and its process. Summed over the nodes, each
//! queue and client counts once. What several nodes report of one thing
//! carries the `node` label of the node that reports it, as
//! `rabbitmq_identity_info` names it: the exchanges (every node holds them
//! all) and each replica's own view of its queue's ring
//! (`warren_queue_ring_view`, `warren_queue_ring_pending`, from the master
//! and every mirror).

use std::fmt::Write as _;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::Management;

/// One queue with its ring membership, as the per-queue metrics read it.
struct Row {
    q: warren_broker::QueueInfo,
    /// Master and mirrors.
    members: u64,
    /// Synchronised mirrors.
    synced: u64,
}

/// Reads one per-queue value (`None`: the queue has none, e.g. no ring).
type QueueValue = fn(&Row) -> Option<u64>;

/// Which queues a per-queue family covers on this node.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// The queues this node serves: the queue's own figures.
    Served,
    /// Every replica this node holds (master or mirror), labelled with
    /// the node: what each replica sees of its ring.
    Replica,
}

/// Escapes a label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// The metrics page as text.
pub fn render(s: &Management) -> String {
    let (o, queues) = (s.overview(), s.queues(None));
    let node = label(&s.node);
    let mut out = String::new();
    family(
        &mut out,
        "rabbitmq_identity_info",
        "gauge",
        "Node and cluster names",
    );
    let _ = writeln!(
        out,
        "rabbitmq_identity_info{{rabbitmq_node=\"{node}\",rabbitmq_cluster=\"{node}\"}} 1"
    );
    family(&mut out, "rabbitmq_build_info", "gauge", "Versions");
    let _ = writeln!(
        out,
        "rabbitmq_build_info{{rabbitmq_version=\"3.13.7\",product_name=\"{}\",product_version=\"{}\"}} 1",
        label(&s.product.0),
        label(&s.product.1)
    );
    for (name, help, v) in [
        (
            "rabbitmq_connections",
            "Open client connections of this node",
            o.connections,
        ),
        (
            "rabbitmq_channels",
            "Open channels of this node's client connections",
            o.channels,
        ),
        (
            "rabbitmq_consumers",
            "Consumers of this node's client connections",
            o.consumers,
        ),
        (
            "rabbitmq_queues",
            "Queues served by this node (masters)",
            queues.iter().filter(|q| q.served_here).count() as u64,
        ),
    ] {
        family(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name} {v}");
    }
    family(
        &mut out,
        "rabbitmq_exchanges",
        "gauge",
        "Exchanges in the cluster, as the node labelled sees them (every node reports them all)",
    );
    let _ = writeln!(out, "rabbitmq_exchanges{{node=\"{node}\"}} {}", o.exchanges);
    let per_queue: [(&str, &str, &str, Scope, QueueValue); 13] = [
        (
            "rabbitmq_queue_messages_ready",
            "gauge",
            "Messages ready to be delivered",
            Scope::Served,
            |r| Some(r.q.messages_ready),
        ),
        (
            "rabbitmq_queue_messages_unacked",
            "gauge",
            "Messages delivered and not yet acknowledged",
            Scope::Served,
            |r| Some(r.q.messages_unacknowledged),
        ),
        (
            "rabbitmq_queue_messages",
            "gauge",
            "Ready and unacknowledged messages",
            Scope::Served,
            |r| Some(r.q.messages_ready + r.q.messages_unacknowledged),
        ),
        (
            "rabbitmq_queue_messages_bytes",
            "gauge",
            "Bytes of ready and unacknowledged messages",
            Scope::Served,
            |r| Some(r.q.message_bytes_ready + r.q.message_bytes_unacknowledged),
        ),
        (
            "rabbitmq_queue_consumers",
            "gauge",
            "Consumers of the queue",
            Scope::Served,
            |r| Some(r.q.consumers),
        ),
        (
            "rabbitmq_queue_messages_published_total",
            "counter",
            "Messages published into the queue (on the node serving it)",
            Scope::Served,
            |r| Some(r.q.counters.published),
        ),
        (
            "rabbitmq_queue_messages_delivered_total",
            "counter",
            "Messages delivered or fetched from the queue (on the node serving it)",
            Scope::Served,
            |r| Some(r.q.counters.delivered),
        ),
        (
            "rabbitmq_queue_messages_redelivered_total",
            "counter",
            "Of those, redelivered",
            Scope::Served,
            |r| Some(r.q.counters.redelivered),
        ),
        (
            "rabbitmq_queue_messages_acked_total",
            "counter",
            "Deliveries from the queue acknowledged (on the node serving it)",
            Scope::Served,
            |r| Some(r.q.counters.acked),
        ),
        (
            "warren_queue_ring_view",
            "gauge",
            "The view version (epoch) of the queue's ring, as this node's replica has it",
            Scope::Replica,
            |r| r.q.ring.map(|g| g.view),
        ),
        (
            "warren_queue_ring_pending",
            "gauge",
            "Publishes and fetches sent around the queue's ring not yet held by every member (GM's pending buffer)",
            Scope::Replica,
            |r| r.q.ring.map(|g| g.pending),
        ),
        (
            "warren_queue_ring_members",
            "gauge",
            "Members of the queue's ring view (master and mirrors)",
            Scope::Served,
            |r| Some(r.members),
        ),
        (
            "warren_queue_synchronised_mirrors",
            "gauge",
            "Synchronised mirrors of the queue",
            Scope::Served,
            |r| Some(r.synced),
        ),
    ];
    let rows: Vec<Row> = queues
        .into_iter()
        .map(|q| {
            let m = s.mirrors.mirrors(&q.vhost, &q.name).unwrap_or_default();
            Row {
                members: 1 + m.slave_nodes.len() as u64,
                synced: m.synchronised_slave_nodes.len() as u64,
                q,
            }
        })
        .collect();
    for (name, kind, help, scope, f) in per_queue {
        family(&mut out, name, kind, help);
        for r in rows
            .iter()
            .filter(|r| scope == Scope::Replica || r.q.served_here)
        {
            if let Some(v) = f(r) {
                let (vh, qn) = (label(&r.q.vhost), label(&r.q.name));
                let at = match scope {
                    Scope::Served => String::new(),
                    Scope::Replica => format!(",node=\"{node}\""),
                };
                let _ = writeln!(out, "{name}{{vhost=\"{vh}\",queue=\"{qn}\"{at}}} {v}");
            }
        }
    }
    let (n, latency) = s.message_stats();
    for (name, help, v) in [
        (
            "rabbitmq_global_messages_received_total",
            "Messages published by clients",
            n.received,
        ),
        (
            "rabbitmq_global_messages_received_confirm_total",
            "Messages published on channels in confirm mode",
            n.received_confirm,
        ),
        (
            "rabbitmq_global_messages_routed_total",
            "Published messages routed to a queue",
            n.routed,
        ),
        (
            "rabbitmq_global_messages_unroutable_returned_total",
            "Unroutable mandatory messages returned",
            n.unroutable_returned,
        ),
        (
            "rabbitmq_global_messages_unroutable_dropped_total",
            "Unroutable messages dropped",
            n.unroutable_dropped,
        ),
        (
            "rabbitmq_global_messages_confirmed_total",
            "Publisher confirms sent",
            n.confirmed,
        ),
        (
            "rabbitmq_global_messages_delivered_total",
            "Messages delivered to clients (consume and get)",
            n.delivered,
        ),
        (
            "rabbitmq_global_messages_redelivered_total",
            "Of those, redelivered",
            n.redelivered,
        ),
        (
            "rabbitmq_global_messages_acknowledged_total",
            "Deliveries acknowledged by clients",
            n.acknowledged,
        ),
        (
            "rabbitmq_global_messages_get_empty_total",
            "basic.get answered empty",
            n.get_empty,
        ),
    ] {
        family(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name}{{protocol=\"amqp091\"}} {v}");
    }
    // rabbitmq_prometheus's I/O families: a group commit is Warren's sync.
    let io = s.io_stats();
    family(
        &mut out,
        "rabbitmq_io_sync_ops_total",
        "counter",
        "Group commits (the queue logs' appends written and synced together)",
    );
    let _ = writeln!(out, "rabbitmq_io_sync_ops_total {}", io.syncs);
    family(
        &mut out,
        "rabbitmq_io_sync_time_seconds_total",
        "counter",
        "Time spent in group commits",
    );
    let _ = writeln!(
        out,
        "rabbitmq_io_sync_time_seconds_total {}",
        io.sync_micros as f64 / 1e6
    );
    family(
        &mut out,
        "warren_io_synced_logs_total",
        "counter",
        "Queue logs written and synced, summed over the group commits",
    );
    let _ = writeln!(out, "warren_io_synced_logs_total {}", io.logs_synced);
    // The node's one broker lock (ARCHITECTURE.md, "Invariants"): held
    // seconds per second is how busy it is, and against
    // `process_cpu_seconds_total` the share of the node's work done under it.
    let lock = s.lock_stats();
    let mut families = vec![
        (
            "warren_broker_lock_acquisitions_total",
            "counter",
            "Times the node's broker lock was taken",
            lock.acquisitions as f64,
        ),
        (
            "warren_broker_lock_contended_total",
            "counter",
            "Times a taker found the broker lock held and waited",
            lock.contended as f64,
        ),
        (
            "warren_broker_lock_wait_seconds_total",
            "counter",
            "Time spent waiting for the broker lock (wall clock)",
            lock.wait.as_secs_f64(),
        ),
        (
            "warren_broker_lock_held_seconds_total",
            "counter",
            "Time the broker lock was held (wall clock)",
            lock.held.as_secs_f64(),
        ),
    ];
    // The replica hub: served per turn is how many replicas a turn batches.
    if let Some(hub) = s.mirrors.hub() {
        families.extend([
            (
                "warren_mirror_hub_turns_total",
                "counter",
                "Turns of the replica hub, the task that moves every replica's ring traffic",
                hub.turns as f64,
            ),
            (
                "warren_mirror_hub_replicas_served_total",
                "counter",
                "Replicas the hub served, summed over its turns",
                hub.replicas_served as f64,
            ),
        ]);
    }
    for (name, kind, help, v) in families {
        family(&mut out, name, kind, help);
        let _ = writeln!(out, "{name} {v}");
    }
    let name = "warren_confirm_latency_seconds";
    family(
        &mut out,
        name,
        "histogram",
        "Time from reading a confirm-mode publish to sending its basic.ack",
    );
    for (le_ms, count) in latency.cumulative() {
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"{}\"}} {count}",
            le_ms as f64 / 1000.0
        );
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", latency.count());
    let _ = writeln!(out, "{name}_sum {}", latency.sum_ms() as f64 / 1000.0);
    let _ = writeln!(out, "{name}_count {}", latency.count());
    family(
        &mut out,
        "rabbitmq_process_resident_memory_bytes",
        "gauge",
        "Resident memory of the node process",
    );
    let r = s.broker().resources();
    let _ = writeln!(
        out,
        "rabbitmq_process_resident_memory_bytes {}",
        r.sample.memory_used
    );
    for (name, help, v) in [
        (
            "rabbitmq_resident_memory_limit_bytes",
            "Memory high watermark in bytes",
            r.memory_limit,
        ),
        (
            "rabbitmq_disk_space_available_bytes",
            "Disk space available in bytes",
            r.sample.disk_free,
        ),
        (
            "rabbitmq_disk_space_available_limit_bytes",
            "Free disk space low watermark in bytes",
            r.disk_free_limit,
        ),
        (
            "rabbitmq_alarms_memory_used_watermark",
            "is 1 when the memory alarm is in effect",
            u64::from(r.memory_alarm),
        ),
        (
            "rabbitmq_alarms_free_disk_space_watermark",
            "is 1 when the disk alarm is in effect",
            u64::from(r.disk_alarm),
        ),
    ] {
        family(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name} {v}");
    }
    if let Some(cpu) = crate::process::cpu_seconds() {
        family(
            &mut out,
            "process_cpu_seconds_total",
            "counter",
            "CPU time the node process used, user and system",
        );
        let _ = writeln!(out, "process_cpu_seconds_total {cpu}");
    }
    if let Some(fds) = crate::process::fds() {
        family(
            &mut out,
            "rabbitmq_process_open_fds",
            "gauge",
            "Open file descriptors",
        );
        let _ = writeln!(out, "rabbitmq_process_open_fds {fds}");
    }
    if let Some(limit) = crate::process::fd_limit() {
        family(
            &mut out,
            "rabbitmq_process_max_fds",
            "gauge",
            "Open file descriptors limit",
        );
        let _ = writeln!(out, "rabbitmq_process_max_fds {limit}");
    }
    if let Some((used, total)) = s.node_control.as_ref().and_then(|c| c.client_sockets()) {
        family(
            &mut out,
            "rabbitmq_process_open_tcp_sockets",
            "gauge",
            "Open client TCP sockets",
        );
        let _ = writeln!(out, "rabbitmq_process_open_tcp_sockets {used}");
        if let Some(total) = total {
            family(
                &mut out,
                "rabbitmq_process_max_tcp_sockets",
                "gauge",
                "Open client TCP sockets limit",
            );
            let _ = writeln!(out, "rabbitmq_process_max_tcp_sockets {total}");
        }
    }
    out
}

async fn metrics(State(s): State<Management>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(&s),
    )
}

/// The Prometheus router (`/metrics`), served on its own listener.
pub fn metrics_router(state: Management) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Serves [`metrics_router`] on `listener`.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    state: Management,
) -> std::io::Result<()> {
    let idle = state.http_idle;
    crate::listener::serve_router(listener, metrics_router(state), idle).await
}
