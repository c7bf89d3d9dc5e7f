//! Who may see and change what: RabbitMQ's management permission model.
//!
//! Every `/api` request but the OpenAPI document logs in with HTTP basic
//! auth as a user with one of the tags `management`, `policymaker`,
//! `monitoring` or `administrator`. Then [`rule`] decides from the matched
//! route and the method, as RabbitMQ's `rabbit_mgmt_wm_*` modules do with
//! `rabbit_mgmt_util:is_authorized*`:
//!
//! - users, permissions, definitions, `/api/vhosts/{vhost}` and operator
//!   policies (one by one) are for administrators;
//! - nodes and the cluster for monitors (`monitoring` or `administrator`);
//! - a vhost's queues, exchanges, bindings and policy lists, and the
//!   message operations (publish, get, the aliveness test), for
//!   administrators and users with permissions in that vhost;
//! - one policy, read or written, for administrators and for policymakers
//!   with permissions in its vhost;
//! - any other change for administrators.
//!
//! Refusals are 401 like RabbitMQ's. List endpoints then leave out what the
//! user may not see ([`AuthUser`]).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, MatchedPath, RawPathParams, Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use base64::Engine as _;
use serde_json::Value;
use warren_broker::auth::check_password;

use crate::Management;
use crate::api::ApiError;

/// The logged-in user, put in the request's extensions by [`auth`].
#[derive(Debug, Clone)]
pub(crate) struct AuthUser {
    /// The user's name.
    pub(crate) name: String,
    /// Its tags.
    pub(crate) tags: Vec<String>,
    /// The vhosts it has permissions in (may log in to over AMQP).
    vhosts: Vec<String>,
}

impl AuthUser {
    fn has(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    fn is_admin(&self) -> bool {
        self.has("administrator")
    }

    /// `administrator` or `monitoring`: sees every vhost's name, every
    /// connection and consumer, the nodes and the node-wide totals.
    pub(crate) fn is_monitor(&self) -> bool {
        self.is_admin() || self.has("monitoring")
    }

    fn is_policymaker(&self) -> bool {
        self.is_admin() || self.has("policymaker")
    }

    /// Whether the user sees the queues, exchanges, bindings and policies of
    /// `vhost`: administrators those of every vhost, everyone else (monitors
    /// too, as in RabbitMQ) those of the vhosts they have permissions in.
    fn sees_vhost(&self, vhost: &str) -> bool {
        self.is_admin() || self.vhosts.iter().any(|v| v == vhost)
    }

    /// Whether the user may close a connection of `owner`: administrators
    /// any, everyone else their own (`is_authorized_user`).
    pub(crate) fn may_close(&self, owner: &str) -> bool {
        self.is_admin() || self.name == owner
    }

    /// Whether `/api/vhosts` and the overview's totals include `vhost`:
    /// monitors know every vhost, the others theirs.
    pub(crate) fn lists_vhost(&self, vhost: &str) -> bool {
        self.is_monitor() || self.vhosts.iter().any(|v| v == vhost)
    }

    /// Whether the user sees a connection or consumer of `owner`: monitors
    /// see everyone's, the others their own.
    pub(crate) fn sees_owner(&self, owner: &str) -> bool {
        self.is_monitor() || self.name == owner
    }

    /// `items` (JSON objects with a `vhost`) without those of vhosts the
    /// user may not see.
    pub(crate) fn only_visible(&self, items: Vec<Value>) -> Vec<Value> {
        items
            .into_iter()
            .filter(|i| i["vhost"].as_str().is_some_and(|v| self.sees_vhost(v)))
            .collect()
    }
}

/// Who may make a request, after logging in as a management user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// Any management user (`is_authorized`).
    Anyone,
    /// `administrator` or `monitoring` (`is_authorized_monitor`).
    Monitor,
    /// `administrator` (`is_authorized_admin`).
    Admin,
    /// Administrators, and users with permissions in the path's vhost
    /// (`is_authorized_vhost`).
    Vhost,
    /// Administrators, and policymakers with permissions in the path's
    /// vhost (`is_authorized_policies`).
    Policies,
}

