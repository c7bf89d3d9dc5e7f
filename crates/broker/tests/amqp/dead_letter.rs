//! Dead-lettering (rejected, expired, over the length limit) with
//! RabbitMQ's `x-death` headers, and message expiry on the broker's tick
//! (`broker/dead_letter.rs`).

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic};
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};

use crate::support::{Client, Incoming, Message, Node, QueueOpts, START_MS, s};

/// A client with channel 1 open, fanout exchange `dlx` feeding queue
/// `dead`, and queue `work` dead-lettering to `dlx` with `extra` arguments.
fn setup(node: &Node, extra: &[(&str, AMQPValue)]) -> Client {
    let mut c = node.connect();
    c.open_channel(1);
    c.declare_exchange(1, "dlx", "fanout", false, FieldTable::default())
        .unwrap();
    c.queue(1, "dead");
    c.bind(1, "dead", "dlx", "", FieldTable::default()).unwrap();
    let mut opts = QueueOpts::default().arg("x-dead-letter-exchange", s("dlx"));
    for (k, v) in extra {
        opts = opts.arg(k, v.clone());
    }
    c.declare_queue(1, "work", opts).unwrap();
    c
}

/// The next message of `q` (basic.get, no-ack), which must be there.
fn take(c: &mut Client, q: &str) -> Incoming {
    let i = c.get(1, q, true).unwrap();
    assert_eq!(i.ids(), (60, 71), "basic.get-ok from '{q}': {i:?}");
    i
}

fn field<'a>(t: &'a FieldTable, k: &str) -> &'a AMQPValue {
    t.inner()
        .get(k)
        .unwrap_or_else(|| panic!("no '{k}' in {t:?}"))
}

fn text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => s.to_string(),
        AMQPValue::ShortString(s) => s.to_string(),
        v => panic!("not a string: {v:?}"),
    }
}

/// The `x-death` entries of a message.
fn deaths(i: &Incoming) -> Vec<FieldTable> {
    match field(&i.headers(), "x-death") {
        AMQPValue::FieldArray(a) => a
            .as_slice()
            .iter()
            .map(|v| match v {
                AMQPValue::FieldTable(t) => t.clone(),
                v => panic!("an x-death entry is not a table: {v:?}"),
            })
            .collect(),
        v => panic!("x-death is not an array: {v:?}"),
    }
}

/// Checks one `x-death` entry: queue, reason, exchange, routing keys,
/// count 1 and a time.
fn check_death(d: &FieldTable, queue: &str, reason: &str, exchange: &str, key: &str) {
    assert_eq!(text(field(d, "queue")), queue);
    assert_eq!(text(field(d, "reason")), reason);
    assert_eq!(text(field(d, "exchange")), exchange);
    let AMQPValue::FieldArray(keys) = field(d, "routing-keys") else {
        panic!("routing-keys is not an array: {d:?}");
    };
    let keys: Vec<String> = keys.as_slice().iter().map(text).collect();
    assert_eq!(keys, [key]);
    assert!(
        matches!(field(d, "count"), AMQPValue::LongLongInt(1)),
        "{d:?}"
    );
    assert!(matches!(field(d, "time"), AMQPValue::Timestamp(_)), "{d:?}");
}

#[test]
fn a_rejected_message_goes_to_the_dead_letter_exchange_with_x_death() {
    let node = Node::new();
    let mut c = setup(&node, &[]);
    c.publish(1, "", "work", Message::new("m"));
    let got = c.get(1, "work", false).unwrap();
    assert_eq!(got.ids(), (60, 71));
    c.reject(1, 1, false);
    let dead = take(&mut c, "dead");
    assert_eq!(dead.body, b"m");
    let AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) = &dead.method else {
        unreachable!()
    };
    // Republished to the dead-letter exchange with its routing key.
    assert_eq!(ok.exchange.as_str(), "dlx");
    assert_eq!(ok.routing_key.as_str(), "work");
    let d = deaths(&dead);
    assert_eq!(d.len(), 1);
    check_death(&d[0], "work", "rejected", "", "work");
    let h = dead.headers();
    assert_eq!(text(field(&h, "x-first-death-reason")), "rejected");
    assert_eq!(text(field(&h, "x-first-death-queue")), "work");
    assert_eq!(text(field(&h, "x-first-death-exchange")), "");
    assert_eq!(c.get_body(1, "work"), None);
}

