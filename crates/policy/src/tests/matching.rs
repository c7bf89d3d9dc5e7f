//! Policy model and matching: vhost, unanchored patterns, apply-to, priority,
//! the tie-break, operator policies and exclusive queues.

use serde_json::{Value, json};

use crate::{
    ApplyTo, EntityKind, HaMode, Policy, PolicyError, PolicyKind, PolicySet, PolicySpec,
    parse_priority, select,
};

fn spec(name: &str, pattern: &str, def: Value) -> PolicySpec {
    PolicySpec::new("/", name, pattern, def)
}

fn all() -> Value {
    json!({"ha-mode": "all"})
}

fn set_of(specs: &[PolicySpec]) -> PolicySet {
    let mut set = PolicySet::new();
    for s in specs {
        set.set(Policy::regular(s).unwrap());
    }
    set
}

fn queue_policy(set: &PolicySet, name: &str) -> Option<String> {
    set.effective_for_queue("/", name, false).policy
}

#[test]
fn policy_fields_are_kept() {
    let s = PolicySpec::new("vh", "p", "^q", all())
        .apply_to(ApplyTo::Queues)
        .priority(7);
    let p = Policy::regular(&s).unwrap();
    assert_eq!((p.vhost(), p.name(), p.pattern()), ("vh", "p", "^q"));
    assert_eq!(
        (p.apply_to(), p.priority(), p.kind()),
        (ApplyTo::Queues, 7, PolicyKind::Regular)
    );
    assert!(p.definition().is_mirroring());
    assert_eq!(
        Policy::operator(&spec("o", ".*", json!({"max-length": 1})))
            .unwrap()
            .kind(),
        PolicyKind::Operator
    );
}

#[test]
fn spec_json_round_trip() {
    let text = r#"{"vhost":"/","name":"hello-ha","pattern":"^hello","definition":{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}}"#;
    let spec: PolicySpec = serde_json::from_str(text).unwrap();
    assert_eq!(
        (spec.apply_to, spec.priority),
        (ApplyTo::All, 0),
        "defaults"
    );
    let policy = Policy::regular(&spec).unwrap();
    assert_eq!(policy.spec(), spec);
    assert_eq!(policy.definition_json(), &spec.definition);
    let back = serde_json::to_value(&spec).unwrap();
    assert_eq!(back["apply-to"], "all");
    let full = r#"{"vhost":"v","name":"n","pattern":".*","apply-to":"exchanges","priority":-2,"definition":{"alternate-exchange":"ae"}}"#;
    let spec: PolicySpec = serde_json::from_str(full).unwrap();
    assert_eq!((spec.apply_to, spec.priority), (ApplyTo::Exchanges, -2));
    let bad = r#"{"vhost":"v","name":"n","pattern":".*","apply-to":"streams","definition":{}}"#;
    let err = serde_json::from_str::<PolicySpec>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("apply-to 'streams' unrecognised"), "{err}");
}

#[test]
fn invalid_policies() {
    let err = Policy::regular(&spec("", ".*", all())).unwrap_err();
    assert_eq!(err, PolicyError::EmptyName);
    let err = Policy::regular(&spec("p", "(", all())).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("pattern \"(\" is not a valid regular expression"),
        "{err}"
    );
    let err = Policy::regular(&spec("p", ".*", json!({"ha-mode": "x"}))).unwrap_err();
    assert!(matches!(err, PolicyError::Definition(_)));
    assert!(err.to_string().contains("is not a valid ha-mode value"));
    // Operator keys are checked by kind.
    let err = Policy::operator(&spec("p", ".*", json!({"overflow": "drop-head"}))).unwrap_err();
    assert!(
        err.to_string()
            .contains("not recognised operator policy settings"),
        "{err}"
    );
}

#[test]
fn apply_to_values() {
    for (text, value) in [
        ("all", ApplyTo::All),
        ("queues", ApplyTo::Queues),
        ("classic_queues", ApplyTo::ClassicQueues),
        ("exchanges", ApplyTo::Exchanges),
    ] {
        assert_eq!(text.parse::<ApplyTo>().unwrap(), value);
        assert_eq!(value.to_string(), text);
    }
    for bad in ["quorum_queues", "streams", "queue", "ALL", ""] {
        let err = bad.parse::<ApplyTo>().unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "apply-to '{bad}' unrecognised; should be one of: 'queues', 'classic_queues', 'exchanges', or 'all'"
            )
        );
    }
    let q = EntityKind::Queue { exclusive: false };
    let table = [
        (ApplyTo::All, q, true),
        (ApplyTo::All, EntityKind::Exchange, true),
        (ApplyTo::Queues, q, true),
        (ApplyTo::Queues, EntityKind::Exchange, false),
        (ApplyTo::ClassicQueues, q, true),
        (ApplyTo::ClassicQueues, EntityKind::Exchange, false),
        (ApplyTo::Exchanges, q, false),
        (ApplyTo::Exchanges, EntityKind::Exchange, true),
    ];
    for (apply_to, kind, fits) in table {
        assert_eq!(apply_to.fits(kind), fits, "{apply_to} {kind:?}");
    }
}

