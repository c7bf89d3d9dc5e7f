//! RabbitMQ's management permission model over HTTP: what `monitoring`,
//! `management`, `policymaker` and `administrator` users see and change.
//!
//! The fixture has vhosts `a` and `b` with a queue, an exchange, a binding
//! and a policy each, and an operator policy in `a`. `mon` (monitoring),
//! `mgmt` (management) and `pol` (policymaker) have permissions in `a`
//! only; `guest` (administrator) in `/` only; `nobody` has no tag.

mod common;

use serde_json::{Value, json};
use tempfile::TempDir;
use warren_management::Management;

const GUEST: (&str, &str) = ("guest", "guest");
const MON: (&str, &str) = ("mon", "pw");
const MGMT: (&str, &str) = ("mgmt", "pw");
const POL: (&str, &str) = ("pol", "pw");

/// A request as `user`; the status and the parsed body (Null if empty).
async fn call(
    addr: &str,
    user: (&str, &str),
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let (status, text) = common::request_as(addr, user, method, path, body).await;
    let v = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    (status, v)
}

/// A GET that must answer 200; its body.
async fn get_ok(addr: &str, user: (&str, &str), path: &str) -> Value {
    let (status, v) = call(addr, user, "GET", path, None).await;
    assert_eq!(status, 200, "{} GET {path}: {v}", user.0);
    v
}

/// Asserts a 401 with `reason` for `user`'s request.
async fn refused(addr: &str, user: (&str, &str), method: &str, path: &str, reason: &str) {
    let (status, v) = call(addr, user, method, path, Some(json!({}))).await;
    assert_eq!(status, 401, "{} {method} {path}: {v}", user.0);
    assert_eq!(v["reason"], reason, "{} {method} {path}", user.0);
}

/// The `field` of every item of a list, sorted.
fn names(list: &Value, field: &str) -> Vec<String> {
    let mut v: Vec<String> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|i| i[field].as_str().unwrap().to_owned())
        .collect();
    v.sort();
    v
}

async fn fixture() -> (TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let addr = common::serve(Management::new(common::broker(dir.path()))).await;
    let all = json!({"configure": ".*", "write": ".*", "read": ".*"});
    let put = |path: String, body: Value| {
        let addr = addr.clone();
        async move {
            let (status, v) = call(&addr, GUEST, "PUT", &path, Some(body)).await;
            assert!(status == 201 || status == 204, "PUT {path}: {status} {v}");
        }
    };
    for (user, tags) in [
        ("mon", "monitoring"),
        ("mgmt", "management"),
        ("pol", "policymaker"),
        ("nobody", ""),
    ] {
        put(
            format!("/api/users/{user}"),
            json!({"password": "pw", "tags": tags}),
        )
        .await;
    }
    for v in ["a", "b"] {
        put(format!("/api/vhosts/{v}"), json!({})).await;
        put(format!("/api/queues/{v}/q{v}"), json!({})).await;
        put(
            format!("/api/exchanges/{v}/x{v}"),
            json!({"type": "direct"}),
        )
        .await;
        let (status, _) = call(
            &addr,
            GUEST,
            "POST",
            &format!("/api/bindings/{v}/e/x{v}/q/q{v}"),
            Some(json!({"routing_key": "k"})),
        )
        .await;
        assert_eq!(status, 201);
        put(
            format!("/api/policies/{v}/p{v}"),
            json!({"pattern": "^q", "definition": {"max-length": 10}}),
        )
        .await;
    }
    put(
        "/api/operator-policies/a/opa".into(),
        json!({"pattern": "^q", "definition": {"max-length": 5}}),
    )
    .await;
    for user in ["mon", "mgmt", "pol"] {
        put(format!("/api/permissions/a/{user}"), all.clone()).await;
    }
    (dir, addr)
}

