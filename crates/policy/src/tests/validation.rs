//! Every definition key: valid values accepted, every invalid case refused with
//! a message naming the key and the rule.

use std::num::{NonZeroU32, NonZeroU64};

use serde_json::{Value, json};

use crate::definition::keys;
use crate::{
    Definition, DefinitionError, HaMode, MasterLocator, Overflow, PolicyKind, PromoteOn, SyncMode,
};

fn regular(v: Value) -> Result<Definition, DefinitionError> {
    Definition::parse(PolicyKind::Regular, &v)
}

fn count(n: u32) -> HaMode {
    HaMode::Exactly(NonZeroU32::new(n).unwrap())
}

#[test]
fn valid_modes_accepted() {
    let cases: &[(Value, HaMode)] = &[
        (json!({"ha-mode": "all"}), HaMode::All),
        (json!({"ha-mode": "exactly", "ha-params": 2}), count(2)),
        (json!({"ha-mode": "exactly", "ha-params": 1}), count(1)),
        (
            json!({"ha-mode": "nodes", "ha-params": ["rabbit@A", "rabbit@B"]}),
            HaMode::Nodes(vec!["rabbit@A".into(), "rabbit@B".into()]),
        ),
        // Names that are not cluster members are not an error.
        (
            json!({"ha-mode": "nodes", "ha-params": ["nowhere@x"]}),
            HaMode::Nodes(vec!["nowhere@x".into()]),
        ),
    ];
    for (def, mode) in cases {
        let parsed = regular(def.clone()).unwrap_or_else(|e| panic!("{def}: {e}"));
        let ha = parsed.ha.expect("mirroring");
        assert_eq!(&ha.mode, mode, "{def}");
        assert_eq!(ha.sync_mode(), SyncMode::Manual, "default sync mode");
        assert_eq!(ha.promote_on_shutdown(), PromoteOn::WhenSynced);
        assert_eq!(ha.promote_on_failure(), PromoteOn::Always);
        assert_eq!(ha.min_sync_replicas(), 1);
        assert_eq!(ha.sync_batch_size(4096), 4096);
    }
}

#[test]
fn every_key_valid_values() {
    let def = regular(json!({
        "ha-mode": "exactly",
        "ha-params": 3,
        "ha-sync-mode": "automatic",
        "ha-sync-batch-size": 1,
        "ha-promote-on-shutdown": "always",
        "ha-promote-on-failure": "when-synced",
        "ha-min-sync-replicas": 2,
        "queue-master-locator": "min-masters",
        "message-ttl": 0,
        "expires": 1,
        "max-length": 0,
        "max-length-bytes": 1_000_000,
        "overflow": "reject-publish-dlx",
        "dead-letter-exchange": "dlx",
        "dead-letter-routing-key": "",
        "alternate-exchange": "ae"
    }))
    .unwrap();
    let ha = def.ha.clone().unwrap();
    assert_eq!(ha.mode, count(3));
    assert_eq!(ha.sync_mode(), SyncMode::Automatic);
    assert_eq!(ha.sync_batch_size, NonZeroU64::new(1));
    assert_eq!(
        ha.sync_batch_size(4096),
        1,
        "1 is honoured, unlike RabbitMQ"
    );
    assert_eq!(ha.promote_on_shutdown(), PromoteOn::Always);
    assert_eq!(ha.promote_on_failure(), PromoteOn::WhenSynced);
    assert_eq!(ha.min_sync_replicas(), 2);
    assert_eq!(def.queue_master_locator, Some(MasterLocator::MinMasters));
    assert_eq!(def.message_ttl, Some(0));
    assert_eq!(def.expires, Some(1));
    assert_eq!(def.max_length, Some(0));
    assert_eq!(def.max_length_bytes, Some(1_000_000));
    assert_eq!(def.overflow, Some(Overflow::RejectPublishDlx));
    assert_eq!(def.dead_letter_exchange.as_deref(), Some("dlx"));
    assert_eq!(def.dead_letter_routing_key.as_deref(), Some(""));
    assert_eq!(def.alternate_exchange.as_deref(), Some("ae"));
    // Round trip through JSON.
    let again = regular(Value::Object(def.to_json())).unwrap();
    assert_eq!(again, def);
}

