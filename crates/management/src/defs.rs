//! `/api/definitions`: export and import in RabbitMQ's definitions format.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use warren_broker::auth::{PermissionDef, UserDef, hash_password};
use warren_broker::meta::{BindingDef, ExchangeDef, PolicyDef};
use warren_broker::{Broker, json_to_table};

use crate::Management;
use crate::api::{ApiError, ApiResult, parse_body, parse_tags, policy_json, validate_policy};

const BUILTIN_EXCHANGES: [&str; 5] = [
    "amq.direct",
    "amq.fanout",
    "amq.topic",
    "amq.headers",
    "amq.match",
];

/// The definitions of the whole node, or of one vhost.
fn export(s: &Management, vhost: Option<&str>) -> ApiResult<Value> {
    let b = s.broker();
    if let Some(v) = vhost
        && !b.has_vhost(v)
    {
        return Err(ApiError::not_found());
    }
    let policies = b.policies();
    let queues: Vec<Value> = b
        .queues(vhost)
        .iter()
        .filter(|q| !q.exclusive)
        .map(|q| {
            json!({"name": q.name, "vhost": q.vhost, "durable": q.durable,
                   "auto_delete": q.auto_delete, "arguments": q.arguments})
        })
        .collect();
    let exchanges: Vec<Value> = b
        .exchanges(vhost)
        .iter()
        .filter(|x| !x.name.is_empty() && !BUILTIN_EXCHANGES.contains(&x.name.as_str()))
        .map(|x| {
            json!({"name": x.name, "vhost": x.vhost, "type": x.kind, "durable": x.durable,
                   "auto_delete": x.auto_delete, "internal": x.internal, "arguments": x.arguments})
        })
        .collect();
    let bindings: Vec<Value> = b
        .bindings(vhost)
        .iter()
        .filter(|x| !x.source.is_empty())
        .map(|x| {
            json!({"source": x.source, "vhost": x.vhost, "destination": x.destination,
                   "destination_type": x.destination_type, "routing_key": x.routing_key,
                   "arguments": x.arguments})
        })
        .collect();
    let regular: Vec<Value> = policies
        .iter()
        .filter(|p| !p.operator && vhost.is_none_or(|v| v == p.vhost))
        .map(policy_json)
        .collect();
    let operator: Vec<Value> = policies
        .iter()
        .filter(|p| p.operator && vhost.is_none_or(|v| v == p.vhost))
        .map(|p| {
            json!({"vhost": p.vhost, "component": "operator_policy", "name": p.name,
                   "value": {"pattern": p.pattern, "definition": p.definition,
                             "priority": p.priority, "apply-to": p.apply_to}})
        })
        .collect();
    let mut out = json!({
        "rabbit_version": "3.13.7",
        "rabbitmq_version": "3.13.7",
        "product_name": s.product.0,
        "product_version": s.product.1,
        "policies": regular,
        "parameters": operator,
        "queues": queues,
        "exchanges": exchanges,
        "bindings": bindings,
    });
    if vhost.is_none()
        && let Value::Object(o) = &mut out
    {
        o.insert(
            "users".into(),
            Value::Array(
                b.users()
                    .iter()
                    .map(|u| {
                        json!({"name": u.name, "password_hash": u.password_hash,
                               "hashing_algorithm": "rabbit_password_hashing_sha256",
                               "tags": u.tags, "limits": {}})
                    })
                    .collect(),
            ),
        );
        o.insert(
            "vhosts".into(),
            Value::Array(
                b.vhost_names()
                    .iter()
                    .map(|v| json!({"name": v, "limits": [], "metadata": {"description": "", "tags": []}}))
                    .collect(),
            ),
        );
        o.insert(
            "permissions".into(),
            Value::Array(
                b.permissions()
                    .iter()
                    .map(|p| {
                        json!({"user": p.user, "vhost": p.vhost, "configure": p.configure,
                               "write": p.write, "read": p.read})
                    })
                    .collect(),
            ),
        );
        o.insert("topic_permissions".into(), json!([]));
        o.insert("global_parameters".into(), json!([]));
    }
    Ok(out)
}

fn arr<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    v.get(key).and_then(Value::as_array).into_iter().flatten()
}

fn field<'a>(x: &'a Value, key: &str, what: &str) -> ApiResult<&'a str> {
    x.get(key).and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad_request(format!("{what} without a '{key}' in the definitions"))
    })
}

/// Imports definitions in RabbitMQ's order: users, vhosts, permissions,
/// exchanges, policies, queues, bindings. Every policy is validated before
/// anything changes. `only_vhost` forces every entity into that vhost.
async fn import(s: &Management, v: &Value, only_vhost: Option<&str>) -> ApiResult<()> {
    s.changing(|b| import_into(b, v, only_vhost)).await
}