#[test]
fn priorities_parse() {
    assert_eq!(parse_priority("10").unwrap(), 10);
    assert_eq!(parse_priority(" -3 ").unwrap(), -3);
    for bad in ["", "ten", "1.5"] {
        let err = parse_priority(bad).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{bad:?} priority must be a number")
        );
    }
}

#[test]
fn patterns_are_unanchored_regexes() {
    let table: &[(&str, &str, bool)] = &[
        ("ha", "xhay", true),
        ("ha", "aha", true),
        ("^ha\\.", "xha.", false),
        ("^ha\\.", "ha.q", true),
        ("^hello", "hello.world", true),
        ("^hello$", "hello.world", false),
        (".*", "", true),
        ("^$", "", true),
        ("q[0-9]+$", "q12", true),
        ("q[0-9]+$", "q12x", false),
    ];
    for (pattern, queue, hit) in table {
        let set = set_of(&[spec("p", pattern, all())]);
        assert_eq!(
            queue_policy(&set, queue).is_some(),
            *hit,
            "{pattern} vs {queue}"
        );
    }
}

#[test]
fn vhosts_are_separate() {
    let p = Policy::regular(&PolicySpec::new("a", "p", ".*", all())).unwrap();
    assert!(p.matches("a", "q", EntityKind::Queue { exclusive: false }));
    assert!(!p.matches("b", "q", EntityKind::Queue { exclusive: false }));
    let mut set = PolicySet::new();
    set.set(p);
    assert!(set.effective_for_queue("b", "q", false).policy.is_none());
    assert_eq!(
        set.effective_for_queue("a", "q", false).policy.as_deref(),
        Some("p")
    );
}

#[test]
fn highest_priority_wins() {
    let p1 = spec("P1", ".*", json!({"ha-mode": "exactly", "ha-params": 2})).priority(1);
    let p2 = spec("P2", ".*", all()).priority(5);
    let mut set = set_of(&[p1.clone(), p2]);
    let eff = set.effective_for_queue("/", "q", false);
    assert_eq!(eff.policy.as_deref(), Some("P2"));
    assert_eq!(eff.mirroring().unwrap().mode, HaMode::All);
    // Raise P1 to 10: it replaces the stored P1 and now wins.
    let old = set.set(Policy::regular(&p1.priority(10)).unwrap());
    assert_eq!(old.unwrap().priority(), 1);
    let eff = set.effective_for_queue("/", "q", false);
    assert_eq!(eff.policy.as_deref(), Some("P1"));
    assert!(matches!(eff.mirroring().unwrap().mode, HaMode::Exactly(_)));
    // Negative priorities are fine; a non-matching higher one does not count.
    let set = set_of(&[
        spec("neg", ".*", all()).priority(-5),
        spec("high", "^other$", all()).priority(100),
    ]);
    assert_eq!(queue_policy(&set, "q").as_deref(), Some("neg"));
}

#[test]
fn equal_priority_tie_goes_to_the_first_name_whatever_the_order() {
    let a = spec("alpha", ".*", json!({"max-length": 1})).priority(3);
    let b = spec("beta", ".*", json!({"max-length": 2})).priority(3);
    let c = spec("Zed", ".*", json!({"max-length": 3})).priority(2);
    for order in [
        vec![a.clone(), b.clone(), c.clone()],
        vec![b.clone(), a.clone(), c.clone()],
        vec![c.clone(), b.clone(), a.clone()],
    ] {
        assert_eq!(queue_policy(&set_of(&order), "q").as_deref(), Some("alpha"));
    }
    // Byte order: upper case sorts before lower case.
    let up = spec("Upper", ".*", all()).priority(3);
    assert_eq!(
        queue_policy(&set_of(&[a, b, up]), "q").as_deref(),
        Some("Upper")
    );
}

