//! Prometheus text exposition at `/metrics`, with RabbitMQ's metric names
//! (`rabbitmq_queue_messages_ready`, …) plus Warren's ring gauges.

use std::fmt::Write as _;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::Management;

/// Reads one per-queue gauge.
type QueueGauge = fn(&warren_broker::QueueInfo) -> u64;

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
    let (o, queues) = {
        let b = s.broker();
        (b.overview(), b.queues(None))
    };
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
        "rabbitmq_build_info{{rabbitmq_version=\"3.13.7\",product_name=\"Warren\",product_version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    for (name, help, v) in [
        (
            "rabbitmq_connections",
            "Open client connections",
            o.connections,
        ),
        ("rabbitmq_channels", "Open channels", o.channels),
        ("rabbitmq_consumers", "Consumers", o.consumers),
        ("rabbitmq_queues", "Queues", o.queues),
        ("rabbitmq_exchanges", "Exchanges", o.exchanges),
    ] {
        family(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name} {v}");
    }
    let gauges: [(&str, &str, QueueGauge); 5] = [
        (
            "rabbitmq_queue_messages_ready",
            "Messages ready to be delivered",
            |q| q.messages_ready,
        ),
        (
            "rabbitmq_queue_messages_unacked",
            "Messages delivered and not yet acknowledged",
            |q| q.messages_unacknowledged,
        ),
        (
            "rabbitmq_queue_messages",
            "Ready and unacknowledged messages",
            |q| q.messages_ready + q.messages_unacknowledged,
        ),
        (
            "rabbitmq_queue_messages_bytes",
            "Bytes of ready and unacknowledged messages",
            |q| q.message_bytes_ready + q.message_bytes_unacknowledged,
        ),
        ("rabbitmq_queue_consumers", "Consumers of the queue", |q| {
            q.consumers
        }),
    ];
    for (name, help, f) in gauges {
        family(&mut out, name, "gauge", help);
        for q in &queues {
            let _ = writeln!(
                out,
                "{name}{{vhost=\"{}\",queue=\"{}\"}} {}",
                label(&q.vhost),
                label(&q.name),
                f(q)
            );
        }
    }
    family(
        &mut out,
        "warren_queue_ring_members",
        "gauge",
        "Members of the queue's ring view (master and mirrors)",
    );
    let mut synced = String::new();
    for q in &queues {
        let m = s.mirrors.mirrors(&q.vhost, &q.name).unwrap_or_default();
        let (vh, qn) = (label(&q.vhost), label(&q.name));
        let _ = writeln!(
            out,
            "warren_queue_ring_members{{vhost=\"{vh}\",queue=\"{qn}\"}} {}",
            1 + m.slave_nodes.len()
        );
        let _ = writeln!(
            synced,
            "warren_queue_synchronised_mirrors{{vhost=\"{vh}\",queue=\"{qn}\"}} {}",
            m.synchronised_slave_nodes.len()
        );
    }
    family(
        &mut out,
        "warren_queue_synchronised_mirrors",
        "gauge",
        "Synchronised mirrors of the queue",
    );
    out.push_str(&synced);
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
    family(
        &mut out,
        "rabbitmq_process_open_fds",
        "gauge",
        "Open file descriptors",
    );
    let _ = writeln!(out, "rabbitmq_process_open_fds {}", crate::api::fd_used());
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
    axum::serve(listener, metrics_router(state)).await
}