/// Imports RabbitMQ definitions JSON into `broker` (what `POST
/// /api/definitions` does), e.g. a `definitions.json` at boot; the error is
/// the reason the API would give.
pub fn import_definitions(broker: &mut Broker, definitions: &Value) -> Result<(), ImportError> {
    import_into(broker, definitions, None).map_err(|e| ImportError(e.reason().to_owned()))
}

/// Why a definitions import was refused.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ImportError(pub String);

fn import_into(b: &mut Broker, v: &Value, only_vhost: Option<&str>) -> ApiResult<()> {
    let vh = |x: &Value| -> String {
        only_vhost.map_or_else(
            || {
                x.get("vhost")
                    .and_then(Value::as_str)
                    .unwrap_or("/")
                    .to_owned()
            },
            str::to_owned,
        )
    };
    // Validate policies first, so a bad one changes nothing.
    let mut policies: Vec<PolicyDef> = Vec::new();
    for p in arr(v, "policies") {
        let name = field(p, "name", "a policy")?;
        policies.push(validate_policy(&vh(p), name, p, false)?);
    }
    for p in arr(v, "parameters") {
        if p.get("component").and_then(Value::as_str) != Some("operator_policy") {
            continue;
        }
        let name = field(p, "name", "a parameter")?;
        let value = p.get("value").cloned().unwrap_or(Value::Null);
        policies.push(validate_policy(&vh(p), name, &value, true)?);
    }
    if only_vhost.is_none() {
        for u in arr(v, "users") {
            let name = field(u, "name", "a user")?.to_owned();
            let password_hash = match (
                u.get("password_hash").and_then(Value::as_str),
                u.get("password").and_then(Value::as_str),
            ) {
                (Some(h), _) => h.to_owned(),
                (None, Some(p)) => hash_password(p),
                (None, None) => String::new(),
            };
            let loopback_only = b.user(&name).is_some_and(|x| x.loopback_only);
            b.put_user(UserDef {
                name,
                password_hash,
                tags: parse_tags(u.get("tags")),
                loopback_only,
            })?;
        }
        for x in arr(v, "vhosts") {
            b.ensure_vhost(field(x, "name", "a vhost")?)?;
        }
        for p in arr(v, "permissions") {
            let s = |k: &str| p.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
            b.set_permissions(PermissionDef {
                user: field(p, "user", "a permission")?.to_owned(),
                vhost: field(p, "vhost", "a permission")?.to_owned(),
                configure: s("configure"),
                write: s("write"),
                read: s("read"),
            })?;
        }
    }
    for x in arr(v, "exchanges") {
        let flag = |k: &str, d: bool| x.get(k).and_then(Value::as_bool).unwrap_or(d);
        b.admin_declare_exchange(ExchangeDef {
            vhost: vh(x),
            name: field(x, "name", "an exchange")?.to_owned(),
            kind: x
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("direct")
                .to_owned(),
            durable: flag("durable", true),
            auto_delete: flag("auto_delete", false),
            internal: flag("internal", false),
            arguments: json_to_table(x.get("arguments").unwrap_or(&Value::Null)),
        })?;
    }
    for p in policies {
        b.put_policy(p)?;
    }
    for q in arr(v, "queues") {
        let flag = |k: &str, d: bool| q.get(k).and_then(Value::as_bool).unwrap_or(d);
        b.admin_declare_queue(
            &vh(q),
            field(q, "name", "a queue")?,
            flag("durable", true),
            flag("auto_delete", false),
            json_to_table(q.get("arguments").unwrap_or(&Value::Null)),
        )?;
    }
    for x in arr(v, "bindings") {
        b.admin_bind(BindingDef {
            vhost: vh(x),
            source: field(x, "source", "a binding")?.to_owned(),
            destination: field(x, "destination", "a binding")?.to_owned(),
            destination_is_exchange: x.get("destination_type").and_then(Value::as_str)
                == Some("exchange"),
            routing_key: x
                .get("routing_key")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
            arguments: json_to_table(x.get("arguments").unwrap_or(&Value::Null)),
        })?;
    }
    Ok(())
}

fn json_response(v: &Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

pub(crate) async fn export_all(State(s): State<Management>) -> ApiResult<Response> {
    Ok(json_response(&export(&s, None)?))
}

pub(crate) async fn export_vhost(
    State(s): State<Management>,
    Path(vhost): Path<String>,
) -> ApiResult<Response> {
    Ok(json_response(&export(&s, Some(&vhost))?))
}

pub(crate) async fn import_all(State(s): State<Management>, body: Bytes) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    import(&s, &v, None).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(crate) async fn import_vhost(
    State(s): State<Management>,
    Path(vhost): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = parse_body(&body)?;
    if !s.broker().has_vhost(&vhost) {
        return Err(ApiError::not_found());
    }
    import(&s, &v, Some(&vhost)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
