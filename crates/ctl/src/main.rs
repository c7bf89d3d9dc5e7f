//! `warrenctl`: rabbitmqctl's verbs against a Warren node's management
//! HTTP API.
//!
//! Output follows rabbitmqctl: a banner line, a header row and
//! tab-separated rows (`-q` drops the banner, `-s` the header too), or JSON
//! with `--formatter json`. Exit codes: 0 success, 64 usage, 65 data
//! refused by the node (e.g. a policy the validator rejects), 69 node
//! unreachable or the verb not supported by the node yet, 70 other errors.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use base64::Engine as _;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Map, Value, json};

/// Command line of `warrenctl`.
#[derive(Debug, Parser)]
#[command(
    name = "warrenctl",
    version,
    about = "Manage a Warren node (rabbitmqctl's verbs over the management HTTP API)"
)]
struct Cli {
    /// The node's management HTTP address.
    #[arg(long, short = 'n', global = true, default_value = "127.0.0.1:15672")]
    node: String,
    /// User for the management API.
    #[arg(long, global = true, default_value = "guest")]
    username: String,
    /// Password for the management API.
    #[arg(long, global = true, default_value = "guest")]
    password: String,
    /// Virtual host.
    #[arg(short = 'p', long = "vhost", global = true, default_value = "/")]
    vhost: String,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = Formatter::Table)]
    formatter: Formatter,
    /// Drop informational lines.
    #[arg(short = 'q', long, global = true)]
    quiet: bool,
    /// Drop informational lines and table headers.
    #[arg(short = 's', long, global = true)]
    silent: bool,
    /// Drop table headers.
    #[arg(long, global = true)]
    no_table_headers: bool,
    /// Request timeout in seconds.
    #[arg(short = 't', long, global = true, default_value_t = 60)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Formatter {
    /// Tab-separated columns.
    Table,
    /// JSON.
    Json,
}

/// The verbs.
#[derive(Debug, Subcommand)]
#[command(rename_all = "snake_case")]
enum Cmd {
    /// Node status.
    Status,
    /// Cluster membership and listeners.
    ClusterStatus,
    /// Join a cluster: stop_app first; the node is reset (its own metadata
    /// and messages discarded) and restarts as a member, its app stopped.
    JoinCluster {
        /// A running member's peer address HOST:PORT (its --peer-addr).
        seed: String,
        /// Accepted and ignored (RAM nodes are not supported).
        #[arg(long)]
        ram: bool,
    },
    /// Remove a node from the cluster.
    ForgetClusterNode {
        /// The node to remove.
        node_name: String,
        /// Edit a stopped node's data directory instead of asking a running
        /// node (unsafe; for when the other nodes are gone for good).
        #[arg(long, requires_all = ["data_dir", "local_node"])]
        offline: bool,
        /// With --offline: the stopped node's data directory.
        #[arg(long = "data-dir")]
        data_dir: Option<std::path::PathBuf>,
        /// With --offline: the stopped node's own name (rabbitmqctl's `-n`).
        #[arg(long = "local-node")]
        local_node: Option<String>,
    },
    /// Stop the node.
    Stop,
    /// Stop the broker application.
    StopApp,
    /// Start the broker application.
    StartApp,
    /// Set the memory high watermark: `<fraction>` of the machine's memory,
    /// or `absolute <size>` (e.g. `absolute 2GB`).
    SetVmMemoryHighWatermark {
        /// `<fraction>` or `absolute <size>`.
        #[arg(num_args = 1..=2, required = true)]
        limit: Vec<String>,
    },
    /// Set the disk free limit: `<size>` (e.g. `50MB`), or `mem_relative
    /// <multiple>` of the machine's memory.
    SetDiskFreeLimit {
        /// `<size>` or `mem_relative <multiple>`.
        #[arg(num_args = 1..=2, required = true)]
        limit: Vec<String>,
    },
    /// Add a virtual host.
    AddVhost {
        /// Its name.
        name: String,
    },
    /// Delete a virtual host.
    DeleteVhost {
        /// Its name.
        name: String,
    },
    /// List virtual hosts.
    ListVhosts {
        /// Columns (default: name).
        items: Vec<String>,
    },
    /// Add a user.
    AddUser {
        /// User name.
        user: String,
        /// Password.
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: String,
    },
    /// Delete a user.
    DeleteUser {
        /// User name.
        user: String,
    },
    /// Change a user's password.
    ChangePassword {
        /// User name.
        user: String,
        /// The new password.
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: String,
    },
    /// Set a user's tags (replacing the old ones).
    SetUserTags {
        /// User name.
        user: String,
        /// Tags (administrator, monitoring, policymaker, management).
        tags: Vec<String>,
    },
    /// List users.
    ListUsers,
    /// Set a user's permissions in a vhost.
    SetPermissions {
        /// User name.
        user: String,
        /// Configure regex.
        conf: String,
        /// Write regex.
        write: String,
        /// Read regex.
        read: String,
    },
    /// Clear a user's permissions in a vhost.
    ClearPermissions {
        /// User name.
        user: String,
    },
    /// List the permissions in a vhost.
    ListPermissions,
    /// List a user's permissions in every vhost.
    ListUserPermissions {
        /// User name.
        user: String,
    },
    /// Set a policy.
    SetPolicy(PolicyArgs),
    /// Clear a policy.
    ClearPolicy {
        /// The policy's name.
        name: String,
    },
    /// List policies in a vhost.
    ListPolicies,
    /// Set an operator policy.
    SetOperatorPolicy(PolicyArgs),
    /// Clear an operator policy.
    ClearOperatorPolicy {
        /// The policy's name.
        name: String,
    },
    /// List operator policies in a vhost.
    ListOperatorPolicies,
    /// List queues.
    ListQueues {
        /// Columns (default: name messages).
        items: Vec<String>,
        /// Only queues whose master is on the target node.
        #[arg(long)]
        local: bool,
        /// Accepted for compatibility (every queue is online).
        #[arg(long)]
        online: bool,
        /// Accepted for compatibility (no queue is offline).
        #[arg(long)]
        offline: bool,
    },
    /// List exchanges.
    ListExchanges {
        /// Columns (default: name type).
        items: Vec<String>,
    },
    /// List bindings.
    ListBindings {
        /// Columns (default: source_name source_kind destination_name destination_kind routing_key arguments).
        items: Vec<String>,
    },
    /// List client connections.
    ListConnections {
        /// Columns (default: user peer_host peer_port state).
        items: Vec<String>,
    },
    /// Close a client connection (its name as `list_connections name`
    /// shows it); the client gets 320 CONNECTION_FORCED with the explanation.
    CloseConnection {
        /// The connection's name.
        connection: String,
        /// Why, as the client will read it.
        explanation: String,
    },
    /// List consumers.
    ListConsumers {
        /// Columns (default: queue_name channel_pid consumer_tag ack_required prefetch_count active arguments).
        items: Vec<String>,
    },
    /// Synchronise a queue's mirrors.
    SyncQueue {
        /// The queue.
        queue: String,
    },
    /// Print a fingerprint of the messages the target node's copy of a
    /// queue holds (a Warren extension): replicas holding the same
    /// messages in the same order print the same digest.
    QueueDigest {
        /// The queue.
        queue: String,
    },
    /// Cancel a queue's synchronisation.
    CancelSyncQueue {
        /// The queue.
        queue: String,
    },
    /// Purge a queue's ready messages.
    PurgeQueue {
        /// The queue.
        queue: String,
    },
    /// Delete a queue.
    DeleteQueue {
        /// The queue.
        queue: String,
        /// Only if it has no ready messages.
        #[arg(long = "if-empty", short = 'e')]
        if_empty: bool,
        /// Only if it has no consumers.
        #[arg(long = "if-unused", short = 'u')]
        if_unused: bool,
    },
    /// Export definitions to a file (`-` for standard output).
    ExportDefinitions {
        /// The file.
        path: String,
    },
    /// Import definitions from a file (`-` for standard input).
    ImportDefinitions {
        /// The file.
        path: String,
    },
}

