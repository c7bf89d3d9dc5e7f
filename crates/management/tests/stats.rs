//! Message rates (`rates_mode: basic`) over a real broker driven by lapin,
//! the shapes of `/api/channels` and the rate details, and which queues a
//! node's `/metrics` exports.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::Value;
use warren_management::Management;

/// How often the test's management API samples (RabbitMQ's
/// `collect_statistics_interval`).
const INTERVAL: Duration = Duration::from_millis(100);

async fn get(addr: &str, path: &str) -> Value {
    let (status, body) = common::request_as(addr, ("guest", "guest"), "GET", path, None).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls `path` until `done` holds of its JSON (at most 30 s); the last JSON.
async fn until(addr: &str, path: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = get(addr, path).await;
        if done(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: never so in {v:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn rate(stats: &Value, field: &str) -> f64 {
    stats[format!("{field}_details")]["rate"]
        .as_f64()
        .unwrap_or_else(|| panic!("no {field}_details.rate in {stats}"))
}

/// Every count `X` in `stats` has `X_details` with a numeric rate, as
/// RabbitMQ's `format_rate` gives them.
fn every_count_has_a_rate(stats: &Value) {
    let o = stats.as_object().expect("an object");
    assert!(!o.is_empty());
    for (k, v) in o {
        if let Some(field) = k.strip_suffix("_details") {
            assert!(o.contains_key(field), "{k} without {field} in {stats}");
            assert!(v["rate"].is_f64(), "{k} has no numeric rate in {stats}");
        } else {
            assert!(v.is_u64(), "{k} is not a count in {stats}");
            rate(stats, k);
        }
    }
}

/// A rate is positive and per second: over one sample interval it cannot
/// be more than the whole count. (The ticks are `INTERVAL` apart, the
/// readings they take a little less if one waited for the broker's lock:
/// a tenth of it is the bound, far from a rate per millisecond.)
fn plausible(stats: &Value, field: &str) {
    let (r, total) = (rate(stats, field), stats[field].as_u64().unwrap() as f64);
    assert!(r > 0.0, "{field} rate {r} in {stats}");
    assert!(
        r <= total / (INTERVAL.as_secs_f64() / 10.0),
        "{field} rate {r} more than {total} in a tenth of an interval"
    );
}

/// Publishes with confirms into `rated`, gets and acks them, until `stop`.
async fn traffic(url: String, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) -> Connection {
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "rated".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for _ in 0..20_000 {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        ch.basic_publish(
            "".into(),
            "rated".into(),
            BasicPublishOptions::default(),
            b"hello",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        sent.fetch_add(1, Ordering::SeqCst);
        if let Some(m) = ch
            .basic_get("rated".into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            m.ack(BasicAckOptions::default()).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rates_follow_real_traffic_and_fall_to_zero_when_it_stops() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::broker(dir.path());
    let state = Management::new(broker.clone()).statistics_interval(INTERVAL);
    let addr = common::serve(state).await;
    let url = common::amqp(broker).await;
    let (stop, sent) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let client = tokio::spawn(traffic(url, stop.clone(), sent.clone()));

    let o = until(&addr, "/api/overview", "overview rates", |o| {
        let m = &o["message_stats"];
        ["publish", "confirm", "deliver_get", "ack"]
            .iter()
            .all(|f| m[format!("{f}_details")]["rate"].as_f64() > Some(0.0))
    })
    .await;
    assert_eq!(o["rates_mode"], "basic");
    let m = &o["message_stats"];
    every_count_has_a_rate(m);
    for f in ["publish", "confirm", "deliver_get", "ack"] {
        plausible(m, f);
    }
    assert_eq!(rate(m, "redeliver"), 0.0);
    assert_eq!(rate(m, "return_unroutable"), 0.0);
    for f in ["messages", "messages_ready", "messages_unacknowledged"] {
        assert!(
            o["queue_totals"][format!("{f}_details")]["rate"].is_f64(),
            "{o}"
        );
    }

    let path =
        "/api/queues/%2F/rated?msg_rates_age=60&msg_rates_incr=1&lengths_age=60&lengths_incr=1";
    // Samples a second apart (the least `_incr`): two once a second has passed.
    let q = until(&addr, path, "queue rates and samples", |q| {
        let m = &q["message_stats"];
        m["publish_details"]["rate"].as_f64() > Some(0.0)
            && m["ack_details"]["rate"].as_f64() > Some(0.0)
            && m["publish_details"]["samples"].as_array().map(Vec::len) >= Some(2)
    })
    .await;
    let qm = &q["message_stats"];
    plausible(qm, "publish");
    plausible(qm, "ack");
    let samples = qm["publish_details"]["samples"].as_array().unwrap();
    assert!(samples.len() >= 2, "{qm}");
    let stamps: Vec<u64> = samples
        .iter()
        .map(|s| s["timestamp"].as_u64().unwrap())
        .collect();
    assert!(
        stamps.windows(2).all(|w| w[0] > w[1]),
        "newest first: {stamps:?}"
    );
    let counts: Vec<u64> = samples
        .iter()
        .map(|s| s["sample"].as_u64().unwrap())
        .collect();
    assert!(
        counts.windows(2).all(|w| w[0] >= w[1]),
        "counts grow: {counts:?}"
    );
    assert!(
        qm["publish_details"]["avg_rate"].as_f64() > Some(0.0),
        "{qm}"
    );
    assert!(q["messages_details"]["samples"].is_array(), "{q}");

    let conns = until(&addr, "/api/connections", "connection octet rates", |c| {
        c[0]["recv_oct_details"]["rate"].as_f64() > Some(0.0)
            && c[0]["send_oct_details"]["rate"].as_f64() > Some(0.0)
    })
    .await;
    let c = &conns[0];
    assert!(
        c["recv_oct"].as_u64() > Some(0) && c["send_oct"].as_u64() > Some(0),
        "{c}"
    );
    let conn_name = c["name"].as_str().unwrap().to_owned();

    let chans = until(&addr, "/api/channels", "channel rates", |c| {
        c.as_array().is_some_and(|a| !a.is_empty())
            && c[0]["message_stats"]["publish_details"]["rate"].as_f64() > Some(0.0)
    })
    .await;
    let ch = &chans[0];
    assert_eq!(ch["number"], 1);
    assert_eq!(ch["confirm"], true);
    assert_eq!(ch["transactional"], false);
    assert_eq!(ch["connection_details"]["name"], conn_name.as_str());
    assert_eq!(ch["name"], format!("{conn_name} (1)"));
    every_count_has_a_rate(&ch["message_stats"]);
    plausible(&ch["message_stats"], "publish");
    let enc = |s: &str| s.replace(' ', "%20").replace('>', "%3E");
    let one = get(
        &addr,
        &format!("/api/channels/{}", enc(ch["name"].as_str().unwrap())),
    )
    .await;
    assert_eq!(one["name"], ch["name"]);
    assert!(one["consumer_details"].is_array(), "{one}");
    let of_conn = get(
        &addr,
        &format!("/api/connections/{}/channels", enc(&conn_name)),
    )
    .await;
    assert_eq!(of_conn.as_array().map(Vec::len), Some(1), "{of_conn}");

    // Traffic stops: within two intervals every rate is 0 again, and the
    // counts stay what was done.
    stop.store(true, Ordering::SeqCst);
    let conn = client.await.unwrap();
    let published = sent.load(Ordering::SeqCst);
    let o = until(&addr, "/api/overview", "rates back to 0", |o| {
        let m = &o["message_stats"];
        m["publish"] == published && rate(m, "publish") == 0.0 && rate(m, "ack") == 0.0
    })
    .await;
    assert_eq!(o["message_stats"]["confirm"], published);
    let q = get(&addr, "/api/queues/%2F/rated").await;
    assert_eq!(q["message_stats"]["publish"], published);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test]
async fn metrics_export_only_the_queues_this_node_serves() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::broker(dir.path());
    let state = Management::new(broker.clone());
    let addr = common::serve(state.clone()).await;
    for q in ["here", "there"] {
        let path = format!("/api/queues/%2F/{q}");
        let (status, _) = common::request_as(&addr, ("guest", "guest"), "PUT", &path, None).await;
        assert_eq!(status, 201);
    }
    // `there`'s master is another node: this one forwards to it.
    broker
        .lock()
        .set_queue_master("/", "there", Some("warren@b"));
    let text = warren_management::render_metrics(&state);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines.contains(&"rabbitmq_queue_messages{vhost=\"/\",queue=\"here\"} 0"),
        "{text}"
    );
    assert!(!text.contains("queue=\"there\""), "{text}");
    assert!(lines.contains(&"rabbitmq_queues 1"), "{text}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("rabbitmq_exchanges{node=\"warren@a\"} ")),
        "{text}"
    );
    // The API shows the forwarded queue, without the stats only its master has.
    let q = get(&addr, "/api/queues/%2F/there").await;
    assert_eq!(q["name"], "there");
    assert!(q.get("message_stats").is_none(), "{q}");
    assert!(get(&addr, "/api/queues/%2F/here").await["message_stats"].is_object());
}

/// The value of an unlabelled series on a metrics page.
fn series(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test]
async fn metrics_count_the_broker_lock_and_the_process_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let broker = common::broker(dir.path());
    let state = Management::new(broker.clone());
    let url = common::amqp(broker.clone()).await;
    let before = warren_management::render_metrics(&state);
    let taken = series(&before, "warren_broker_lock_acquisitions_total");

    // A client's work takes the lock.
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "locked".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for _ in 0..100 {
        ch.basic_publish(
            "".into(),
            "locked".into(),
            BasicPublishOptions::default(),
            b"hello",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let got = ch
        .basic_get("locked".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(got.is_some());
    conn.close(200, "bye".into()).await.unwrap();

    // The kernel counts CPU time in ticks (10 ms): a short test may have
    // none yet. Work until it has one, so that the figure must show it.
    let ticks = || {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let rest = stat.rsplit_once(')').unwrap().1;
        let mut f = rest.split_whitespace().skip(11);
        let user: u64 = f.next().unwrap().parse().unwrap();
        let system: u64 = f.next().unwrap().parse().unwrap();
        user + system
    };
    let mut spin = 0u64;
    while ticks() == 0 {
        for i in 0..100_000u64 {
            spin = std::hint::black_box(spin.wrapping_add(i));
        }
    }
    let text = warren_management::render_metrics(&state);
    let stats = broker.stats();
    let now_taken = series(&text, "warren_broker_lock_acquisitions_total");
    assert!(now_taken > taken, "{taken} then {now_taken}");
    // The page shows the lock's own accounts (read after it, so no fewer).
    assert!(now_taken <= stats.acquisitions as f64);
    let held = series(&text, "warren_broker_lock_held_seconds_total");
    assert!(held > 0.0 && held <= stats.held.as_secs_f64(), "{held}");
    let contended = series(&text, "warren_broker_lock_contended_total");
    let wait = series(&text, "warren_broker_lock_wait_seconds_total");
    assert!(contended <= now_taken && wait >= 0.0, "{contended} {wait}");
    assert!(series(&text, "process_cpu_seconds_total") > 0.0, "{text}");
}
