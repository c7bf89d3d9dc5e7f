//! Routing a publish through exchanges and bindings, and returning an
//! unroutable mandatory message (`broker/publish.rs`).

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic, exchange};
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};

use crate::support::{Client, Message, Node, s, table};

/// A client of a fresh broker with channel 1 open and queues `names`
/// declared.
fn with_queues(names: &[&str]) -> Client {
    let (_node, mut c) = Node::session();
    for n in names {
        c.queue(1, n);
    }
    c
}

/// The bodies each of `queues` holds, taken.
fn contents(c: &mut Client, queues: &[&str]) -> Vec<Vec<String>> {
    queues
        .iter()
        .map(|q| {
            c.get_all(1, q)
                .into_iter()
                .map(|b| String::from_utf8(b).unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn the_default_exchange_routes_by_queue_name() {
    let mut c = with_queues(&["a", "b"]);
    c.publish(1, "", "a", Message::new("1"));
    c.publish(1, "", "nope", Message::new("2"));
    assert_eq!(contents(&mut c, &["a", "b"]), [vec!["1"], vec![]]);
}

#[test]
fn a_direct_exchange_matches_the_routing_key_exactly() {
    let mut c = with_queues(&["a", "b"]);
    let none = FieldTable::default;
    c.bind(1, "a", "amq.direct", "orange", none()).unwrap();
    c.bind(1, "b", "amq.direct", "black", none()).unwrap();
    c.bind(1, "b", "amq.direct", "green", none()).unwrap();
    for key in ["orange", "black", "green", "blue", "orange.x"] {
        c.publish(1, "amq.direct", key, Message::new(key));
    }
    assert_eq!(
        contents(&mut c, &["a", "b"]),
        [vec!["orange"], vec!["black", "green"]]
    );
}

#[test]
fn a_fanout_exchange_ignores_the_routing_key() {
    let mut c = with_queues(&["a", "b"]);
    c.bind(1, "a", "amq.fanout", "", FieldTable::default())
        .unwrap();
    c.bind(1, "b", "amq.fanout", "whatever", FieldTable::default())
        .unwrap();
    c.publish(1, "amq.fanout", "any.key", Message::new("m"));
    assert_eq!(contents(&mut c, &["a", "b"]), [vec!["m"], vec!["m"]]);
}

#[test]
fn a_topic_exchange_matches_words_as_rabbitmqs_tutorial_shows() {
    // RabbitMQ tutorial five: Q1 is bound with `*.orange.*`, Q2 with
    // `*.*.rabbit` and `lazy.#`; a message matching two bindings of one
    // queue is put into it once.
    let mut c = with_queues(&["q1", "q2"]);
    let none = FieldTable::default;
    c.bind(1, "q1", "amq.topic", "*.orange.*", none()).unwrap();
    c.bind(1, "q2", "amq.topic", "*.*.rabbit", none()).unwrap();
    c.bind(1, "q2", "amq.topic", "lazy.#", none()).unwrap();
    for key in [
        "quick.orange.rabbit",
        "lazy.orange.elephant",
        "quick.orange.fox",
        "lazy.brown.fox",
        "lazy.pink.rabbit",
        "quick.brown.fox",
        "orange",
        "quick.orange.new.rabbit",
        "lazy.orange.new.rabbit",
    ] {
        c.publish(1, "amq.topic", key, Message::new(key));
    }
    assert_eq!(
        contents(&mut c, &["q1", "q2"]),
        [
            vec![
                "quick.orange.rabbit",
                "lazy.orange.elephant",
                "quick.orange.fox"
            ],
            vec![
                "quick.orange.rabbit",
                "lazy.orange.elephant",
                "lazy.brown.fox",
                "lazy.pink.rabbit",
                "lazy.orange.new.rabbit",
            ],
        ]
    );
}

#[test]
fn a_headers_exchange_matches_all_or_any_of_the_binding_headers() {
    let mut c = with_queues(&["all", "any"]);
    let binding = |mode: &str| {
        table(&[
            ("x-match", s(mode)),
            ("format", s("pdf")),
            ("type", s("report")),
        ])
    };
    c.bind(1, "all", "amq.headers", "", binding("all")).unwrap();
    c.bind(1, "any", "amq.headers", "", binding("any")).unwrap();
    let both = table(&[("format", s("pdf")), ("type", s("report"))]);
    let one = table(&[("format", s("pdf")), ("type", s("log"))]);
    let neither = table(&[("format", s("zip"))]);
    c.publish(1, "amq.headers", "", Message::new("both").headers(both));
    c.publish(1, "amq.headers", "", Message::new("one").headers(one));
    c.publish(
        1,
        "amq.headers",
        "",
        Message::new("neither").headers(neither),
    );
    c.publish(1, "amq.headers", "", Message::new("none"));
    assert_eq!(
        contents(&mut c, &["all", "any"]),
        [vec!["both"], vec!["both", "one"]]
    );
}

#[test]
fn exchange_to_exchange_bindings_and_the_alternate_exchange() {
    let mut c = with_queues(&["bound", "unrouted"]);
    let ae = table(&[("alternate-exchange", s("ae"))]);
    c.declare_exchange(1, "ae", "fanout", false, FieldTable::default())
        .unwrap();
    c.declare_exchange(1, "front", "direct", false, ae).unwrap();
    c.bind(1, "unrouted", "ae", "", FieldTable::default())
        .unwrap();
    // front -(k)-> amq.topic -(#)-> bound
    let bind = AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
        destination: "amq.topic".into(),
        source: "front".into(),
        routing_key: "k".into(),
        nowait: false,
        arguments: FieldTable::default(),
    }));
    assert_eq!(c.call(1, bind).unwrap().ids(), (40, 31));
    c.bind(1, "bound", "amq.topic", "#", FieldTable::default())
        .unwrap();
    c.publish(1, "front", "k", Message::new("routed"));
    c.publish(1, "front", "other", Message::new("alternate"));
    assert_eq!(
        contents(&mut c, &["bound", "unrouted"]),
        [vec!["routed"], vec!["alternate"]]
    );
}

#[test]
fn an_unroutable_mandatory_message_is_returned_with_312_no_route() {
    let mut c = with_queues(&[]);
    let headers = table(&[("h", AMQPValue::LongInt(7))]);
    c.publish(
        1,
        "amq.direct",
        "nowhere",
        Message::new("back").mandatory().headers(headers.clone()),
    );
    let ret = c.recv();
    let AMQPClass::Basic(basic::AMQPMethod::Return(r)) = &ret.method else {
        panic!("expected basic.return, got {ret:?}");
    };
    assert_eq!(r.reply_code, 312);
    assert_eq!(r.reply_text.as_str(), "NO_ROUTE");
    assert_eq!(r.exchange.as_str(), "amq.direct");
    assert_eq!(r.routing_key.as_str(), "nowhere");
    assert_eq!(ret.body, b"back");
    assert_eq!(ret.headers(), headers);
    // Not mandatory: dropped without a word.
    c.publish(1, "amq.direct", "nowhere", Message::new("gone"));
    assert!(c.drain().is_empty());
}

#[test]
fn publishing_to_a_missing_exchange_is_404() {
    let mut c = with_queues(&[]);
    c.publish(1, "nope", "k", Message::new("m"));
    let e = c.expect_close(1);
    assert_eq!(e.code, 404);
    assert_eq!(e.text, "NOT_FOUND - no exchange 'nope' in vhost '/'");
    assert_eq!((e.class_id, e.method_id), (60, 40));
}

#[test]
fn a_user_id_must_be_the_publishers_unless_it_may_impersonate() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    let mut claimed = Message::new("m");
    claimed.properties = claimed.properties.with_user_id("mallory".into());
    c.publish(1, "", "q", claimed.clone());
    let e = c.expect_close(1);
    assert_eq!(
        (e.code, e.text.as_str()),
        (
            406,
            "PRECONDITION_FAILED - user_id property set to 'mallory' but authenticated user was 'guest'"
        )
    );
    // Tagged `impersonator`, the same user may claim another's name.
    node.with_broker(|b| {
        let mut guest = b.user("guest").cloned().expect("guest");
        guest.tags.push("impersonator".into());
        b.put_user(guest).expect("put_user");
    });
    c.open_channel(2);
    c.publish(2, "", "q", claimed);
    assert_eq!(c.get_all(2, "q"), [b"m".to_vec()]);
}