/// Arguments of `set_policy` and `set_operator_policy`.
#[derive(Debug, clap::Args)]
struct PolicyArgs {
    /// Policy priority.
    #[arg(long, default_value_t = 0)]
    priority: i64,
    /// all, queues, classic_queues or exchanges.
    #[arg(long, default_value = "all")]
    apply_to: String,
    /// The policy's name.
    name: String,
    /// The regex over entity names.
    pattern: String,
    /// The definition (JSON object).
    definition: String,
}

/// A failure with its exit code.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

const EX_USAGE: u8 = 64;
const EX_DATAERR: u8 = 65;
const EX_UNAVAILABLE: u8 = 69;
const EX_SOFTWARE: u8 = 70;

type Res<T> = Result<T, Failure>;

/// Percent-encodes one path segment (`/` → `%2F`).
fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A client for one node's management API.
struct Client {
    agent: ureq::Agent,
    base: String,
    node: String,
    auth: String,
}

impl Client {
    fn new(cli: &Cli) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(cli.timeout.max(1)))
            .build();
        let base = if cli.node.starts_with("http://") || cli.node.starts_with("https://") {
            cli.node.trim_end_matches('/').to_owned()
        } else {
            format!("http://{}", cli.node)
        };
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD
                .encode(format!("{}:{}", cli.username, cli.password))
        );
        Self {
            agent,
            base,
            node: cli.node.clone(),
            auth,
        }
    }

    /// Sends a request; the status and the parsed body (Null when empty).
    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> Res<(u16, Value)> {
        self.send_with(method, path, body, None)
    }

    /// [`send`](Self::send) with an `X-Reason` header (why an operator
    /// closes a connection, as RabbitMQ's management API takes it).
    fn send_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        reason: Option<&str>,
    ) -> Res<(u16, Value)> {
        let url = format!("{}{path}", self.base);
        let mut req = self
            .agent
            .request(method, &url)
            .set("Authorization", &self.auth)
            .set("Accept", "application/json");
        if let Some(r) = reason {
            req = req.set("X-Reason", r);
        }
        let result = match body {
            Some(b) => req
                .set("Content-Type", "application/json")
                .send_string(&b.to_string()),
            None => req.call(),
        };
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(ureq::Error::Transport(t)) => {
                return Err(Failure::new(
                    EX_UNAVAILABLE,
                    format!(
                        "could not reach node {}: {t}\n\nIs a Warren node running with its management listener (--http-addr) on {}?",
                        self.node, self.node
                    ),
                ));
            }
        };
        let status = resp.status();
        let text = resp
            .into_string()
            .map_err(|e| Failure::new(EX_SOFTWARE, format!("reading the reply: {e}")))?;
        let v = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        Ok((status, v))
    }

    /// Sends and turns a non-2xx status into a failure.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Res<Value> {
        self.call_with(method, path, body, None)
    }

    /// [`call`](Self::call) with an `X-Reason` header.
    fn call_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        reason: Option<&str>,
    ) -> Res<Value> {
        let (status, v) = self.send_with(method, path, body, reason)?;
        if (200..300).contains(&status) {
            return Ok(v);
        }
        let reason = v
            .get("reason")
            .and_then(Value::as_str)
            .map_or_else(|| v.to_string(), str::to_owned);
        let code = match status {
            400 => EX_DATAERR,
            401 | 403 => EX_USAGE,
            404 => EX_DATAERR,
            _ => EX_SOFTWARE,
        };
        let message = match status {
            401 | 403 => format!("not authorised by node {}: {reason}", self.node),
            404 => format!("not found on node {}: {reason}", self.node),
            _ => reason,
        };
        Err(Failure::new(code, message))
    }

    fn get(&self, path: &str) -> Res<Value> {
        self.call("GET", path, None)
    }
}

/// How a `list_*` command prints.
struct Out<'a> {
    cli: &'a Cli,
}

