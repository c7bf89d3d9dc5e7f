//! Metadata commits made off the broker's lock (`broker/commits.rs`): with
//! a store that defers (the cluster's), a client's declare waits for its
//! commit, and only that client waits.

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic, queue};
use warren_broker::meta::{Change, Definitions, MetaError, MetadataStore};

use crate::support::{Message, Node};

/// A store whose client changes are committed by the test, as the cluster's
/// are by the node's commit task.
#[derive(Debug, Default)]
struct Deferring(Definitions);

impl MetadataStore for Deferring {
    fn load(&self) -> Definitions {
        self.0.clone()
    }

    fn apply(&mut self, change: Change) -> Result<(), MetaError> {
        self.0.apply(&change);
        Ok(())
    }

    fn share(&mut self, change: Change) -> Result<(), MetaError> {
        self.apply(change)
    }

    fn shares(&self) -> bool {
        true
    }

    fn defers(&self) -> bool {
        true
    }
}

fn declare(name: &str, durable: bool) -> AMQPClass {
    declare_with(name, durable, false)
}

fn declare_with(name: &str, durable: bool, auto_delete: bool) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        passive: false,
        durable,
        exclusive: false,
        auto_delete,
        nowait: false,
        arguments: Default::default(),
    }))
}

/// A non-durable exclusive queue's declare.
fn exclusive_declare(name: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        passive: false,
        durable: false,
        exclusive: true,
        auto_delete: false,
        nowait: false,
        arguments: Default::default(),
    }))
}

fn qos() -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
        prefetch_count: 10,
        global: false,
    }))
}

#[test]
fn a_declare_is_answered_once_committed_and_holds_up_only_its_client() {
    let node = Node::with_store(Box::new(Deferring::default()));
    let mut a = node.connect();
    a.open_channel(1);
    let mut b = node.connect();
    b.open_channel(1);
    b.confirm_select(1);

    a.send(1, declare("q", true));
    // A command sent behind the declare waits with it.
    a.send(1, qos());
    assert!(a.drain().is_empty(), "declare-ok before the commit");
    assert!(a.input_paused(), "its client reads no further meanwhile");
    let commits = node.with_broker(|br| br.take_commits());
    assert_eq!(commits.len(), 1);
    assert!(
        matches!(&commits[0].changes[..], [Change::PutQueue(q)] if q.name == "q" && q.durable),
        "{commits:?}"
    );
    assert_eq!(node.with_broker(|br| br.changes_in_flight()).len(), 1);
    // Handed out once.
    assert!(node.with_broker(|br| br.take_commits()).is_empty());

    // Another client is not held up: the queue is there for it, its
    // commands are answered.
    assert!(!b.input_paused());
    b.publish(1, "", "q", Message::new("m"));
    let ack = b.recv_on(1);
    assert_eq!(ack.ids(), (60, 80), "basic.ack of the publish: {ack:?}");
    assert_eq!(b.counts(1, "q"), (1, 0));

    node.with_broker(|br| br.commit_done(commits[0].ticket, Ok(())));
    let answers: Vec<_> = a.drain().iter().map(|i| i.ids()).collect();
    assert_eq!(answers, [(50, 11), (60, 11)], "declare-ok, then qos-ok");
    assert!(!a.input_paused());
    assert!(node.with_broker(|br| br.changes_in_flight()).is_empty());
    // A redeclare changes nothing: nothing to commit, answered at once.
    a.send(1, declare("q", true));
    assert_eq!(a.recv_on(1).ids(), (50, 11));
    assert!(node.with_broker(|br| br.take_commits()).is_empty());
}

#[test]
fn a_refused_commit_closes_its_connection_with_541() {
    let node = Node::with_store(Box::new(Deferring::default()));
    let mut a = node.connect();
    a.open_channel(1);
    a.send(1, declare("shared", false));
    let commits = node.with_broker(|br| br.take_commits());
    assert_eq!(commits.len(), 1, "a non-durable queue is shared too");
    node.with_broker(|br| {
        br.commit_done(
            commits[0].ticket,
            Err(MetaError::Cluster("no majority".into())),
        );
    });
    let closed = a.expect_close(1);
    assert!(closed.connection, "{closed:?}");
    assert_eq!(
        (closed.code, closed.class_id, closed.method_id),
        (541, 50, 10)
    );
    assert!(closed.text.contains("no majority"), "{closed:?}");
}