#[test]
fn a_nack_without_requeue_dead_letters_under_the_dead_letter_routing_key() {
    let (_node, mut c) = Node::session();
    c.declare_exchange(1, "dlx", "direct", false, FieldTable::default())
        .unwrap();
    c.queue(1, "dead");
    c.bind(1, "dead", "dlx", "to-dead", FieldTable::default())
        .unwrap();
    let opts = QueueOpts::default()
        .arg("x-dead-letter-exchange", s("dlx"))
        .arg("x-dead-letter-routing-key", s("to-dead"));
    c.declare_queue(1, "work", opts).unwrap();
    c.publish(1, "", "work", Message::new("m"));
    c.consume(1, "work", "ctag", false);
    assert_eq!(c.drain().len(), 1);
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 1,
            multiple: false,
            requeue: false,
        })),
    );
    let dead = take(&mut c, "dead");
    let AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) = &dead.method else {
        unreachable!()
    };
    assert_eq!(ok.routing_key.as_str(), "to-dead");
    // x-death keeps the routing key it was published with.
    check_death(&deaths(&dead)[0], "work", "rejected", "", "work");
}

#[test]
fn a_message_past_the_queues_ttl_is_dead_lettered_as_expired() {
    let node = Node::new();
    let mut c = setup(&node, &[("x-message-ttl", AMQPValue::LongInt(1_000))]);
    c.publish(1, "", "work", Message::new("m"));
    node.tick(START_MS + 500);
    assert_eq!(c.get_body(1, "dead"), None, "dead-lettered before its TTL");
    node.tick(START_MS + 1_500);
    let dead = take(&mut c, "dead");
    assert_eq!(dead.body, b"m");
    check_death(&deaths(&dead)[0], "work", "expired", "", "work");
    assert_eq!(c.get_body(1, "work"), None);
}

#[test]
fn a_per_message_ttl_expires_it_and_is_removed_when_dead_lettered() {
    let node = Node::new();
    let mut c = setup(&node, &[]);
    c.publish(1, "", "work", Message::new("short").expiration(100));
    c.publish(1, "", "work", Message::new("long"));
    node.tick(START_MS + 200);
    let dead = take(&mut c, "dead");
    assert_eq!(dead.body, b"short");
    check_death(&deaths(&dead)[0], "work", "expired", "", "work");
    let props = dead.properties.as_ref().unwrap();
    assert_eq!(props.expiration(), &None, "expiration kept: {props:?}");
    assert_eq!(c.get_all(1, "work"), [b"long".to_vec()]);
}

/// A message the broker read back from its log after a restart (it kept no
/// copy in memory) is dead-lettered whole when it expires.
#[test]
fn a_message_recovered_after_a_restart_is_dead_lettered_with_its_content() {
    let node = Node::durable();
    let mut c = node.connect();
    c.open_channel(1);
    c.declare_queue(1, "dead", QueueOpts::durable()).unwrap();
    let opts = QueueOpts::durable()
        .arg("x-dead-letter-exchange", s(""))
        .arg("x-dead-letter-routing-key", s("dead"));
    c.declare_queue(1, "work", opts).unwrap();
    c.publish(1, "", "work", Message::persistent("kept").expiration(1_000));
    c.publish(1, "", "work", Message::persistent("stays"));
    node.sync();
    node.restart();
    let mut c = node.connect();
    c.open_channel(1);
    node.tick(START_MS + 2_000);
    let dead = take(&mut c, "dead");
    assert_eq!(dead.body, b"kept");
    check_death(&deaths(&dead)[0], "work", "expired", "", "work");
    assert_eq!(c.get_all(1, "work"), [b"stays".to_vec()]);
}

#[test]
fn the_head_dropped_by_max_length_is_dead_lettered_as_maxlen() {
    let node = Node::new();
    let mut c = setup(&node, &[("x-max-length", AMQPValue::LongInt(1))]);
    c.publish(1, "", "work", Message::new("old"));
    c.publish(1, "", "work", Message::new("new"));
    let dead = take(&mut c, "dead");
    assert_eq!(dead.body, b"old");
    check_death(&deaths(&dead)[0], "work", "maxlen", "", "work");
    assert_eq!(c.get_all(1, "work"), [b"new".to_vec()]);
}

#[test]
fn without_a_dead_letter_exchange_an_expired_message_is_dropped() {
    let (node, mut c) = Node::session();
    let opts = QueueOpts::default().arg("x-message-ttl", AMQPValue::LongInt(1_000));
    c.declare_queue(1, "q", opts).unwrap();
    c.publish(1, "", "q", Message::new("m"));
    node.tick(START_MS + 2_000);
    assert_eq!(c.counts(1, "q"), (0, 0));
}