impl Out<'_> {
    fn info(&self, line: &str) {
        if !(self.cli.quiet || self.cli.silent) && self.cli.formatter == Formatter::Table {
            println!("{line}");
        }
    }

    /// Prints rows of `(column, value)` in the chosen format.
    fn table(&self, columns: &[String], rows: &[Vec<Value>]) {
        match self.cli.formatter {
            Formatter::Json => {
                let arr: Vec<Value> = rows
                    .iter()
                    .map(|r| {
                        let mut m = Map::new();
                        for (c, v) in columns.iter().zip(r) {
                            m.insert(c.clone(), v.clone());
                        }
                        Value::Object(m)
                    })
                    .collect();
                println!("{}", Value::Array(arr));
            }
            Formatter::Table => {
                let mut out = std::io::stdout().lock();
                if !(self.cli.silent || self.cli.no_table_headers) {
                    let _ = writeln!(out, "{}", columns.join("\t"));
                }
                for r in rows {
                    let cells: Vec<String> = r.iter().map(cell).collect();
                    let _ = writeln!(out, "{}", cells.join("\t"));
                }
            }
        }
    }
}

/// A value as a table cell: strings bare, lists as `[a, b]`, objects as JSON.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(a) => {
            let parts: Vec<String> = a.iter().map(cell).collect();
            format!("[{}]", parts.join(", "))
        }
        other => other.to_string(),
    }
}

/// Picks `items` (or `default`) from each object with `get`, refusing
/// unknown columns with the list of valid ones.
fn select(
    objects: &[Value],
    items: &[String],
    default: &[&str],
    valid: &[&str],
    get: impl Fn(&Value, &str) -> Value,
) -> Res<(Vec<String>, Vec<Vec<Value>>)> {
    let columns: Vec<String> = if items.is_empty() {
        default.iter().map(|s| (*s).to_owned()).collect()
    } else {
        items.to_vec()
    };
    let bad: Vec<&String> = columns
        .iter()
        .filter(|c| !valid.contains(&c.as_str()))
        .collect();
    if !bad.is_empty() {
        let bad: Vec<&str> = bad.iter().map(|s| s.as_str()).collect();
        return Err(Failure::new(
            EX_USAGE,
            format!(
                "Info key(s) {} are not supported. Valid keys are: {}",
                bad.join(","),
                valid.join(", ")
            ),
        ));
    }
    let rows = objects
        .iter()
        .map(|o| columns.iter().map(|c| get(o, c)).collect())
        .collect();
    Ok((columns, rows))
}

fn field(o: &Value, k: &str) -> Value {
    o.get(k).cloned().unwrap_or(Value::Null)
}

fn list(v: Value) -> Vec<Value> {
    match v {
        Value::Array(a) => a,
        Value::Object(mut o) => match o.remove("items") {
            Some(Value::Array(a)) => a,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

const QUEUE_KEYS: &[&str] = &[
    "name",
    "durable",
    "auto_delete",
    "arguments",
    "policy",
    "operator_policy",
    "effective_policy_definition",
    "pid",
    "owner_pid",
    "exclusive",
    "exclusive_consumer_pid",
    "exclusive_consumer_tag",
    "messages_ready",
    "messages_unacknowledged",
    "messages",
    "messages_ready_ram",
    "messages_unacknowledged_ram",
    "messages_ram",
    "messages_persistent",
    "message_bytes",
    "message_bytes_ready",
    "message_bytes_unacknowledged",
    "message_bytes_ram",
    "message_bytes_persistent",
    "head_message_timestamp",
    "disk_reads",
    "disk_writes",
    "consumers",
    "consumer_utilisation",
    "consumer_capacity",
    "memory",
    "slave_pids",
    "synchronised_slave_pids",
    "state",
    "type",
    "leader",
    "members",
    "online",
    "mirror_pids",
    "synchronised_mirror_pids",
    "node",
];

/// A mirror's stand-in pid: `<node.queue-id>`.
fn mirror_pids(q: &Value, key: &str) -> Value {
    let uid = q
        .get("pid")
        .and_then(Value::as_str)
        .and_then(|p| p.trim_end_matches('>').rsplit('.').next())
        .unwrap_or("0")
        .to_owned();
    Value::Array(
        q.get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|n| Value::String(format!("<{n}.{uid}>")))
            .collect(),
    )
}

fn queue_item(q: &Value, k: &str) -> Value {
    match k {
        "slave_pids" | "mirror_pids" => mirror_pids(q, "slave_nodes"),
        "synchronised_slave_pids" | "synchronised_mirror_pids" => {
            mirror_pids(q, "synchronised_slave_nodes")
        }
        "leader" => field(q, "node"),
        "members" => {
            let mut m = vec![field(q, "node")];
            m.extend(
                q.get("slave_nodes")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
            );
            Value::Array(m)
        }
        "online" => Value::Array(vec![field(q, "node")]),
        "messages_ready_ram" => field(q, "messages_ready"),
        "messages_unacknowledged_ram" => field(q, "messages_unacknowledged"),
        "messages_ram" => field(q, "messages"),
        "message_bytes_ram" => field(q, "message_bytes"),
        "messages_persistent"
        | "message_bytes_persistent"
        | "disk_reads"
        | "disk_writes"
        | "memory" => json!(0),
        "state" => match q.get("sync_messages") {
            Some(n) => Value::String(format!("{{syncing, {n}}}")),
            None => field(q, "state"),
        },
        "exclusive_consumer_pid" | "exclusive_consumer_tag" | "head_message_timestamp" => {
            field(q, k)
        }
        _ => field(q, k),
    }
}

fn vpath(cli: &Cli) -> String {
    enc(&cli.vhost)
}

fn read_input(path: &str) -> Res<String> {
    if path == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| Failure::new(EX_SOFTWARE, format!("reading standard input: {e}")))?;
        Ok(s)
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| Failure::new(EX_DATAERR, format!("cannot read {path}: {e}")))
    }
}

/// The cluster's members and running members from `/api/cluster`, or
/// `None` if the node does not have that route.
fn cluster_members(c: &Client) -> Res<Option<(Vec<String>, Vec<String>)>> {
    let (status, v) = c.send("GET", "/api/cluster", None)?;
    if status != 200 {
        return Ok(None);
    }
    let names = |k: &str| -> Vec<String> {
        v.get(k)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect()
    };
    Ok(Some((names("disk_nodes"), names("running_nodes"))))
}

/// Whether the node runs as a cluster member (started with `--peer-addr`).
fn clustered(c: &Client) -> Res<bool> {
    let (status, v) = c.send("GET", "/api/cluster", None)?;
    Ok(status == 200 && is_clustered(&v))
}