#[test]
fn apply_to_filters_matching() {
    let table = [
        (ApplyTo::Exchanges, false, true),
        (ApplyTo::ClassicQueues, true, false),
        (ApplyTo::Queues, true, false),
        (ApplyTo::All, true, true),
    ];
    for (apply_to, queue_hit, exchange_hit) in table {
        let set = set_of(&[spec("p", ".*", all()).apply_to(apply_to)]);
        assert_eq!(
            set.effective_for_queue("/", "q", false).is_mirrored(),
            queue_hit,
            "{apply_to}"
        );
        assert_eq!(
            set.effective_for_exchange("/", "q").policy.is_some(),
            exchange_hit,
            "{apply_to}"
        );
    }
    // A queues-only policy of higher priority does not hide an exchange policy.
    let set = set_of(&[
        spec("qs", ".*", all())
            .apply_to(ApplyTo::Queues)
            .priority(9),
        spec("xs", ".*", json!({"alternate-exchange": "ae"})).apply_to(ApplyTo::Exchanges),
    ]);
    assert_eq!(
        set.effective_for_exchange("/", "x").policy.as_deref(),
        Some("xs")
    );
    assert_eq!(queue_policy(&set, "x").as_deref(), Some("qs"));
}

#[test]
fn exclusive_queues_are_never_mirrored() {
    let set = set_of(&[spec("ha", ".*", json!({"ha-mode": "all", "max-length": 5}))]);
    let eff = set.effective_for_queue("/", "amq.gen-1", true);
    assert_eq!(
        eff.policy.as_deref(),
        Some("ha"),
        "the policy still applies"
    );
    assert_eq!(eff.definition.max_length, Some(5));
    assert!(eff.mirroring().is_none());
    assert!(!eff.is_mirrored());
    assert!(
        set.effective_for_queue("/", "amq.gen-1", false)
            .is_mirrored()
    );
}

#[test]
fn operator_policy_is_matched_separately_and_merged() {
    let mut set = set_of(&[spec(
        "user",
        "^q",
        json!({"ha-mode": "exactly", "ha-params": 2, "max-length": 100}),
    )]);
    set.set(
        Policy::operator(&spec(
            "cap",
            ".*",
            json!({"max-length": 10, "ha-mode": "all"}),
        ))
        .unwrap(),
    );
    let eff = set.effective_for_queue("/", "q1", false);
    assert_eq!(eff.policy.as_deref(), Some("user"));
    assert_eq!(eff.operator_policy.as_deref(), Some("cap"));
    assert_eq!(eff.definition.max_length, Some(10));
    assert_eq!(eff.mirroring().unwrap().mode, HaMode::All);
    // Only the operator policy matches.
    let eff = set.effective_for_queue("/", "other", false);
    assert_eq!(eff.policy, None);
    assert_eq!(eff.definition.max_length, Some(10));
    // Nothing matches.
    let eff = set.effective_for_queue("/vh", "q1", false);
    assert_eq!(
        (eff.policy, eff.operator_policy, eff.definition.ha),
        (None, None, None)
    );
}

#[test]
fn set_get_clear() {
    let mut set = set_of(&[spec("a", ".*", all()), spec("b", ".*", all())]);
    set.set(Policy::operator(&spec("a", ".*", json!({"max-length": 1}))).unwrap());
    assert_eq!(set.iter(PolicyKind::Regular).count(), 2);
    assert_eq!(set.iter(PolicyKind::Operator).count(), 1);
    assert!(set.get(PolicyKind::Operator, "/", "a").is_some());
    assert!(set.get(PolicyKind::Regular, "/x", "a").is_none());
    assert!(set.clear(PolicyKind::Regular, "/", "a").is_some());
    assert!(set.clear(PolicyKind::Regular, "/", "a").is_none());
    assert!(
        set.get(PolicyKind::Operator, "/", "a").is_some(),
        "other kind untouched"
    );
    assert_eq!(queue_policy(&set, "q").as_deref(), Some("b"));
}

#[test]
fn select_over_any_slice() {
    let ps: Vec<Policy> = ["b", "a", "c"]
        .iter()
        .map(|n| Policy::regular(&spec(n, ".*", all())).unwrap())
        .collect();
    let kind = EntityKind::Queue { exclusive: false };
    assert_eq!(select(&ps, "/", "q", kind).map(Policy::name), Some("a"));
    assert!(select(&ps[..0], "/", "q", kind).is_none());
}