#[test]
fn enumerated_values_accepted() {
    let cases = [
        json!({"ha-mode": "all", "ha-sync-mode": "manual"}),
        json!({"ha-mode": "all", "ha-promote-on-shutdown": "when-synced"}),
        json!({"ha-mode": "all", "ha-promote-on-failure": "always"}),
        json!({"queue-master-locator": "client-local"}),
        json!({"queue-master-locator": "random"}),
        json!({"overflow": "drop-head"}),
        json!({"overflow": "reject-publish"}),
        json!({"max-length": 10}),
        json!({"ha-mode": "all", "ha-min-sync-replicas": 7}),
        json!({"ha-mode": "nodes", "ha-params": ["a", "b"], "ha-min-sync-replicas": 2}),
    ];
    for def in cases {
        let parsed = regular(def.clone());
        assert!(parsed.is_ok(), "{def}: {parsed:?}");
    }
}

/// (definition, key named, text the message must contain)
#[rustfmt::skip]
fn invalid_cases() -> Vec<(Value, Option<&'static str>, &'static str)> {
    vec![
        // Shape of the definition.
        (json!("ha-mode"), None, "definition must be a dictionary"),
        (json!([1]), None, "definition must be a dictionary"),
        (json!({}), None, "no policy provided"),
        (json!({"ha-mode": "all", "ha-foo": 1}), None, r#"["ha-foo"] are not recognised policy settings"#),
        (json!({"zz": 1, "aa": 2}), None, r#"["aa","zz"] are not recognised policy settings"#),
        (json!({"queue-mode": "lazy", "queue-foo": 1}), None, r#"["queue-foo"] are not recognised policy settings"#),
        (json!({"queue-mode": "lolwut"}), Some(keys::QUEUE_MODE), r#""lolwut" is not a valid queue-mode value"#),
        // ha-* without ha-mode.
        (json!({"ha-sync-mode": "automatic"}), Some(keys::HA_MODE), "ha-mode must be specified"),
        (json!({"ha-params": 2}), Some(keys::HA_MODE), "ha-params is set but ha-mode is not"),
        (json!({"ha-sync-batch-size": 2}), Some(keys::HA_MODE), "ha-sync-batch-size is set"),
        (json!({"ha-promote-on-shutdown": "always"}), Some(keys::HA_MODE), "ha-mode must be specified"),
        (json!({"ha-promote-on-failure": "always"}), Some(keys::HA_MODE), "ha-mode must be specified"),
        (json!({"ha-min-sync-replicas": 2}), Some(keys::HA_MODE), "ha-min-sync-replicas is set"),
        // ha-mode.
        (json!({"ha-mode": "lolwut", "ha-params": 2}), Some(keys::HA_MODE), r#""lolwut" is not a valid ha-mode value"#),
        (json!({"ha-mode": 1}), Some(keys::HA_MODE), "1 is not a valid ha-mode value"),
        (json!({"ha-mode": "ALL"}), Some(keys::HA_MODE), "is not a valid ha-mode value"),
        // ha-params for all.
        (json!({"ha-mode": "all", "ha-params": 2}), Some(keys::HA_PARAMS), r#"ha-mode="all" does not take parameters"#),
        (json!({"ha-mode": "all", "ha-params": null}), Some(keys::HA_PARAMS), "does not take parameters"),
        // ha-params for exactly.
        (json!({"ha-mode": "exactly", "ha-params": "2"}), Some(keys::HA_PARAMS), r#"ha-mode="exactly" takes an integer, "2" given"#),
        (json!({"ha-mode": "exactly", "ha-params": 0}), Some(keys::HA_PARAMS), "takes an integer, 0 given"),
        (json!({"ha-mode": "exactly", "ha-params": -1}), Some(keys::HA_PARAMS), "takes an integer, -1 given"),
        (json!({"ha-mode": "exactly", "ha-params": 2.0}), Some(keys::HA_PARAMS), "ha-params must be a positive integer when ha-mode is exactly"),
        (json!({"ha-mode": "exactly", "ha-params": 4_294_967_296_u64}), Some(keys::HA_PARAMS), "takes an integer"),
        (json!({"ha-mode": "exactly", "ha-params": [2]}), Some(keys::HA_PARAMS), "takes an integer"),
        (json!({"ha-mode": "exactly"}), Some(keys::HA_PARAMS), "ha-mode exactly needs ha-params"),
        // ha-params for nodes.
        (json!({"ha-mode": "nodes", "ha-params": "x"}), Some(keys::HA_PARAMS), r#"ha-mode="nodes" takes a list, "x" given"#),
        (json!({"ha-mode": "nodes", "ha-params": 2}), Some(keys::HA_PARAMS), "takes a list"),
        (json!({"ha-mode": "nodes", "ha-params": []}), Some(keys::HA_PARAMS), r#"ha-mode="nodes" list must be non-empty"#),
        (json!({"ha-mode": "nodes", "ha-params": [1]}), Some(keys::HA_PARAMS), r#"ha-mode="nodes" takes a list of strings, [1] was not a string"#),
        (json!({"ha-mode": "nodes", "ha-params": ["a", null]}), Some(keys::HA_PARAMS), "[null] was not a string"),
        (json!({"ha-mode": "nodes"}), Some(keys::HA_PARAMS), "ha-mode nodes needs ha-params: a non-empty list of node names"),
        // ha-sync-mode.
        (json!({"ha-mode": "all", "ha-sync-mode": "sometimes"}), Some(keys::HA_SYNC_MODE), r#"ha-sync-mode must be "manual" or "automatic", got "sometimes""#),
        (json!({"ha-mode": "all", "ha-sync-mode": "manually"}), Some(keys::HA_SYNC_MODE), "ha-sync-mode must be"),
        (json!({"ha-mode": "all", "ha-sync-mode": true}), Some(keys::HA_SYNC_MODE), "got true"),
        // ha-sync-batch-size.
        (json!({"ha-mode": "all", "ha-sync-batch-size": 0}), Some(keys::HA_SYNC_BATCH_SIZE), "ha-sync-batch-size takes an integer greater than 0, 0 given"),
        (json!({"ha-mode": "all", "ha-sync-batch-size": -5}), Some(keys::HA_SYNC_BATCH_SIZE), "-5 given"),
        (json!({"ha-mode": "all", "ha-sync-batch-size": "10"}), Some(keys::HA_SYNC_BATCH_SIZE), r#""10" given"#),
        // promotion keys.
        (json!({"ha-mode": "all", "ha-promote-on-shutdown": "never"}), Some(keys::HA_PROMOTE_ON_SHUTDOWN), r#"ha-promote-on-shutdown must be "always" or "when-synced", got "never""#),
        (json!({"ha-mode": "all", "ha-promote-on-failure": "x"}), Some(keys::HA_PROMOTE_ON_FAILURE), r#"ha-promote-on-failure must be "always" or "when-synced", got "x""#),
        // ha-min-sync-replicas.
        (json!({"ha-mode": "all", "ha-min-sync-replicas": 0}), Some(keys::HA_MIN_SYNC_REPLICAS), "ha-min-sync-replicas takes an integer greater than 0, 0 given"),
        (json!({"ha-mode": "all", "ha-min-sync-replicas": "2"}), Some(keys::HA_MIN_SYNC_REPLICAS), "takes an integer greater than 0"),
        (json!({"ha-mode": "exactly", "ha-params": 2, "ha-min-sync-replicas": 3}), Some(keys::HA_MIN_SYNC_REPLICAS), "ha-min-sync-replicas (3) is greater than the 2 replicas that ha-mode=exactly allows"),
        (json!({"ha-mode": "nodes", "ha-params": ["a"], "ha-min-sync-replicas": 2}), Some(keys::HA_MIN_SYNC_REPLICAS), "ha-mode=nodes allows: confirms would be held forever"),
        (json!({"ha-mode": "nodes", "ha-params": ["a", "a"], "ha-min-sync-replicas": 2}), Some(keys::HA_MIN_SYNC_REPLICAS), "greater than the 1 replicas"),
        // queue-master-locator.
        (json!({"queue-master-locator": "balanced"}), Some(keys::QUEUE_MASTER_LOCATOR), r#""balanced" invalid queue-master-locator value"#),
        (json!({"queue-master-locator": 3}), Some(keys::QUEUE_MASTER_LOCATOR), "invalid queue-master-locator value"),
        // Queue keys.
        (json!({"message-ttl": -1}), Some(keys::MESSAGE_TTL), "-1 is not a valid message TTL"),
        (json!({"message-ttl": "60000"}), Some(keys::MESSAGE_TTL), "message-ttl must be a non-negative integer"),
        (json!({"message-ttl": 1.5}), Some(keys::MESSAGE_TTL), "not a valid message TTL"),
        (json!({"expires": 0}), Some(keys::EXPIRES), "0 is not a valid queue expiry"),
        (json!({"expires": "1"}), Some(keys::EXPIRES), "expires must be a positive integer"),
        (json!({"max-length": -1}), Some(keys::MAX_LENGTH), "-1 is not a valid maximum length"),
        (json!({"max-length": "10"}), Some(keys::MAX_LENGTH), "max-length must be a non-negative integer"),
        (json!({"max-length-bytes": -1}), Some(keys::MAX_LENGTH_BYTES), "-1 is not a valid maximum length in bytes"),
        (json!({"max-length-bytes": 1.0}), Some(keys::MAX_LENGTH_BYTES), "max-length-bytes must be a non-negative integer"),
        (json!({"overflow": "drop-tail"}), Some(keys::OVERFLOW), r#""drop-tail" is not a valid overflow value"#),
        (json!({"overflow": null}), Some(keys::OVERFLOW), "overflow must be"),
        (json!({"dead-letter-exchange": 1}), Some(keys::DEAD_LETTER_EXCHANGE), "1 is not a valid dead letter exchange name"),
        (json!({"dead-letter-routing-key": ["k"]}), Some(keys::DEAD_LETTER_ROUTING_KEY), r#"["k"] is not a valid dead letter routing key"#),
        (json!({"alternate-exchange": false}), Some(keys::ALTERNATE_EXCHANGE), "false is not a valid alternate exchange name"),
    ]
}

#[test]
fn every_invalid_case_is_refused_naming_key_and_rule() {
    for (def, key, text) in invalid_cases() {
        let err = regular(def.clone()).expect_err(&def.to_string());
        let msg = err.to_string();
        assert!(msg.contains(text), "{def}: {msg:?} lacks {text:?}");
        assert_eq!(err.key(), key, "{def}: {msg}");
        if let Some(key) = key {
            assert!(msg.contains(key), "{def}: {msg:?} does not name {key}");
        }
    }
}

#[test]
#[rustfmt::skip]
fn operator_policies_accept_only_their_keys() {
    let op = |v: Value| Definition::parse(PolicyKind::Operator, &v);
    for ok in [
        json!({"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "manual"}),
        json!({"ha-mode": "nodes", "ha-params": ["a"]}),
        json!({"max-length": 5, "max-length-bytes": 10, "message-ttl": 1, "expires": 1000}),
        json!({"ha-mode": "all", "ha-min-sync-replicas": 2}),
    ] {
        assert!(op(ok.clone()).is_ok(), "{ok}");
    }
    for (bad, text) in [
        (json!({"ha-mode": "all", "ha-sync-batch-size": 2}), r#"["ha-sync-batch-size"] are not recognised operator policy settings"#),
        (json!({"ha-mode": "all", "ha-promote-on-failure": "always"}), "ha-promote-on-failure"),
        (json!({"ha-mode": "all", "ha-promote-on-shutdown": "always"}), "ha-promote-on-shutdown"),
        (json!({"overflow": "drop-head", "dead-letter-exchange": "x"}), r#"["dead-letter-exchange","overflow"]"#),
        (json!({"queue-master-locator": "random"}), "operator policies accept only expires, message-ttl"),
        (json!({"alternate-exchange": "ae"}), "not recognised operator policy settings"),
        (json!({"bogus": 1}), r#"["bogus"] are not recognised policy settings"#),
    ] {
        let msg = op(bad.clone()).expect_err(&bad.to_string()).to_string();
        assert!(msg.contains(text), "{bad}: {msg:?} lacks {text:?}");
    }
    // Operator policies validate values the same way.
    let err = op(json!({"ha-sync-mode": "automatic"})).unwrap_err();
    assert_eq!(err, DefinitionError::HaModeRequired(keys::HA_SYNC_MODE));
    let err = op(json!({"max-length": -1})).unwrap_err();
    assert_eq!(err.key(), Some(keys::MAX_LENGTH));
}

#[test]
fn json_text_errors() {
    let parse = |s: &str| Definition::parse_str(PolicyKind::Regular, s);
    assert!(parse(r#"{"ha-mode":"all"}"#).is_ok());
    let err = parse(r#"{"ha-mode":"all","ha-mode":"exactly"}"#).unwrap_err();
    assert_eq!(err.to_string(), r#"["ha-mode"] duplicate keys not allowed"#);
    let err = parse(r#"{"ha-mode":"all""#).unwrap_err();
    assert!(
        err.to_string().starts_with("Could not parse JSON document"),
        "{err}"
    );
    let err = parse("42").unwrap_err();
    assert_eq!(err.to_string(), "definition must be a dictionary: 42");
    let err = parse("{}").unwrap_err();
    assert_eq!(err, DefinitionError::Empty);
}

#[test]
fn max_replicas_per_mode() {
    assert_eq!(HaMode::All.max_replicas(), None);
    assert_eq!(count(3).max_replicas(), Some(3));
    let listed = HaMode::Nodes(vec!["a".into(), "b".into(), "a".into()]);
    assert_eq!(listed.max_replicas(), Some(2));
    assert_eq!(listed.params(), Some(json!(["a", "b", "a"])));
    assert_eq!(
        (HaMode::All.name(), count(1).name(), listed.name()),
        ("all", "exactly", "nodes")
    );
}

#[test]
fn the_seed_articles_policy_parses() {
    let def = Definition::parse_str(
        PolicyKind::Regular,
        r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}"#,
    )
    .unwrap();
    let ha = def.ha.unwrap();
    assert_eq!(ha.mode, count(2));
    assert_eq!(ha.sync_mode(), SyncMode::Automatic);
}

fn merged(regular_def: Value, op_def: Value) -> Value {
    let r = Definition::parse(PolicyKind::Regular, &regular_def).unwrap();
    let o = Definition::parse(PolicyKind::Operator, &op_def).unwrap();
    Value::Object(r.merge_operator(&o).to_json())
}

#[test]
#[rustfmt::skip]
fn operator_merge_rules() {
    let cases: &[(Value, Value, Value)] = &[
        // Scenario 12 of the reference.
        (json!({"ha-mode": "exactly", "ha-params": 2}), json!({"ha-mode": "all"}), json!({"ha-mode": "all"})),
        (json!({"ha-mode": "nodes", "ha-params": ["A", "B", "C"]}), json!({"ha-mode": "exactly", "ha-params": 2}), json!({"ha-mode": "exactly", "ha-params": 2})),
        (json!({"ha-mode": "exactly", "ha-params": 2}), json!({"ha-mode": "exactly", "ha-params": 1}), json!({"ha-mode": "exactly", "ha-params": 2})),
        (json!({"ha-mode": "all", "ha-sync-mode": "automatic"}), json!({"ha-mode": "all", "ha-sync-mode": "manual"}), json!({"ha-mode": "all", "ha-sync-mode": "manual"})),
        // all beats anything, from either side.
        (json!({"ha-mode": "all"}), json!({"ha-mode": "nodes", "ha-params": ["A"]}), json!({"ha-mode": "all"})),
        // exactly beats nodes, from either side; larger count wins.
        (json!({"ha-mode": "exactly", "ha-params": 3}), json!({"ha-mode": "nodes", "ha-params": ["A"]}), json!({"ha-mode": "exactly", "ha-params": 3})),
        (json!({"ha-mode": "exactly", "ha-params": 1}), json!({"ha-mode": "exactly", "ha-params": 4}), json!({"ha-mode": "exactly", "ha-params": 4})),
        // Two node lists: the longer; a tie takes the operator's.
        (json!({"ha-mode": "nodes", "ha-params": ["A", "B"]}), json!({"ha-mode": "nodes", "ha-params": ["C"]}), json!({"ha-mode": "nodes", "ha-params": ["A", "B"]})),
        (json!({"ha-mode": "nodes", "ha-params": ["A"]}), json!({"ha-mode": "nodes", "ha-params": ["C"]}), json!({"ha-mode": "nodes", "ha-params": ["C"]})),
        // Sync mode only on one side stays; operator's wins when both set.
        (json!({"ha-mode": "all", "ha-sync-mode": "automatic"}), json!({"ha-mode": "exactly", "ha-params": 2}), json!({"ha-mode": "all", "ha-sync-mode": "automatic"})),
        (json!({"ha-mode": "all"}), json!({"ha-mode": "all", "ha-sync-mode": "automatic"}), json!({"ha-mode": "all", "ha-sync-mode": "automatic"})),
        // Keys on one side only are kept.
        (json!({"max-length": 10}), json!({"ha-mode": "all"}), json!({"ha-mode": "all", "max-length": 10})),
        (json!({"ha-mode": "exactly", "ha-params": 2, "ha-promote-on-failure": "when-synced"}), json!({"max-length": 3}), json!({"ha-mode": "exactly", "ha-params": 2, "ha-promote-on-failure": "when-synced", "max-length": 3})),
        // Numeric caps: the smaller.
        (json!({"max-length": 10, "max-length-bytes": 5, "message-ttl": 100, "expires": 50}), json!({"max-length": 3, "max-length-bytes": 50, "message-ttl": 1000, "expires": 5}), json!({"max-length": 3, "max-length-bytes": 5, "message-ttl": 100, "expires": 5})),
        // Warren: ha-min-sync-replicas, the larger.
        (json!({"ha-mode": "all", "ha-min-sync-replicas": 3}), json!({"ha-mode": "all", "ha-min-sync-replicas": 2}), json!({"ha-mode": "all", "ha-min-sync-replicas": 3})),
        (json!({"ha-mode": "all", "ha-min-sync-replicas": 1}), json!({"ha-mode": "all", "ha-min-sync-replicas": 2}), json!({"ha-mode": "all", "ha-min-sync-replicas": 2})),
        (json!({"ha-mode": "all"}), json!({"ha-mode": "all", "ha-min-sync-replicas": 2}), json!({"ha-mode": "all", "ha-min-sync-replicas": 2})),
        // ...lowered to what the merged mode can place.
        (json!({"ha-mode": "nodes", "ha-params": ["A", "B"], "ha-min-sync-replicas": 2}), json!({"ha-mode": "exactly", "ha-params": 1}), json!({"ha-mode": "exactly", "ha-params": 1, "ha-min-sync-replicas": 1})),
        (json!({"ha-mode": "exactly", "ha-params": 3, "ha-min-sync-replicas": 3}), json!({"ha-mode": "exactly", "ha-params": 2}), json!({"ha-mode": "exactly", "ha-params": 3, "ha-min-sync-replicas": 3})),
    ];
    for (r, o, want) in cases {
        assert_eq!(
            &merged(r.clone(), o.clone()),
            want,
            "regular {r} + operator {o}"
        );
    }
}

#[test]
fn queue_mode_is_read_and_shown() {
    for (mode, want) in [
        ("lazy", crate::QueueMode::Lazy),
        ("default", crate::QueueMode::Default),
    ] {
        let def = regular(json!({ "queue-mode": mode })).unwrap();
        assert_eq!(def.queue_mode, Some(want));
        assert_eq!(def.to_json().get("queue-mode"), Some(&json!(mode)));
    }
}
