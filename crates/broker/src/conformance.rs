//! The [`MetadataStore`] conformance suite: [`metadata_store`], run by this
//! crate's tests on [`MemoryStore`](crate::meta::MemoryStore) and
//! [`FileStore`](crate::meta::FileStore).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_amqp::amq_protocol::types::FieldTable;

use crate::auth::{PermissionDef, UserDef};
use crate::meta::{
    BindingDef, Change, Definitions, ExchangeDef, MetadataStore, PolicyDef, QueueDef,
};

/// What [`metadata_store`] needs to run one kind of store.
pub trait StoreHarness {
    /// The store under test.
    type Store: MetadataStore;
    /// A store over fresh, empty storage.
    fn open(&mut self) -> Self::Store;
    /// The store as a restarted node finds it (one in memory: itself).
    fn reopen(&mut self, store: Self::Store) -> Self::Store;
}

/// Definitions with every list sorted: a store may keep any order.
pub(crate) fn normalised(d: &Definitions) -> Definitions {
    fn sorted<T: Clone + serde::Serialize>(v: &[T]) -> Vec<T> {
        let mut v = v.to_vec();
        v.sort_by_cached_key(|x| serde_json::to_string(x).unwrap_or_default());
        v
    }
    let mut n = Definitions::default();
    n.vhosts = sorted(&d.vhosts);
    n.users = sorted(&d.users);
    n.permissions = sorted(&d.permissions);
    n.exchanges = sorted(&d.exchanges);
    n.queues = sorted(&d.queues);
    n.bindings = sorted(&d.bindings);
    n.policies = sorted(&d.policies);
    n
}

/// A change the broker could make to `model`, drawn from `rng`: entities go
/// into vhosts that exist, permissions to users that exist, bindings
/// between entities that exist; deletions may name what is already gone.
pub(crate) fn change(rng: &mut StdRng, model: &Definitions) -> Change {
    let pick =
        |rng: &mut StdRng, names: &[&str]| names[rng.random_range(0..names.len())].to_owned();
    let vhosts = model.vhosts.clone();
    let Some(vhost) =
        (!vhosts.is_empty()).then(|| vhosts[rng.random_range(0..vhosts.len())].clone())
    else {
        return Change::PutVhost(pick(rng, &["/", "v1"]));
    };
    let in_vhost = |names: Vec<&String>| names.into_iter().cloned().collect::<Vec<String>>();
    let queues = in_vhost(
        model
            .queues
            .iter()
            .filter(|q| q.vhost == vhost)
            .map(|q| &q.name)
            .collect(),
    );
    let exchanges = in_vhost(
        model
            .exchanges
            .iter()
            .filter(|x| x.vhost == vhost)
            .map(|x| &x.name)
            .collect(),
    );
    match rng.random_range(0..14) {
        0 => Change::PutVhost(pick(rng, &["/", "v1", "v2"])),
        1 => Change::DeleteVhost(pick(rng, &["v1", "v2"])),
        2 => Change::PutUser(UserDef {
            name: pick(rng, &["alice", "bob"]),
            password_hash: format!("hash{}", rng.random_range(0..100)),
            tags: if rng.random_bool(0.5) {
                vec!["administrator".into()]
            } else {
                vec![]
            },
            loopback_only: false,
        }),
        3 => Change::DeleteUser(pick(rng, &["alice", "bob"])),
        4 if !model.users.is_empty() => Change::PutPermission(PermissionDef {
            user: model.users[rng.random_range(0..model.users.len())]
                .name
                .clone(),
            vhost,
            configure: ".*".into(),
            write: pick(rng, &[".*", "^amq"]),
            read: ".*".into(),
        }),
        5 => Change::DeletePermission {
            user: pick(rng, &["alice", "bob"]),
            vhost,
        },
        6 => Change::PutExchange(ExchangeDef {
            vhost,
            name: pick(rng, &["x1", "x2"]),
            kind: pick(rng, &["direct", "topic", "fanout"]),
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::default(),
        }),
        7 => Change::DeleteExchange {
            vhost,
            name: pick(rng, &["x1", "x2"]),
        },
        8 | 9 => Change::PutQueue(QueueDef {
            vhost,
            name: pick(rng, &["q1", "q2", "q3"]),
            durable: true,
            master: None,
            auto_delete: false,
            exclusive: false,
            arguments: FieldTable::default(),
        }),
        10 => Change::DeleteQueue {
            vhost,
            name: pick(rng, &["q1", "q2", "q3"]),
        },
        11 | 12 if !exchanges.is_empty() && !queues.is_empty() => {
            let binding = BindingDef {
                vhost,
                source: exchanges[rng.random_range(0..exchanges.len())].clone(),
                destination: queues[rng.random_range(0..queues.len())].clone(),
                destination_is_exchange: false,
                routing_key: pick(rng, &["", "k1", "k2"]),
                arguments: FieldTable::default(),
            };
            if rng.random_bool(0.7) {
                Change::PutBinding(binding)
            } else {
                Change::DeleteBinding(binding)
            }
        }
        13 => Change::PutPolicy(PolicyDef {
            vhost,
            name: pick(rng, &["ha", "limits"]),
            pattern: pick(rng, &["^q", ".*"]),
            apply_to: "queues".into(),
            priority: rng.random_range(0..3),
            definition: serde_json::json!({"max-length": rng.random_range(1..100)}),
            operator: false,
        }),
        _ => Change::DeletePolicy {
            vhost,
            name: pick(rng, &["ha", "limits"]),
            operator: false,
        },
    }
}

/// Checks the [`MetadataStore`] contract: starting empty, after every
/// change of a seeded random run (the changes a broker makes) `load` holds
/// what [`Definitions::apply`] makes of the same changes (in any order of
/// its lists), and so does the store reopened at any point: a change is
/// durable once `apply` returns.
pub fn metadata_store<H: StoreHarness>(harness: &mut H, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut store = harness.open();
    let mut model = Definitions::default();
    assert_eq!(
        normalised(&store.load()),
        model,
        "a fresh store is empty (seed {seed})"
    );
    for step in 0..150 {
        let c = change(&mut rng, &model);
        model.apply(&c);
        if let Err(e) = store.apply(c.clone()) {
            panic!("step {step} (seed {seed}): {c:?} failed: {e}");
        }
        assert_eq!(
            normalised(&store.load()),
            normalised(&model),
            "step {step} (seed {seed}) after {c:?}"
        );
        if rng.random_range(0..10) == 0 {
            store = harness.reopen(store);
            assert_eq!(
                normalised(&store.load()),
                normalised(&model),
                "step {step} (seed {seed}): reopened"
            );
        }
    }
    let store = harness.reopen(store);
    assert_eq!(
        normalised(&store.load()),
        normalised(&model),
        "reopened at the end (seed {seed})"
    );
}