#[test]
fn an_exclusive_queue_is_committed_for_the_other_nodes_and_goes_with_its_connection() {
    let node = Node::with_store(Box::new(Deferring::default()));
    let mut a = node.connect();
    a.open_channel(1);
    // Shared in a cluster, as RabbitMQ's: the other nodes route to it
    // and refuse it to their clients, so its declare waits for the commit.
    a.send(1, exclusive_declare("mine"));
    let commits = node.with_broker(|br| br.take_commits());
    assert!(
        matches!(&commits[..], [c] if matches!(&c.changes[..], [Change::PutQueue(q)] if q.name == "mine" && q.exclusive)),
        "{commits:?}"
    );
    assert!(a.drain().is_empty());
    node.with_broker(|br| br.commit_done(commits[0].ticket, Ok(())));
    assert_eq!(a.recv_on(1).ids(), (50, 11));
    a.publish(1, "", "mine", Message::new("m"));
    assert_eq!(a.get_body(1, "mine").as_deref(), Some(&b"m"[..]));
    // Its connection goes: so does the queue, and nobody waits for that.
    node.disconnect(&a);
    assert!(node.queue_names().is_empty());
    let commits = node.with_broker(|br| br.take_commits());
    assert!(
        matches!(&commits[..], [c] if matches!(&c.changes[..], [Change::DeleteQueue { name, .. }] if name == "mine")),
        "{commits:?}"
    );
}

/// An exclusive queue whose record the cluster deleted while its
/// connection stayed (the other nodes took this node for down while it was
/// only cut off) is shared again with its bindings, nobody waiting; a
/// queue of no connection of this node's, or one gone with its
/// connection, is not.
#[test]
fn an_exclusive_queue_the_cluster_forgot_is_shared_again_with_its_bindings() {
    let node = Node::with_store(Box::new(Deferring::default()));
    let mut a = node.connect();
    a.open_channel(1);
    let commit_all = |node: &Node| {
        for c in node.with_broker(|br| br.take_commits()) {
            node.with_broker(|br| br.commit_done(c.ticket, Ok(())));
        }
    };
    a.send(1, exclusive_declare("mine"));
    commit_all(&node);
    a.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: "mine".into(),
            exchange: "amq.direct".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: Default::default(),
        })),
    );
    commit_all(&node);
    a.send(1, declare("shared", false));
    commit_all(&node);
    let answers: Vec<_> = a.drain().iter().map(|i| i.ids()).collect();
    assert_eq!(answers, [(50, 11), (50, 21), (50, 11)]);

    node.with_broker(|br| {
        br.share_again("/", "mine");
        br.share_again("/", "shared");
    });
    let commits = node.with_broker(|br| br.take_commits());
    assert!(
        matches!(&commits[..], [c] if matches!(&c.changes[..],
            [Change::PutQueue(q), Change::PutBinding(b)]
                if q.name == "mine" && q.exclusive && !q.durable
                    && b.source == "amq.direct" && b.destination == "mine" && b.routing_key == "k")),
        "{commits:?}"
    );
    commit_all(&node);
    assert!(a.drain().is_empty(), "nothing for the client to see");

    node.disconnect(&a);
    commit_all(&node);
    node.with_broker(|br| br.share_again("/", "mine"));
    assert!(node.with_broker(|br| br.take_commits()).is_empty());
}

#[test]
fn an_auto_delete_queue_left_by_its_last_consumer_is_deleted_without_waiting() {
    let node = Node::with_store(Box::new(Deferring::default()));
    let mut a = node.connect();
    a.open_channel(1);
    a.send(1, declare_with("auto", false, true));
    let commits = node.with_broker(|br| br.take_commits());
    node.with_broker(|br| br.commit_done(commits[0].ticket, Ok(())));
    assert_eq!(a.recv_on(1).ids(), (50, 11));
    a.consume(1, "auto", "ctag", true);
    // The channel closes: nobody waits for the delete, nothing is held.
    a.close_channel(1);
    assert!(node.queue_names().is_empty());
    let commits = node.with_broker(|br| br.take_commits());
    assert!(
        matches!(&commits[..], [c] if matches!(&c.changes[..], [Change::DeleteQueue { name, .. }] if name == "auto")),
        "{commits:?}"
    );
    assert!(!a.input_paused());
    a.open_channel(2);
    node.with_broker(|br| br.commit_done(commits[0].ticket, Ok(())));
    assert!(a.drain().is_empty());
}

#[test]
fn a_declare_whose_log_cannot_be_made_commits_nothing() {
    let storage = std::sync::Arc::new(warren_backing_queue::MemStorage::new());
    let node = Node::on_storage_with(storage.clone(), Box::new(Deferring::default()));
    let mut a = node.connect();
    a.open_channel(1);
    storage.set_failing(true);
    a.send(1, declare("q", true));
    let closed = a.expect_close(0);
    assert_eq!(closed.code, 541, "{closed:?}");
    // The file and its error are for the node's log, not the client.
    assert_eq!(
        closed.text, "INTERNAL_ERROR - could not open the queue's log",
        "{closed:?}"
    );
    // Refused before anything of it was recorded: no commit would bring
    // the queue back at the next start.
    assert!(node.with_broker(|b| b.take_commits()).is_empty());
    assert!(!node.queue_names().contains(&"q".to_owned()));
}
