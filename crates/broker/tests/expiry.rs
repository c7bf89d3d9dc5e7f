//! `x-expires` against the broker's clock: an unused queue goes after its
//! expiry, but not on the tick that ends a stall of the node (input that
//! waited meanwhile, such as a consume, is handled first), nor within the
//! grace a new master gives other nodes' consumers to find it.

use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};
use warren_broker::meta::MemoryStore;
use warren_broker::{Broker, BrokerConfig};

fn broker_with_expiring_queue(dir: &std::path::Path, now: u64) -> Broker {
    let mut b = Broker::open(BrokerConfig::new(dir), Box::new(MemoryStore::default())).unwrap();
    b.add_vhost("/").unwrap();
    b.tick(now);
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongLongInt(1_000));
    b.admin_declare_queue("/", "q", true, false, args).unwrap();
    b
}

fn exists(b: &Broker) -> bool {
    b.queues(Some("/")).iter().any(|q| q.name == "q")
}

#[test]
fn an_unused_queue_expires_on_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = broker_with_expiring_queue(dir.path(), 10_000);
    let mut now = 10_000;
    while now < 10_950 {
        now += 50;
        b.tick(now);
        assert!(exists(&b), "expired at {} ms", now - 10_000);
    }
    b.tick(11_000);
    assert!(!exists(&b), "not expired after 1,000 ms unused");
}

#[test]
fn no_queue_expires_on_the_tick_that_ends_a_stall() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = broker_with_expiring_queue(dir.path(), 10_000);
    b.tick(10_050);
    // The node held up for 2 s: the first tick after it expires nothing.
    b.tick(12_050);
    assert!(exists(&b), "expired on the tick that ended a stall");
    // The next one does, even if it is late too.
    b.tick(12_400);
    assert!(!exists(&b), "a late tick after a stall expired nothing");
}

#[test]
fn a_new_master_gives_other_nodes_consumers_time_to_find_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = broker_with_expiring_queue(dir.path(), 10_000);
    // Served elsewhere, then taken over by this node at 10 s.
    b.set_queue_master("/", "q", Some("warren@other"));
    b.tick(10_050);
    b.set_queue_master("/", "q", None);
    let mut now = 10_050;
    while now < 15_950 {
        now += 50;
        b.tick(now);
        assert!(exists(&b), "expired {} ms after the takeover", now - 10_050);
    }
    b.tick(16_100);
    assert!(!exists(&b), "still there 1 s after the takeover's grace");
}