/// Whether `GET /api/cluster`'s answer `v` is a cluster member's.
fn is_clustered(v: &Value) -> bool {
    let with_addr = v
        .get("members")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|m| {
            ["addr", "peer_addr"].iter().any(|k| {
                m.get(*k)
                    .and_then(Value::as_str)
                    .is_some_and(|a| !a.is_empty())
            })
        });
    v.get("clustered")
        .and_then(Value::as_bool)
        .unwrap_or(with_addr)
}

/// `join_cluster SEED`, RabbitMQ's workflow (`stop_app`, `join_cluster`,
/// `start_app`): the node refuses while its app runs, checks that the seed
/// (a member's peer address `HOST:PORT`) answers the cluster handshake, and
/// unless it is already a member, resets itself (its own metadata and
/// messages are discarded) and restarts to join. This waits (up to
/// `--timeout`) until the node answers again as a running member of the
/// seed's cluster, its app stopped.
fn join_cluster(c: &Client, cli: &Cli, seed: &str) -> Res<()> {
    let out = Out { cli };
    let (status, info) = c.send("GET", "/api/cluster", None)?;
    let me = cell(&field(&info, "node"));
    if status != 200 || !is_clustered(&info) {
        return Err(Failure::new(
            EX_UNAVAILABLE,
            format!(
                "node {me} ({}) runs alone (started without --peer-addr) and cannot join a \
                 cluster: restart it with --peer-addr and the cluster's --cluster-secret-file, \
                 then run join_cluster",
                cli.node
            ),
        ));
    }
    out.info(&format!("Clustering node {me} with {seed}"));
    let v = c.call("POST", "/api/cluster/join", Some(&json!({ "node": seed })))?;
    if field(&v, "already_member") == Value::Bool(true) {
        out.info(&format!(
            "The node {me} is already a member of this cluster: nothing changed"
        ));
        return Ok(());
    }
    let seed_node = cell(&field(&v, "seed_node"));
    out.info(&format!(
        "Node {me} was reset to join the cluster of {seed_node}: its own metadata and \
         messages were discarded; it restarts and takes the cluster's"
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(cli.timeout.max(1));
    loop {
        // Before the restart the node does not count the seed as a member;
        // during it, it does not answer.
        if let Ok((200, st)) = c.send("GET", "/api/cluster", None) {
            let running = field(&st, "running_nodes");
            let up = |n: &str| running.as_array().is_some_and(|a| a.iter().any(|x| x == n));
            if up(&me) && up(&seed_node) {
                break;
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(Failure::new(
                EX_SOFTWARE,
                format!(
                    "node {me} is not a running member of the cluster of {seed_node} {}s after \
                     it restarted to join it (it keeps trying for its --boot-wait; see its log)",
                    cli.timeout
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    out.info(&format!(
        "Node {me} is now a member of the cluster of {seed_node}; its app is stopped: start it \
         with start_app"
    ));
    Ok(())
}

/// Posts a queue action (`sync`, `cancel_sync`) to the management API.
fn queue_action(c: &Client, vh: &str, queue: &str, action: &str) -> Res<()> {
    c.call(
        "POST",
        &format!("/api/queues/{vh}/{}/actions", enc(queue)),
        Some(&json!({ "action": action })),
    )?;
    Ok(())
}

/// `forget_cluster_node --offline`: rewrites a stopped node's membership so
/// it can start without `node_name` (seed scenario 4).
fn forget_offline(out: &Out<'_>, node_name: &str, dir: &std::path::Path, me: &str) -> Res<()> {
    let name =
        |n: &str| warren_wire::NodeName::new(n).map_err(|e| Failure::new(EX_USAGE, e.to_string()));
    let (me, forget) = (name(me)?, name(node_name)?);
    out.info(&format!(
        "Removing node {forget} from the cluster held in {} (the stopped node {me}); \
         this is unsafe unless {forget} is gone for good",
        dir.display()
    ));
    let report = warren_cluster::offline::forget_cluster_node_offline(dir, &me, &[forget])
        .map_err(|e| Failure::new(EX_DATAERR, format!("forget_cluster_node --offline: {e}")))?;
    out.info(&format!(
        "Done: voters now {}; start {me} and it serves alone",
        report.voters.join(", ")
    ));
    Ok(())
}

fn not_supported(verb: &str, node: &str) -> Failure {
    Failure::new(
        EX_UNAVAILABLE,
        format!(
            "{verb} is not supported by this node yet ({node}): Warren nodes do not expose it over the management API"
        ),
    )
}

/// `stop`, `stop_app` and `start_app`: `POST /api/nodes/{node}/{verb}`;
/// `stop` then waits until the node no longer answers.
fn app_verb(c: &Client, cli: &Cli, verb: &str) -> Res<()> {
    let o = c.get("/api/overview")?;
    let node = cell(&field(&o, "node"));
    let out = Out { cli };
    out.info(&match verb {
        "stop" => format!("Stopping and halting node {node} ..."),
        "stop_app" => format!("Stopping rabbit application on node {node} ..."),
        _ => format!("Starting node {node} ..."),
    });
    c.call("POST", &format!("/api/nodes/{}/{verb}", enc(&node)), None)?;
    if verb != "stop" {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(cli.timeout.max(1));
    while std::time::Instant::now() < deadline {
        if c.send("GET", "/api/overview", None).is_err() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(Failure::new(
        EX_SOFTWARE,
        format!("node {node} still answers {}s after stop", cli.timeout),
    ))
}

/// `set_vm_memory_high_watermark` and `set_disk_free_limit`: `PUT
/// /api/nodes/{node}/memory_high_watermark` or `…/disk_free_limit`; the
/// node checks the values.
fn set_limit(c: &Client, cli: &Cli, which: &str, limit: &[String]) -> Res<()> {
    let usage = |text: &str| Failure::new(EX_USAGE, text.to_owned());
    let number = |v: &str| -> Res<Value> {
        v.parse::<f64>()
            .ok()
            .and_then(|x| serde_json::Number::from_f64(x).map(Value::Number))
            .ok_or_else(|| usage(&format!("{v:?} is not a number")))
    };
    let (path, body, what) = match (which, limit) {
        ("memory", [f]) => (
            "memory_high_watermark",
            json!({"relative": number(f)?}),
            format!("fraction {f}"),
        ),
        ("memory", [k, v]) if k == "absolute" => {
            ("memory_high_watermark", json!({"absolute": v}), v.clone())
        }
        ("memory", _) => {
            return Err(usage(
                "usage: set_vm_memory_high_watermark <fraction> | absolute <size>",
            ));
        }
        ("disk", [v]) => ("disk_free_limit", json!({"absolute": v}), v.clone()),
        ("disk", [k, f]) if k == "mem_relative" => (
            "disk_free_limit",
            json!({"mem_relative": number(f)?}),
            format!("{f} × memory"),
        ),
        _ => {
            return Err(usage(
                "usage: set_disk_free_limit <size> | mem_relative <multiple>",
            ));
        }
    };
    let o = c.get("/api/overview")?;
    let node = cell(&field(&o, "node"));
    let out = Out { cli };
    out.info(&match which {
        "memory" => format!("Setting memory threshold on {node} to {what} ..."),
        _ => format!("Setting disk free limit on {node} to {what} ..."),
    });
    c.call(
        "PUT",
        &format!("/api/nodes/{}/{path}", enc(&node)),
        Some(&body),
    )?;
    Ok(())
}

fn set_policy(c: &Client, cli: &Cli, a: &PolicyArgs, operator: bool) -> Res<()> {
    let definition: Value = serde_json::from_str(&a.definition).map_err(|e| {
        Failure::new(
            EX_DATAERR,
            format!(
                "Validation failed\n\n'{}' is not a valid JSON definition: {e}",
                a.definition
            ),
        )
    })?;
    let kind = if operator {
        "operator policy"
    } else {
        "policy"
    };
    let root = if operator {
        "operator-policies"
    } else {
        "policies"
    };
    let out = Out { cli };
    out.info(&format!(
        "Setting {kind} \"{}\" for pattern \"{}\" to \"{}\" with priority \"{}\" for vhost \"{}\" ...",
        a.name, a.pattern, a.definition, a.priority, cli.vhost
    ));
    let body = json!({
        "pattern": a.pattern,
        "definition": definition,
        "priority": a.priority,
        "apply-to": a.apply_to,
    });
    c.call(
        "PUT",
        &format!("/api/{root}/{}/{}", vpath(cli), enc(&a.name)),
        Some(&body),
    )
    .map_err(|f| {
        if f.code == EX_DATAERR {
            Failure::new(f.code, format!("Validation failed\n\n{}", f.message))
        } else {
            f
        }
    })?;
    Ok(())
}

fn list_policies(c: &Client, cli: &Cli, operator: bool) -> Res<()> {
    let root = if operator {
        "operator-policies"
    } else {
        "policies"
    };
    let kind = if operator {
        "operator policies"
    } else {
        "policies"
    };
    let out = Out { cli };
    out.info(&format!("Listing {kind} for vhost \"{}\" ...", cli.vhost));
    let ps = list(c.get(&format!("/api/{root}/{}", vpath(cli)))?);
    let cols = [
        "vhost",
        "name",
        "pattern",
        "apply-to",
        "definition",
        "priority",
    ];
    let (columns, rows) = select(&ps, &[], &cols, &cols, |o, k| match k {
        "definition" if cli.formatter == Formatter::Table => Value::String(field(o, k).to_string()),
        _ => field(o, k),
    })?;
    out.table(&columns, &rows);
    Ok(())
}

/// Whether the answering node (first of `/api/nodes`) accepts AMQP clients.
fn app_running(nodes: &[Value]) -> bool {
    nodes
        .first()
        .and_then(|n| n.get("app_running"))
        .and_then(Value::as_bool)
        .unwrap_or(true)
}

/// The resource alarms `/api/nodes` reports, in rabbitmqctl's words.
fn alarm_lines(nodes: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for n in nodes {
        let name = cell(&field(n, "name"));
        if n.get("mem_alarm").and_then(Value::as_bool) == Some(true) {
            out.push(format!("Memory alarm on node {name}"));
        }
        if n.get("disk_free_alarm").and_then(Value::as_bool) == Some(true) {
            out.push(format!("Free disk space alarm on node {name}"));
        }
    }
    out
}

/// The "Alarms" section of `status` and `cluster_status`.
fn push_alarms(s: &mut String, alarms: &[String]) {
    s.push_str("\nAlarms\n\n");
    if alarms.is_empty() {
        s.push_str("(none)\n");
    }
    for a in alarms {
        s.push_str(&format!("{a}\n"));
    }
}

fn status(c: &Client, cli: &Cli, cluster: bool) -> Res<()> {
    let o = c.get("/api/overview")?;
    let nodes = list(c.get("/api/nodes")?);
    let members = cluster_members(c)?;
    let node = o
        .get("node")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_owned();
    if cli.formatter == Formatter::Json {
        let v = if cluster {
            let (names, running) = members.clone().unwrap_or_else(|| {
                let names: Vec<String> = nodes.iter().map(|n| cell(&field(n, "name"))).collect();
                (names.clone(), names)
            });
            json!({
                "cluster_name": field(&o, "cluster_name"),
                "disk_nodes": names,
                "running_nodes": running,
                "alarms": alarm_lines(&nodes),
                "partitions": {},
                "listeners": field(&o, "listeners"),
                "versions": {node.clone(): {"warren_version": field(&o, "product_version"), "rabbitmq_version": field(&o, "rabbitmq_version")}},
            })
        } else {
            json!({
                "node": node,
                "product_name": field(&o, "product_name"),
                "product_version": field(&o, "product_version"),
                "rabbitmq_version": field(&o, "rabbitmq_version"),
                "listeners": field(&o, "listeners"),
                "object_totals": field(&o, "object_totals"),
                "queue_totals": field(&o, "queue_totals"),
                "app_running": app_running(&nodes),
                "nodes": nodes,
            })
        };
        println!("{v}");
        return Ok(());
    }
    let listeners: Vec<String> = o
        .get("listeners")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|l| {
            let proto = l.get("protocol").and_then(Value::as_str).unwrap_or("");
            let purpose = match proto {
                "amqp" => "AMQP 0-9-1",
                "amqp/ssl" => "AMQP 0-9-1 over TLS",
                "http" => "HTTP API",
                "http/prometheus" => "Prometheus exporter API over HTTP",
                "clustering" => "inter-node communication",
                _ => "",
            };
            format!(
                "Node: {}, interface: {}, port: {}, protocol: {proto}, purpose: {purpose}",
                cell(&field(l, "node")),
                cell(&field(l, "ip_address")),
                cell(&field(l, "port")),
            )
        })
        .collect();
    let mut s = String::new();
    if cluster {
        let (names, running) = members.unwrap_or_else(|| {
            let names: Vec<String> = nodes.iter().map(|n| cell(&field(n, "name"))).collect();
            (names.clone(), names)
        });
        s.push_str(&format!(
            "Cluster status of node {node} ...\nBasics\n\nCluster name: {}\n",
            cell(&field(&o, "cluster_name"))
        ));
        s.push_str("\nDisk Nodes\n\n");
        for n in &names {
            s.push_str(&format!("{n}\n"));
        }
        s.push_str("\nRunning Nodes\n\n");
        for n in &running {
            s.push_str(&format!("{n}\n"));
        }
        s.push_str(&format!(
            "\nVersions\n\n{node}: Warren {} (RabbitMQ {} compatible)\n",
            cell(&field(&o, "product_version")),
            cell(&field(&o, "rabbitmq_version"))
        ));
        s.push_str("\nMaintenance status\n\n");
        for n in &names {
            s.push_str(&format!("Node: {n}, status: not under maintenance\n"));
        }
        push_alarms(&mut s, &alarm_lines(&nodes));
        s.push_str("\nNetwork Partitions\n\n(none)\n\nListeners\n\n");
        for l in &listeners {
            s.push_str(&format!("{l}\n"));
        }
        s.push_str("\nFeature flags\n\n(none)\n");
    } else {
        let n = nodes.first().cloned().unwrap_or(Value::Null);
        let totals = field(&o, "queue_totals");
        let objects = field(&o, "object_totals");
        s.push_str(&format!("Status of node {node} ...\nRuntime\n\n"));
        s.push_str(&format!("OS PID: {}\n", cell(&field(&n, "os_pid"))));
        s.push_str(&format!(
            "Product name: {}\n",
            cell(&field(&o, "product_name"))
        ));
        s.push_str(&format!(
            "Product version: {}\n",
            cell(&field(&o, "product_version"))
        ));
        s.push_str(&format!(
            "RabbitMQ version: {}\n",
            cell(&field(&o, "rabbitmq_version"))
        ));
        let uptime = n.get("uptime").and_then(Value::as_u64).unwrap_or(0) / 1000;
        s.push_str(&format!("Uptime (seconds): {uptime}\n"));
        s.push_str(if app_running(&nodes) {
            "Application: running\n"
        } else {
            "Application: stopped (start_app starts it)\n"
        });
        s.push_str(&format!(
            "\nMemory\n\nTotal memory used: {} bytes\nMemory high watermark: {} bytes\n",
            cell(&field(&n, "mem_used")),
            cell(&field(&n, "mem_limit"))
        ));
        s.push_str(&format!(
            "\nFree Disk Space\n\nLow free disk space watermark: {} bytes\nFree disk space: {} bytes\n",
            cell(&field(&n, "disk_free_limit")),
            cell(&field(&n, "disk_free"))
        ));
        // What the node could not read is not in its answer: not shown.
        let known = |k: &str| n.get(k).map(cell);
        s.push_str("\nFile Descriptors\n\n");
        if let Some(used) = known("fd_used") {
            s.push_str(&format!("Total: {used}"));
            if let Some(limit) = known("fd_total") {
                s.push_str(&format!(", limit: {limit}"));
            }
            s.push('\n');
        }
        if let Some(sockets) = known("sockets_used") {
            s.push_str(&format!("Sockets: {sockets}"));
            if let Some(limit) = known("sockets_total") {
                s.push_str(&format!(", limit: {limit}"));
            }
            s.push('\n');
        }
        if let Some(tasks) = known("proc_used") {
            s.push_str(&format!(
                "\nTasks\n\nTotal: {tasks} (tokio tasks of the node's main runtime)\n"
            ));
        }
        push_alarms(&mut s, &alarm_lines(&nodes[..nodes.len().min(1)]));
        s.push_str("\nTotals\n\n");
        for k in [
            "connections",
            "channels",
            "queues",
            "exchanges",
            "consumers",
        ] {
            s.push_str(&format!("{k}: {}\n", cell(&field(&objects, k))));
        }
        for k in ["messages", "messages_ready", "messages_unacknowledged"] {
            s.push_str(&format!("{k}: {}\n", cell(&field(&totals, k))));
        }
        s.push_str("\nListeners\n\n");
        for l in &listeners {
            s.push_str(&format!("{l}\n"));
        }
    }
    print!("{s}");
    Ok(())
}

fn run(cli: &Cli) -> Res<()> {
    let c = Client::new(cli);
    let out = Out { cli };
    let vh = vpath(cli);
    match &cli.cmd {
        Cmd::Status => status(&c, cli, false),
        Cmd::ClusterStatus => status(&c, cli, true),
        Cmd::JoinCluster { seed, .. } => join_cluster(&c, cli, seed),
        Cmd::ForgetClusterNode {
            node_name,
            offline: true,
            data_dir: Some(dir),
            local_node: Some(me),
        } => forget_offline(&out, node_name, dir, me),
        Cmd::ForgetClusterNode { node_name, .. } => {
            if !clustered(&c)? {
                return Err(not_supported("forget_cluster_node", &cli.node));
            }
            out.info(&format!("Removing node {node_name} from the cluster"));
            c.call(
                "DELETE",
                &format!("/api/cluster/nodes/{}", enc(node_name)),
                None,
            )?;
            Ok(())
        }
        Cmd::Stop => app_verb(&c, cli, "stop"),
        Cmd::StopApp => app_verb(&c, cli, "stop_app"),
        Cmd::StartApp => app_verb(&c, cli, "start_app"),
        Cmd::SetVmMemoryHighWatermark { limit } => set_limit(&c, cli, "memory", limit),
        Cmd::SetDiskFreeLimit { limit } => set_limit(&c, cli, "disk", limit),
        Cmd::AddVhost { name } => {
            out.info(&format!("Adding vhost \"{name}\" ..."));
            c.call(
                "PUT",
                &format!("/api/vhosts/{}", enc(name)),
                Some(&json!({})),
            )?;
            Ok(())
        }
        Cmd::DeleteVhost { name } => {
            out.info(&format!("Deleting vhost \"{name}\" ..."));
            c.call("DELETE", &format!("/api/vhosts/{}", enc(name)), None)?;
            Ok(())
        }
        Cmd::ListVhosts { items } => {
            out.info("Listing vhosts ...");
            let vs = list(c.get("/api/vhosts")?);
            let valid = [
                "name",
                "description",
                "tags",
                "tracing",
                "cluster_state",
                "default_queue_type",
                "messages",
                "messages_ready",
                "messages_unacknowledged",
            ];
            let (cols, rows) = select(&vs, items, &["name"], &valid, field)?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::AddUser { user, password } => {
            out.info(&format!("Adding user \"{user}\" ..."));
            let (status, _) = c.send("GET", &format!("/api/users/{}", enc(user)), None)?;
            if status == 200 {
                return Err(Failure::new(
                    EX_DATAERR,
                    format!("User \"{user}\" already exists"),
                ));
            }
            c.call(
                "PUT",
                &format!("/api/users/{}", enc(user)),
                Some(&json!({"password": password, "tags": ""})),
            )?;
            Ok(())
        }
        Cmd::DeleteUser { user } => {
            out.info(&format!("Deleting user \"{user}\" ..."));
            c.call("DELETE", &format!("/api/users/{}", enc(user)), None)?;
            Ok(())
        }
        Cmd::ChangePassword { user, password } => {
            out.info(&format!("Changing password for user \"{user}\" ..."));
            c.get(&format!("/api/users/{}", enc(user)))?;
            c.call(
                "PUT",
                &format!("/api/users/{}", enc(user)),
                Some(&json!({"password": password})),
            )?;
            Ok(())
        }
        Cmd::SetUserTags { user, tags } => {
            out.info(&format!(
                "Setting tags for user \"{user}\" to [{}] ...",
                tags.join(", ")
            ));
            c.get(&format!("/api/users/{}", enc(user)))?;
            c.call(
                "PUT",
                &format!("/api/users/{}", enc(user)),
                Some(&json!({"tags": tags})),
            )?;
            Ok(())
        }
        Cmd::ListUsers => {
            out.info("Listing users ...");
            let us = list(c.get("/api/users")?);
            let cols = ["user", "tags"];
            let (cols, rows) = select(&us, &[], &cols, &cols, |o, k| match k {
                "user" => field(o, "name"),
                _ => field(o, k),
            })?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::SetPermissions {
            user,
            conf,
            write,
            read,
        } => {
            out.info(&format!(
                "Setting permissions for user \"{user}\" in vhost \"{}\" ...",
                cli.vhost
            ));
            c.call(
                "PUT",
                &format!("/api/permissions/{vh}/{}", enc(user)),
                Some(&json!({"configure": conf, "write": write, "read": read})),
            )?;
            Ok(())
        }
        Cmd::ClearPermissions { user } => {
            out.info(&format!(
                "Clearing permissions for user \"{user}\" in vhost \"{}\" ...",
                cli.vhost
            ));
            c.call(
                "DELETE",
                &format!("/api/permissions/{vh}/{}", enc(user)),
                None,
            )?;
            Ok(())
        }
        Cmd::ListPermissions => {
            out.info(&format!(
                "Listing permissions for vhost \"{}\" ...",
                cli.vhost
            ));
            let ps: Vec<Value> = list(c.get("/api/permissions")?)
                .into_iter()
                .filter(|p| p.get("vhost").and_then(Value::as_str) == Some(cli.vhost.as_str()))
                .collect();
            let cols = ["user", "configure", "write", "read"];
            let (cols, rows) = select(&ps, &[], &cols, &cols, field)?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::ListUserPermissions { user } => {
            out.info(&format!("Listing permissions for user \"{user}\" ..."));
            let ps: Vec<Value> = list(c.get("/api/permissions")?)
                .into_iter()
                .filter(|p| p.get("user").and_then(Value::as_str) == Some(user.as_str()))
                .collect();
            let cols = ["vhost", "configure", "write", "read"];
            let (cols, rows) = select(&ps, &[], &cols, &cols, field)?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::SetPolicy(a) => set_policy(&c, cli, a, false),
        Cmd::SetOperatorPolicy(a) => set_policy(&c, cli, a, true),
        Cmd::ClearPolicy { name } => {
            out.info(&format!(
                "Clearing policy \"{name}\" on vhost \"{}\" ...",
                cli.vhost
            ));
            c.call("DELETE", &format!("/api/policies/{vh}/{}", enc(name)), None)?;
            Ok(())
        }
        Cmd::ClearOperatorPolicy { name } => {
            out.info(&format!(
                "Clearing operator policy \"{name}\" on vhost \"{}\" ...",
                cli.vhost
            ));
            c.call(
                "DELETE",
                &format!("/api/operator-policies/{vh}/{}", enc(name)),
                None,
            )?;
            Ok(())
        }
        Cmd::ListPolicies => list_policies(&c, cli, false),
        Cmd::ListOperatorPolicies => list_policies(&c, cli, true),
        Cmd::ListQueues { items, local, .. } => {
            out.info(&format!("Listing queues for vhost {} ...", cli.vhost));
            let mut qs = list(c.get(&format!("/api/queues/{vh}"))?);
            if *local {
                let node = c.get("/api/overview")?;
                let me = field(&node, "node");
                qs.retain(|q| field(q, "node") == me);
            }
            let (cols, rows) = select(&qs, items, &["name", "messages"], QUEUE_KEYS, queue_item)?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::ListExchanges { items } => {
            out.info(&format!("Listing exchanges for vhost {} ...", cli.vhost));
            let xs = list(c.get(&format!("/api/exchanges/{vh}"))?);
            let valid = [
                "name",
                "type",
                "durable",
                "auto_delete",
                "internal",
                "arguments",
                "policy",
            ];
            let (cols, rows) = select(&xs, items, &["name", "type"], &valid, field)?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::ListBindings { items } => {
            out.info(&format!("Listing bindings for vhost {}...", cli.vhost));
            let bs = list(c.get(&format!("/api/bindings/{vh}"))?);
            let valid = [
                "source_name",
                "source_kind",
                "destination_name",
                "destination_kind",
                "routing_key",
                "arguments",
            ];
            let (cols, rows) = select(&bs, items, &valid, &valid, |o, k| match k {
                "source_name" => field(o, "source"),
                "source_kind" => json!("exchange"),
                "destination_name" => field(o, "destination"),
                "destination_kind" => field(o, "destination_type"),
                _ => field(o, k),
            })?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::ListConnections { items } => {
            out.info("Listing connections ...");
            let cs = list(c.get("/api/connections")?);
            let valid = [
                "name",
                "node",
                "user",
                "vhost",
                "peer_host",
                "peer_port",
                "state",
                "channels",
                "protocol",
                "ssl",
                "auth_mechanism",
                "type",
            ];
            let (cols, rows) = select(
                &cs,
                items,
                &["user", "peer_host", "peer_port", "state"],
                &valid,
                field,
            )?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::CloseConnection {
            connection,
            explanation,
        } => {
            out.info(&format!(
                "Closing connection {connection}, reason: {explanation}..."
            ));
            c.call_with(
                "DELETE",
                &format!("/api/connections/{}", enc(connection)),
                None,
                Some(explanation),
            )?;
            Ok(())
        }
        Cmd::ListConsumers { items } => {
            out.info(&format!("Listing consumers in vhost {} ...", cli.vhost));
            let cs = list(c.get(&format!("/api/consumers/{vh}"))?);
            let valid = [
                "queue_name",
                "channel_pid",
                "consumer_tag",
                "ack_required",
                "prefetch_count",
                "active",
                "activity_status",
                "arguments",
                "exclusive",
            ];
            let default = [
                "queue_name",
                "channel_pid",
                "consumer_tag",
                "ack_required",
                "prefetch_count",
                "active",
                "arguments",
            ];
            let (cols, rows) = select(&cs, items, &default, &valid, |o, k| match k {
                "queue_name" => o.get("queue").map_or(Value::Null, |q| field(q, "name")),
                "channel_pid" => o
                    .get("channel_details")
                    .map_or(Value::Null, |c| field(c, "name")),
                _ => field(o, k),
            })?;
            out.table(&cols, &rows);
            Ok(())
        }
        Cmd::SyncQueue { queue } => {
            out.info(&format!(
                "Synchronising queue '{queue}' in vhost '{}' ...",
                cli.vhost
            ));
            queue_action(&c, &vh, queue, "sync")
        }
        Cmd::QueueDigest { queue } => {
            let q = c.get(&format!("/api/queues/{vh}/{}?digest=true", enc(queue)))?;
            let node = q["node"].as_str().unwrap_or("?");
            let digest = q["local_digest"].as_str().unwrap_or("none (no copy here)");
            out.info(&format!(
                "Digest of this node's copy of queue '{queue}' in vhost '{}' (master on {node}) ...",
                cli.vhost
            ));
            out.table(&["digest".to_owned()], &[vec![json!(digest)]]);
            Ok(())
        }
        Cmd::CancelSyncQueue { queue } => {
            out.info(&format!(
                "Stopping synchronising queue '{queue}' in vhost '{}' ...",
                cli.vhost
            ));
            queue_action(&c, &vh, queue, "cancel_sync")
        }
        Cmd::PurgeQueue { queue } => {
            out.info(&format!(
                "Purging queue '{queue}' in vhost '{}' ...",
                cli.vhost
            ));
            c.call(
                "DELETE",
                &format!("/api/queues/{vh}/{}/contents", enc(queue)),
                None,
            )?;
            Ok(())
        }
        Cmd::DeleteQueue {
            queue,
            if_empty,
            if_unused,
        } => {
            out.info(&format!(
                "Deleting queue '{queue}' on vhost '{}' ...",
                cli.vhost
            ));
            let q = c.get(&format!("/api/queues/{vh}/{}", enc(queue)))?;
            let mut path = format!("/api/queues/{vh}/{}", enc(queue));
            let mut sep = '?';
            if *if_empty {
                path.push_str("?if-empty=true");
                sep = '&';
            }
            if *if_unused {
                path.push(sep);
                path.push_str("if-unused=true");
            }
            c.call("DELETE", &path, None)?;
            let n = q.get("messages_ready").and_then(Value::as_u64).unwrap_or(0);
            out.info(&format!(
                "Queue was successfully deleted with {n} ready messages"
            ));
            Ok(())
        }
        Cmd::ExportDefinitions { path } => {
            let d = c.get("/api/definitions")?;
            let text = serde_json::to_string_pretty(&d)
                .map_err(|e| Failure::new(EX_SOFTWARE, e.to_string()))?;
            if path == "-" {
                println!("{text}");
            } else {
                out.info(&format!(
                    "Exporting definitions in JSON to a file at \"{path}\" ..."
                ));
                std::fs::write(path, text)
                    .map_err(|e| Failure::new(EX_SOFTWARE, format!("cannot write {path}: {e}")))?;
            }
            Ok(())
        }
        Cmd::ImportDefinitions { path } => {
            out.info(&format!(
                "Importing definitions in JSON from a file at \"{path}\" ..."
            ));
            let text = read_input(path)?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Failure::new(EX_DATAERR, format!("{path} is not valid JSON: {e}")))?;
            c.call("POST", "/api/definitions", Some(&v))?;
            out.info("Successfully started definition import. This process is asynchronous and can take some time.");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EX_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if cli.formatter == Formatter::Json {
                eprintln!("{}", json!({"result": "error", "message": f.message}));
            } else {
                eprintln!("Error:\n{}", f.message);
            }
            ExitCode::from(f.code)
        }
    }
}