#[tokio::test]
async fn only_administrators_see_users_permissions_and_definitions() {
    let (_dir, addr) = fixture().await;
    let admin_only = [
        ("GET", "/api/users"),
        ("GET", "/api/users/guest"),
        ("PUT", "/api/users/eve"),
        ("DELETE", "/api/users/mgmt"),
        ("GET", "/api/permissions"),
        ("GET", "/api/permissions/a/mgmt"),
        ("PUT", "/api/permissions/b/mgmt"),
        ("DELETE", "/api/permissions/a/mgmt"),
        ("GET", "/api/definitions"),
        ("POST", "/api/definitions"),
        ("GET", "/api/definitions/a"),
        ("POST", "/api/definitions/a"),
        ("GET", "/api/vhosts/a"),
        ("PUT", "/api/vhosts/c"),
        ("DELETE", "/api/vhosts/b"),
        ("GET", "/api/operator-policies/a/opa"),
        ("PUT", "/api/operator-policies/a/op2"),
        ("DELETE", "/api/operator-policies/a/opa"),
        ("PUT", "/api/queues/a/new"),
        ("DELETE", "/api/queues/a/qa"),
        ("DELETE", "/api/queues/a/qa/contents"),
        ("POST", "/api/queues/a/qa/actions"),
        ("PUT", "/api/exchanges/a/new"),
        ("POST", "/api/bindings/a/e/xa/q/qa"),
        ("POST", "/api/nodes/warren@a/stop_app"),
    ];
    for user in [MON, MGMT, POL] {
        for (method, path) in admin_only {
            refused(&addr, user, method, path, "Not administrator user").await;
        }
    }
    // Nothing above changed: the administrator still finds it all.
    let users = get_ok(&addr, GUEST, "/api/users").await;
    assert_eq!(
        names(&users, "name"),
        ["guest", "mgmt", "mon", "nobody", "pol"]
    );
    assert!(users[0]["password_hash"].is_string(), "{users}");
    let perms = get_ok(&addr, GUEST, "/api/permissions").await;
    assert_eq!(names(&perms, "user"), ["guest", "mgmt", "mon", "pol"]);
    get_ok(&addr, GUEST, "/api/operator-policies/a/opa").await;
    get_ok(&addr, GUEST, "/api/queues/a/qa").await;
    let defs = get_ok(&addr, GUEST, "/api/definitions").await;
    assert!(defs["users"][0]["password_hash"].is_string(), "{defs}");

    // No tag: no way in at all.
    refused(
        &addr,
        ("nobody", "pw"),
        "GET",
        "/api/overview",
        "Not management user",
    )
    .await;
}

#[tokio::test]
async fn no_password_hash_reaches_anyone_but_administrators() {
    let (_dir, addr) = fixture().await;
    let guest_hash = get_ok(&addr, GUEST, "/api/users/guest").await["password_hash"]
        .as_str()
        .unwrap()
        .to_owned();
    let readable = [
        "/api/overview",
        "/api/whoami",
        "/api/vhosts",
        "/api/queues",
        "/api/exchanges",
        "/api/bindings",
        "/api/policies",
        "/api/operator-policies",
        "/api/connections",
        "/api/consumers",
        "/api/nodes",
        "/api/users",
        "/api/users/guest",
        "/api/definitions",
        "/api/definitions/a",
    ];
    for user in [MON, MGMT, POL] {
        for path in readable {
            let (_, body) = common::request_as(&addr, user, "GET", path, None).await;
            assert!(
                !body.contains("password_hash") && !body.contains(&guest_hash),
                "{} GET {path}: {body}",
                user.0
            );
        }
    }
}

#[tokio::test]
async fn vhost_contents_are_for_those_with_permissions_in_the_vhost() {
    let (_dir, addr) = fixture().await;
    // Monitoring users too: RabbitMQ shows everyone but administrators the
    // queues, exchanges, bindings and policies of their own vhosts only.
    for user in [MON, MGMT, POL] {
        let qs = get_ok(&addr, user, "/api/queues").await;
        assert_eq!(names(&qs, "name"), ["qa"], "{}", user.0);
        let paged = get_ok(&addr, user, "/api/queues?page=1&page_size=10").await;
        assert_eq!(paged["total_count"], 1, "{paged}");
        let qs = get_ok(&addr, user, "/api/queues/a").await;
        assert_eq!(names(&qs, "name"), ["qa"]);
        get_ok(&addr, user, "/api/queues/a/qa").await;
        let xs = get_ok(&addr, user, "/api/exchanges").await;
        assert_eq!(names(&xs, "vhost").last().unwrap(), "a", "{xs}");
        assert!(names(&xs, "name").contains(&"xa".to_owned()));
        assert!(!names(&xs, "name").contains(&"xb".to_owned()), "{xs}");
        get_ok(&addr, user, "/api/exchanges/a/xa").await;
        let bs = get_ok(&addr, user, "/api/bindings").await;
        assert!(names(&bs, "vhost").iter().all(|v| v == "a"), "{bs}");
        assert!(names(&bs, "source").contains(&"xa".to_owned()));
        get_ok(&addr, user, "/api/bindings/a/e/xa/q/qa").await;
        let ps = get_ok(&addr, user, "/api/policies").await;
        assert_eq!(names(&ps, "name"), ["pa"]);
        assert_eq!(
            names(&get_ok(&addr, user, "/api/policies/a").await, "name"),
            ["pa"]
        );
        let ops = get_ok(&addr, user, "/api/operator-policies").await;
        assert_eq!(names(&ops, "name"), ["opa"]);

        for path in [
            "/api/queues/b",
            "/api/queues/b/qb",
            "/api/exchanges/b",
            "/api/exchanges/b/xb",
            "/api/bindings/b",
            "/api/bindings/b/e/xb/q/qb",
            "/api/policies/b",
            "/api/operator-policies/b",
        ] {
            refused(
                &addr,
                user,
                "GET",
                path,
                "User not authorised to access virtual host",
            )
            .await;
        }
        // A vhost that does not exist is a 404, as in RabbitMQ.
        let (status, _) = call(&addr, user, "GET", "/api/queues/nowhere", None).await;
        assert_eq!(status, 404);
    }
    // The administrator sees every vhost, permissions or not.
    let qs = get_ok(&addr, GUEST, "/api/queues").await;
    assert_eq!(names(&qs, "name"), ["qa", "qb"]);
    get_ok(&addr, GUEST, "/api/queues/b/qb").await;
    let ps = get_ok(&addr, GUEST, "/api/policies").await;
    assert_eq!(names(&ps, "name"), ["pa", "pb"]);
}