/// The rule of the route `template` for `method`. Routes not named here
/// are for administrators.
fn rule(template: &str, method: &Method) -> Rule {
    if template == "/api/policies/{vhost}/{name}" {
        return Rule::Policies;
    }
    if matches!(
        template,
        "/api/connections/{name}" | "/api/connections/{name}/channels" | "/api/channels/{name}"
    ) {
        // Whose connection it is decides, in the handler.
        return Rule::Anyone;
    }
    if matches!(
        template,
        "/api/exchanges/{vhost}/{name}/publish"
            | "/api/queues/{vhost}/{name}/get"
            | "/api/aliveness-test/{vhost}"
    ) {
        // The broker checks the user's write or read permission too.
        return Rule::Vhost;
    }
    if method != Method::GET && method != Method::HEAD {
        return Rule::Admin;
    }
    match template {
        "/api/overview"
        | "/api/whoami"
        | "/api/cluster-name"
        | "/api/vhosts"
        | "/api/connections"
        | "/api/channels"
        | "/api/consumers"
        | "/api/consumers/{vhost}"
        | "/api/{*rest}" => Rule::Anyone,
        t if t.starts_with("/api/health/") || t.starts_with("/api/healthchecks/") => Rule::Anyone,
        "/api/nodes" | "/api/nodes/{name}" | "/api/cluster" => Rule::Monitor,
        "/api/operator-policies/{vhost}/{name}" => Rule::Admin,
        t if matches!(
            t.split('/').nth(2),
            Some("queues" | "exchanges" | "bindings" | "policies" | "operator-policies")
        ) =>
        {
            Rule::Vhost
        }
        _ => Rule::Admin,
    }
}

pub(crate) fn basic_credentials(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let encoded = value
        .strip_prefix("Basic ")
        .or_else(|| value.strip_prefix("basic "))?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (u, p) = text.split_once(':')?;
    Some((u.to_owned(), p.to_owned()))
}

/// The tags that open the management API.
const MANAGEMENT_TAGS: [&str; 4] = ["administrator", "monitoring", "policymaker", "management"];

/// HTTP basic auth and the [`rule`] of the route for everything under
/// `/api` except the OpenAPI document; puts the [`AuthUser`] in the
/// request's extensions.
pub(crate) async fn auth(
    State(s): State<Management>,
    params: Result<RawPathParams, axum::extract::rejection::RawPathParamsRejection>,
    mut req: Request,
    next: Next,
) -> Response {
    let template = req
        .extensions()
        .get::<MatchedPath>()
        .map_or(String::new(), |m| m.as_str().to_owned());
    if template == "/api/openapi.json" {
        return next.run(req).await;
    }
    let Some((name, pass)) = basic_credentials(req.headers()) else {
        return ApiError::unauthorized("Not_Authorized").into_response();
    };
    let peer_is_loopback = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .is_none_or(|c| c.0.ip().is_loopback());
    let vhost = params.ok().and_then(|p| {
        p.iter()
            .find(|(k, _)| *k == "vhost")
            .map(|(_, v)| v.to_owned())
    });
    let (found, vhosts, vhost_exists) = {
        let b = s.broker();
        let vhosts: Vec<String> = b
            .permissions()
            .into_iter()
            .filter(|p| p.user == name)
            .map(|p| p.vhost)
            .collect();
        let exists = vhost.as_deref().is_some_and(|v| b.has_vhost(v));
        (b.user(&name).cloned(), vhosts, exists)
    };
    let Some(u) = found.filter(|u| check_password(&u.password_hash, &pass)) else {
        return ApiError::unauthorized("Not_Authorized").into_response();
    };
    if u.loopback_only && !peer_is_loopback {
        return ApiError::unauthorized("User can only log in via localhost").into_response();
    }
    let user = AuthUser {
        name: u.name,
        tags: u.tags,
        vhosts,
    };
    if !MANAGEMENT_TAGS.iter().any(|t| user.has(t)) {
        return ApiError::unauthorized("Not management user").into_response();
    }
    // A vhost that does not exist is left to the handler's 404, as in
    // RabbitMQ.
    let in_vhost = || !vhost_exists || vhost.as_deref().is_some_and(|v| user.sees_vhost(v));
    let refusal = match rule(&template, req.method()) {
        Rule::Anyone => None,
        Rule::Monitor => (!user.is_monitor()).then_some("Not monitor user"),
        Rule::Admin => (!user.is_admin()).then_some("Not administrator user"),
        Rule::Vhost => (!in_vhost()).then_some("User not authorised to access virtual host"),
        Rule::Policies => (!(user.is_admin() || (user.is_policymaker() && in_vhost())))
            .then_some("User not authorised to access object"),
    };
    if let Some(reason) = refusal {
        return ApiError::unauthorized(reason).into_response();
    }
    req.extensions_mut().insert(user);
    next.run(req).await
}