#[tokio::test]
async fn monitors_know_every_vhost_and_node_the_others_their_own() {
    let (_dir, addr) = fixture().await;
    let vs = get_ok(&addr, MON, "/api/vhosts").await;
    assert_eq!(names(&vs, "name"), ["/", "a", "b"]);
    get_ok(&addr, MON, "/api/nodes").await;
    get_ok(&addr, MON, "/api/nodes/warren@a").await;
    let o = get_ok(&addr, MON, "/api/overview").await;
    assert_eq!(o["node"], "warren@a");
    assert_eq!(o["object_totals"]["queues"], 2, "{o}");
    assert!(o["object_totals"]["consumers"].is_u64(), "{o}");

    for user in [MGMT, POL] {
        let vs = get_ok(&addr, user, "/api/vhosts").await;
        assert_eq!(names(&vs, "name"), ["a"], "{}", user.0);
        for path in ["/api/nodes", "/api/nodes/warren@a", "/api/cluster"] {
            refused(&addr, user, "GET", path, "Not monitor user").await;
        }
        let o = get_ok(&addr, user, "/api/overview").await;
        assert_eq!(o["object_totals"]["queues"], 1, "{o}");
        let xs = get_ok(&addr, GUEST, "/api/exchanges/a").await;
        assert_eq!(
            o["object_totals"]["exchanges"],
            xs.as_array().unwrap().len(),
            "{o}"
        );
        assert_eq!(o["object_totals"]["connections"], 0);
        assert!(o["object_totals"].get("consumers").is_none(), "{o}");
        assert!(
            o.get("node").is_none() && o.get("listeners").is_none(),
            "{o}"
        );
        assert_eq!(o["cluster_name"], "warren@a");
    }
    // Everyone may read the health checks, whoami and the cluster name.
    for user in [MON, MGMT, POL] {
        get_ok(&addr, user, "/api/health/checks/alarms").await;
        get_ok(&addr, user, "/api/cluster-name").await;
        let me = get_ok(&addr, user, "/api/whoami").await;
        assert_eq!(me["name"], user.0);
    }
}

#[tokio::test]
async fn policymakers_manage_policies_in_their_vhosts_only() {
    let (_dir, addr) = fixture().await;
    let body = json!({"pattern": "^x", "definition": {"max-length": 3}});
    let (status, v) = call(&addr, POL, "PUT", "/api/policies/a/new", Some(body.clone())).await;
    assert_eq!(status, 201, "{v}");
    let p = get_ok(&addr, POL, "/api/policies/a/new").await;
    assert_eq!(p["pattern"], "^x");
    let (status, _) = call(&addr, POL, "DELETE", "/api/policies/a/new", None).await;
    assert_eq!(status, 204);
    let (status, _) = call(&addr, POL, "PUT", "/api/policies/nowhere/x", Some(body)).await;
    assert_eq!(status, 404, "a missing vhost is not found, as in RabbitMQ");

    let foreign = "User not authorised to access object";
    for method in ["GET", "PUT", "DELETE"] {
        refused(&addr, POL, method, "/api/policies/b/pb", foreign).await;
    }
    for (method, path) in [
        ("PUT", "/api/operator-policies/a/op2"),
        ("DELETE", "/api/operator-policies/a/opa"),
    ] {
        refused(&addr, POL, method, path, "Not administrator user").await;
    }
    // Management and monitoring users may list their vhosts' policies but
    // not read or write one.
    for user in [MGMT, MON] {
        for method in ["GET", "PUT", "DELETE"] {
            refused(&addr, user, method, "/api/policies/a/pa", foreign).await;
        }
    }
    let ps = get_ok(&addr, GUEST, "/api/policies").await;
    assert_eq!(names(&ps, "name"), ["pa", "pb"]);
    let ops = get_ok(&addr, GUEST, "/api/operator-policies").await;
    assert_eq!(names(&ops, "name"), ["opa"]);
}
