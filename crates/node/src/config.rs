//! `warren.conf`: RabbitMQ's `rabbitmq.conf` format (one `key = value` per
//! line, `#` comment lines) with RabbitMQ's key names where they exist, and
//! the `WARREN_*` environment variables.
//!
//! Precedence: a command-line flag beats the environment, which beats the
//! file, which beats the flag's default. An unknown key or a bad value stops
//! start-up with `FILE:LINE: reason`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use clap::ArgMatches;
use clap::parser::ValueSource;
use warren_broker::auth::{PermissionDef, UserDef, hash_password};
use warren_broker::{Broker, DiskLimit, MemoryLimit, parse_size};

use crate::Args;
use crate::cluster::{PeerTls, PeerTransport};

/// The environment variable naming the configuration file (`--config` wins).
pub(crate) const CONFIG_FILE_VAR: &str = "WARREN_CONFIG_FILE";

/// The environment variables read, and the `warren.conf` key each stands for.
pub(crate) const ENV_KEYS: &[(&str, &str)] = &[
    ("WARREN_NODENAME", "nodename"),
    ("WARREN_DATA_DIR", "data_dir"),
    ("WARREN_AMQP_ADDR", "listeners.tcp.default"),
    (
        "WARREN_HTTP_ADDR",
        "management.tcp.ip + management.tcp.port",
    ),
    (
        "WARREN_PROMETHEUS_ADDR",
        "prometheus.tcp.ip + prometheus.tcp.port",
    ),
    ("WARREN_LOAD_DEFINITIONS", "load_definitions"),
    ("WARREN_PEER_ADDR", "cluster.peer_addr"),
    ("WARREN_JOIN", "cluster_formation.classic_config.nodes.1"),
    ("WARREN_TRANSPORT", "cluster.transport"),
    ("WARREN_PEER_TLS", "cluster.peer_tls"),
    ("WARREN_CLUSTER_SECRET_FILE", "cluster.secret_file"),
    ("WARREN_CLUSTER_CA_DIR", "cluster.ca_dir"),
    ("WARREN_BOOT_WAIT", "cluster.boot_wait"),
    ("WARREN_NET_TICKTIME", "net_ticktime"),
    ("WARREN_CONSUMER_TIMEOUT", "consumer_timeout"),
    ("WARREN_DEFAULT_USER", "default_user"),
    ("WARREN_DEFAULT_PASS", "default_pass"),
    ("WARREN_LOG_LEVEL", "log.console.level"),
    (
        "WARREN_COLLECT_STATISTICS_INTERVAL",
        "collect_statistics_interval",
    ),
    ("WARREN_PRODUCT_NAME", "product.name"),
    ("WARREN_PRODUCT_VERSION", "product.version"),
];

/// A refused configuration: where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConfigError {
    /// The file (as given) or the environment variable.
    pub source: String,
    /// The 1-based line, for a file.
    pub line: Option<usize>,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.source, self.reason),
            None => write!(f, "{}: {}", self.source, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The AMQPS listener and its certificate files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Tls {
    /// `listeners.ssl.default`.
    pub listener: Option<SocketAddr>,
    /// `ssl_options.certfile`.
    pub certfile: Option<PathBuf>,
    /// `ssl_options.keyfile`.
    pub keyfile: Option<PathBuf>,
    /// `ssl_options.cacertfile`.
    pub cacertfile: Option<PathBuf>,
}

/// Everything `warren.conf` or the environment may set; `None` is "not set".
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Settings {
    /// `listeners.tcp.default`.
    pub amqp_addr: Option<SocketAddr>,
    /// `management.tcp.ip`.
    pub http_ip: Option<IpAddr>,
    /// `management.tcp.port`.
    pub http_port: Option<u16>,
    /// `prometheus.tcp.ip`.
    pub prometheus_ip: Option<IpAddr>,
    /// `prometheus.tcp.port`.
    pub prometheus_port: Option<u16>,
    /// `nodename`.
    pub node_name: Option<String>,
    /// `data_dir`.
    pub data_dir: Option<PathBuf>,
    /// `load_definitions`.
    pub definitions: Option<PathBuf>,
    /// `cluster_formation.classic_config.nodes.N`, by N.
    pub seeds: Vec<(u32, String)>,
    /// `cluster.peer_addr`.
    pub peer_addr: Option<String>,
    /// `cluster.secret_file`.
    pub secret_file: Option<PathBuf>,
    /// `cluster.transport`.
    pub transport: Option<PeerTransport>,
    /// `cluster.peer_tls`.
    pub peer_tls: Option<PeerTls>,
    /// `cluster.ca_dir`.
    pub ca_dir: Option<PathBuf>,
    /// `cluster.boot_wait`, seconds.
    pub boot_wait: Option<u64>,
    /// `net_ticktime`, seconds: a silent member is down after it.
    pub net_ticktime: Option<u64>,
    /// `consumer_timeout`, milliseconds: a channel holding a delivery
    /// unacknowledged for longer is closed (RabbitMQ's; default 30 min).
    pub consumer_timeout_ms: Option<u64>,
    /// `product.name`: the product clients see in the server properties
    /// and operators in the API (RabbitMQ's override; default Warren).
    pub product_name: Option<String>,
    /// `product.version`: its version (default Warren's).
    pub product_version: Option<String>,
    /// `vm_memory_high_watermark.relative` / `.absolute`.
    pub memory_high_watermark: Option<MemoryLimit>,
    /// `disk_free_limit.relative` / `.absolute`.
    pub disk_free_limit: Option<DiskLimit>,
    /// `default_user`.
    pub default_user: Option<String>,
    /// `default_pass`.
    pub default_pass: Option<String>,
    /// `log.console.level`, as a tracing filter (`error`, `warn`, `info`, `debug`).
    pub log_level: Option<String>,
    /// `collect_statistics_interval`, milliseconds: how often the
    /// management API samples the message rates.
    pub stats_interval_ms: Option<u64>,
    /// `listeners.ssl.default` and `ssl_options.*`.
    pub tls: Tls,
}

fn listener(v: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = v.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    }
    v.parse().map_err(|_| {
        format!("{v:?} is not a port or an IP:PORT address (e.g. 5672 or 127.0.0.1:5672)")
    })
}

fn port(v: &str) -> Result<u16, String> {
    v.parse()
        .map_err(|_| format!("{v:?} is not a port number (0-65535)"))
}

fn ip(v: &str) -> Result<IpAddr, String> {
    v.parse().map_err(|_| format!("{v:?} is not an IP address"))
}

fn host_port(v: &str) -> Result<String, String> {
    match v.rsplit_once(':') {
        Some((host, p)) if !host.is_empty() && p.parse::<u16>().is_ok() => Ok(v.to_owned()),
        _ => Err(format!("{v:?} is not a HOST:PORT address")),
    }
}

fn fraction(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{v:?} is not a non-negative number (e.g. 0.4)")),
    }
}

fn existing_file(v: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(v);
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!("{v:?} is not a readable file"))
    }
}

fn non_empty(v: &str) -> Result<String, String> {
    if v.is_empty() {
        Err("the value is empty".to_owned())
    } else {
        Ok(v.to_owned())
    }
}

impl Settings {
    /// Sets one key from its text; the reason when the key is unknown or
    /// the value bad.
    pub(crate) fn set(&mut self, key: &str, v: &str) -> Result<(), String> {
        match key {
            "listeners.tcp.default" => self.amqp_addr = Some(listener(v)?),
            "management.tcp.port" => self.http_port = Some(port(v)?),
            "management.tcp.ip" => self.http_ip = Some(ip(v)?),
            "prometheus.tcp.port" => self.prometheus_port = Some(port(v)?),
            "prometheus.tcp.ip" => self.prometheus_ip = Some(ip(v)?),
            "nodename" => self.node_name = Some(non_empty(v)?),
            "data_dir" => self.data_dir = Some(PathBuf::from(non_empty(v)?)),
            "load_definitions" => self.definitions = Some(existing_file(v)?),
            "cluster_formation.peer_discovery_backend" => match v {
                "classic_config" | "rabbit_peer_discovery_classic_config" => {}
                _ => return Err(format!("{v:?} is not supported (only classic_config)")),
            },
            "cluster.peer_addr" => self.peer_addr = Some(host_port(v)?),
            "cluster.secret_file" => self.secret_file = Some(existing_file(v)?),
            "cluster.transport" => {
                self.transport = Some(match v {
                    "tcp" => PeerTransport::Tcp,
                    "quic" => PeerTransport::Quic,
                    _ => return Err(format!("{v:?} is not a transport (tcp or quic)")),
                });
            }
            "cluster.peer_tls" => {
                self.peer_tls = Some(match v {
                    "on" => PeerTls::On,
                    "off" => PeerTls::Off,
                    _ => return Err(format!("{v:?} is neither on nor off")),
                });
            }
            "cluster.ca_dir" => self.ca_dir = Some(PathBuf::from(non_empty(v)?)),
            "cluster.boot_wait" => {
                self.boot_wait = Some(
                    v.parse()
                        .map_err(|_| format!("{v:?} is not a number of seconds"))?,
                );
            }
            "net_ticktime" => {
                self.net_ticktime = Some(match v.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("{v:?} is not a positive number of seconds")),
                });
            }
            "consumer_timeout" => {
                self.consumer_timeout_ms = Some(match v.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("{v:?} is not a positive number of milliseconds")),
                });
            }
            "product.name" => self.product_name = Some(non_empty(v)?),
            "product.version" => self.product_version = Some(non_empty(v)?),
            "collect_statistics_interval" => {
                self.stats_interval_ms = Some(match v.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("{v:?} is not a positive number of milliseconds")),
                });
            }
            "vm_memory_high_watermark.relative" => {
                self.memory_high_watermark = Some(MemoryLimit::Relative(fraction(v)?));
            }
            "vm_memory_high_watermark.absolute" => {
                self.memory_high_watermark = Some(MemoryLimit::Absolute(parse_size(v)?));
            }
            "disk_free_limit.relative" => {
                self.disk_free_limit = Some(DiskLimit::Relative(fraction(v)?));
            }
            "disk_free_limit.absolute" => {
                self.disk_free_limit = Some(DiskLimit::Absolute(parse_size(v)?));
            }
            "default_user" => self.default_user = Some(non_empty(v)?),
            "default_pass" => self.default_pass = Some(non_empty(v)?),
            "log.console.level" => {
                self.log_level = Some(
                    match v {
                        "error" => "error",
                        "warning" => "warn",
                        "info" => "info",
                        "debug" => "debug",
                        _ => {
                            return Err(format!(
                                "{v:?} is not a level (error, warning, info or debug)"
                            ));
                        }
                    }
                    .to_owned(),
                );
            }
            "listeners.ssl.default" => self.tls.listener = Some(listener(v)?),
            "ssl_options.certfile" => self.tls.certfile = Some(existing_file(v)?),
            "ssl_options.keyfile" => self.tls.keyfile = Some(existing_file(v)?),
            "ssl_options.cacertfile" => self.tls.cacertfile = Some(existing_file(v)?),
            _ => {
                let Some(n) = key.strip_prefix("cluster_formation.classic_config.nodes.") else {
                    return Err(format!("unknown key {key:?}"));
                };
                let n: u32 = n
                    .parse()
                    .map_err(|_| format!("unknown key {key:?} (nodes are numbered 1, 2, …)"))?;
                let addr = host_port(v)?;
                self.seeds.retain(|(m, _)| *m != n);
                self.seeds.push((n, addr));
                self.seeds.sort_unstable_by_key(|(m, _)| *m);
            }
        }
        Ok(())
    }

    /// Parses a `warren.conf` text; `source` names it in errors.
    pub(crate) fn parse(text: &str, source: &str) -> Result<Self, ConfigError> {
        let mut s = Self::default();
        let mut ssl_line = None;
        for (i, raw) in text.lines().enumerate() {
            let err = |reason: String| ConfigError {
                source: source.to_owned(),
                line: Some(i + 1),
                reason,
            };
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(err(format!("expected KEY = VALUE, got {line:?}")));
            };
            let (key, value) = (key.trim(), value.trim());
            if key == "listeners.ssl.default" {
                ssl_line = Some(i + 1);
            }
            s.set(key, value).map_err(err)?;
        }
        if let Some(line) = ssl_line
            && (s.tls.certfile.is_none() || s.tls.keyfile.is_none())
        {
            return Err(ConfigError {
                source: source.to_owned(),
                line: Some(line),
                reason: "listeners.ssl.default needs ssl_options.certfile and ssl_options.keyfile"
                    .to_owned(),
            });
        }
        Ok(s)
    }

    /// Reads and parses a `warren.conf` file.
    pub(crate) fn read(path: &Path) -> Result<Self, ConfigError> {
        let source = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            source: source.clone(),
            line: None,
            reason: format!("cannot read the configuration file: {e}"),
        })?;
        Self::parse(&text, &source)
    }

    /// The settings of the `WARREN_*` variables ([`ENV_KEYS`]) that `env` has.
    pub(crate) fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut s = Self::default();
        for (var, key) in ENV_KEYS {
            let Some(v) = env(var) else { continue };
            let err = |reason: String| ConfigError {
                source: (*var).to_owned(),
                line: None,
                reason,
            };
            match *var {
                "WARREN_HTTP_ADDR" => {
                    let a = listener(&v).map_err(err)?;
                    (s.http_ip, s.http_port) = (Some(a.ip()), Some(a.port()));
                }
                "WARREN_PROMETHEUS_ADDR" => {
                    let a = listener(&v).map_err(err)?;
                    (s.prometheus_ip, s.prometheus_port) = (Some(a.ip()), Some(a.port()));
                }
                _ => s.set(key, &v).map_err(err)?,
            }
        }
        Ok(s)
    }

    /// On a node's first start: makes `default_user` (default `guest`) with
    /// `default_pass` (default `guest`) the administrator of `/`, in
    /// `guest`'s place. Nothing when neither is set.
    pub(crate) fn apply_default_user(&self, broker: &mut Broker) -> anyhow::Result<()> {
        if self.default_user.is_none() && self.default_pass.is_none() {
            return Ok(());
        }
        let name = self.default_user.as_deref().unwrap_or("guest");
        broker.put_user(UserDef {
            name: name.to_owned(),
            password_hash: hash_password(self.default_pass.as_deref().unwrap_or("guest")),
            tags: vec!["administrator".to_owned()],
            loopback_only: name == "guest",
        })?;
        broker.set_permissions(PermissionDef {
            user: name.to_owned(),
            vhost: "/".to_owned(),
            configure: ".*".to_owned(),
            write: ".*".to_owned(),
            read: ".*".to_owned(),
        })?;
        if name != "guest" {
            broker.delete_user("guest")?;
        }
        tracing::info!(user = name, "created the default user");
        Ok(())
    }

    /// Hands the memory high watermark and the disk free limit to `broker`
    /// (RabbitMQ's defaults where unset).
    pub(crate) fn apply_limits(&self, broker: &mut Broker) {
        broker.set_memory_limit(self.memory_high_watermark.unwrap_or_default());
        broker.set_disk_limit(self.disk_free_limit.unwrap_or_default());
    }

    /// `self`, with what it leaves unset taken from `lower`.
    #[must_use]
    pub(crate) fn over(self, lower: Self) -> Self {
        Self {
            amqp_addr: self.amqp_addr.or(lower.amqp_addr),
            http_ip: self.http_ip.or(lower.http_ip),
            http_port: self.http_port.or(lower.http_port),
            prometheus_ip: self.prometheus_ip.or(lower.prometheus_ip),
            prometheus_port: self.prometheus_port.or(lower.prometheus_port),
            node_name: self.node_name.or(lower.node_name),
            data_dir: self.data_dir.or(lower.data_dir),
            definitions: self.definitions.or(lower.definitions),
            seeds: if self.seeds.is_empty() {
                lower.seeds
            } else {
                self.seeds
            },
            peer_addr: self.peer_addr.or(lower.peer_addr),
            secret_file: self.secret_file.or(lower.secret_file),
            transport: self.transport.or(lower.transport),
            peer_tls: self.peer_tls.or(lower.peer_tls),
            ca_dir: self.ca_dir.or(lower.ca_dir),
            boot_wait: self.boot_wait.or(lower.boot_wait),
            net_ticktime: self.net_ticktime.or(lower.net_ticktime),
            consumer_timeout_ms: self.consumer_timeout_ms.or(lower.consumer_timeout_ms),
            product_name: self.product_name.or(lower.product_name),
            product_version: self.product_version.or(lower.product_version),
            memory_high_watermark: self.memory_high_watermark.or(lower.memory_high_watermark),
            disk_free_limit: self.disk_free_limit.or(lower.disk_free_limit),
            default_user: self.default_user.or(lower.default_user),
            default_pass: self.default_pass.or(lower.default_pass),
            log_level: self.log_level.or(lower.log_level),
            stats_interval_ms: self.stats_interval_ms.or(lower.stats_interval_ms),
            tls: Tls {
                listener: self.tls.listener.or(lower.tls.listener),
                certfile: self.tls.certfile.or(lower.tls.certfile),
                keyfile: self.tls.keyfile.or(lower.tls.keyfile),
                cacertfile: self.tls.cacertfile.or(lower.tls.cacertfile),
            },
        }
    }
}

/// Replaces `current` by `value` unless the flag `id` was on the command line.
fn fill<T>(current: &mut T, value: Option<T>, matches: &ArgMatches, id: &str) {
    if matches.value_source(id) != Some(ValueSource::CommandLine)
        && let Some(v) = value
    {
        *current = v;
    }
}

/// Combines an IP and a port from the settings with the flag's value.
fn addr(current: &str, ip: Option<IpAddr>, port: Option<u16>) -> Option<String> {
    if ip.is_none() && port.is_none() {
        return None;
    }
    let old: Option<SocketAddr> = current.parse().ok();
    let ip = ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let port = port.or(old.map(|a| a.port())).unwrap_or(0);
    Some(SocketAddr::new(ip, port).to_string())
}

/// Reads the configuration file (`--config`, else `WARREN_CONFIG_FILE`) and
/// the environment, and fills in every value of `args` that was not given
/// on the command line. The settings without a flag are left in
/// `args.settings`.
pub(crate) fn merge(
    args: &mut Args,
    matches: &ArgMatches,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    let file = args
        .config
        .clone()
        .or_else(|| env(CONFIG_FILE_VAR).map(PathBuf::from));
    let from_file = match &file {
        Some(path) => Settings::read(path)?,
        None => Settings::default(),
    };
    let s = Settings::from_env(env)?.over(from_file);
    fill(
        &mut args.amqp_addr,
        s.amqp_addr.map(|a| a.to_string()),
        matches,
        "amqp_addr",
    );
    let http = addr(&args.http_addr, s.http_ip, s.http_port);
    fill(&mut args.http_addr, http, matches, "http_addr");
    let prometheus = addr(&args.prometheus_addr, s.prometheus_ip, s.prometheus_port);
    fill(
        &mut args.prometheus_addr,
        prometheus,
        matches,
        "prometheus_addr",
    );
    fill(
        &mut args.node_name,
        s.node_name.clone(),
        matches,
        "node_name",
    );
    fill(&mut args.data_dir, s.data_dir.clone(), matches, "data_dir");
    fill(
        &mut args.definitions,
        s.definitions.clone().map(Some),
        matches,
        "definitions",
    );
    let c = &mut args.cluster;
    fill(
        &mut c.peer_addr,
        s.peer_addr.clone().map(Some),
        matches,
        "peer_addr",
    );
    let seed = s.seeds.first().map(|(_, a)| Some(a.clone()));
    fill(&mut c.join, seed, matches, "join");
    fill(&mut c.transport, s.transport, matches, "transport");
    fill(&mut c.peer_tls, s.peer_tls, matches, "peer_tls");
    fill(
        &mut c.cluster_secret_file,
        s.secret_file.clone().map(Some),
        matches,
        "cluster_secret_file",
    );
    fill(
        &mut c.cluster_ca_dir,
        s.ca_dir.clone().map(Some),
        matches,
        "cluster_ca_dir",
    );
    fill(&mut c.boot_wait, s.boot_wait, matches, "boot_wait");
    fill(&mut c.net_ticktime, s.net_ticktime, matches, "net_ticktime");
    if c.join.is_some() && c.peer_addr.is_none() {
        return Err(ConfigError {
            source: file.map_or_else(|| "WARREN_JOIN".to_owned(), |f| f.display().to_string()),
            line: None,
            reason: "a seed node to join (cluster_formation.classic_config.nodes.N) needs \
                     cluster.peer_addr"
                .to_owned(),
        });
    }
    args.settings = s;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use clap::{CommandFactory as _, FromArgMatches as _};

    use super::*;

    fn err(text: &str) -> String {
        Settings::parse(text, "warren.conf")
            .expect_err("refused")
            .to_string()
    }

    /// Args as parsed from `flags`, merged with `env` (which may name a file).
    fn args(flags: &[&str], env: &[(&str, &str)]) -> Result<Args, ConfigError> {
        let matches = Args::command()
            .try_get_matches_from(std::iter::once("warren").chain(flags.iter().copied()))
            .expect("flags");
        let mut a = Args::from_arg_matches(&matches).expect("args");
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        merge(&mut a, &matches, &|k| env.get(k).cloned())?;
        Ok(a)
    }

    #[test]
    fn every_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, "x").unwrap();
            p.display().to_string()
        };
        let (defs, secret, cert, key, ca) = (
            file("defs.json"),
            file("secret"),
            file("cert.pem"),
            file("key.pem"),
            file("ca.pem"),
        );
        let text = format!(
            "# a comment\n\
             \n\
             listeners.tcp.default = 127.0.0.1:5673\n\
             management.tcp.port = 15673\n\
             management.tcp.ip = 127.0.0.2\n\
             prometheus.tcp.port = 15693\n\
             prometheus.tcp.ip = ::1\n\
             nodename = warren@a\n\
             data_dir = /var/lib/warren\n\
             load_definitions = {defs}\n\
             cluster_formation.peer_discovery_backend = classic_config\n\
             cluster_formation.classic_config.nodes.2 = 10.0.0.3:25672\n\
             cluster_formation.classic_config.nodes.1 = host-b:25672\n\
             cluster.peer_addr = 10.0.0.1:25672\n\
             cluster.secret_file = {secret}\n\
             cluster.transport = quic\n\
             cluster.peer_tls = off\n\
             cluster.ca_dir = /etc/warren/ca\n\
             cluster.boot_wait = 30\n\
             net_ticktime = 15\n\
             vm_memory_high_watermark.relative = 0.6\n\
             disk_free_limit.absolute = 2GB\n\
             default_user = admin\n\
             default_pass = s3cret = yes\n\
             log.console.level = warning\n\
             collect_statistics_interval = 1000\n\
             consumer_timeout = 900000\n\
             product.name = RabbitMQ\n\
             product.version = 3.10.8\n\
             listeners.ssl.default = 5671\n\
             ssl_options.certfile = {cert}\n\
             ssl_options.keyfile = {key}\n\
             ssl_options.cacertfile = {ca}\n"
        );
        let s = Settings::parse(&text, "warren.conf").unwrap();
        assert_eq!(s.amqp_addr, Some("127.0.0.1:5673".parse().unwrap()));
        assert_eq!(s.http_port, Some(15673));
        assert_eq!(s.http_ip, Some("127.0.0.2".parse().unwrap()));
        assert_eq!(s.prometheus_port, Some(15693));
        assert_eq!(s.prometheus_ip, Some("::1".parse().unwrap()));
        assert_eq!(s.node_name.as_deref(), Some("warren@a"));
        assert_eq!(s.data_dir, Some(PathBuf::from("/var/lib/warren")));
        assert_eq!(s.definitions, Some(PathBuf::from(&defs)));
        assert_eq!(
            s.seeds,
            vec![
                (1, "host-b:25672".to_owned()),
                (2, "10.0.0.3:25672".to_owned())
            ]
        );
        assert_eq!(s.peer_addr.as_deref(), Some("10.0.0.1:25672"));
        assert_eq!(s.secret_file, Some(PathBuf::from(&secret)));
        assert_eq!(s.transport, Some(PeerTransport::Quic));
        assert_eq!(s.peer_tls, Some(PeerTls::Off));
        assert_eq!(s.ca_dir, Some(PathBuf::from("/etc/warren/ca")));
        assert_eq!(s.boot_wait, Some(30));
        assert_eq!(s.net_ticktime, Some(15));
        assert_eq!(s.stats_interval_ms, Some(1000));
        assert_eq!(s.consumer_timeout_ms, Some(900_000));
        assert_eq!(s.product_name.as_deref(), Some("RabbitMQ"));
        assert_eq!(s.product_version.as_deref(), Some("3.10.8"));
        assert_eq!(s.memory_high_watermark, Some(MemoryLimit::Relative(0.6)));
        assert_eq!(s.disk_free_limit, Some(DiskLimit::Absolute(2_000_000_000)));
        assert_eq!(s.default_user.as_deref(), Some("admin"));
        assert_eq!(s.default_pass.as_deref(), Some("s3cret = yes"));
        assert_eq!(s.log_level.as_deref(), Some("warn"));
        assert_eq!(
            s.tls,
            Tls {
                listener: Some("0.0.0.0:5671".parse().unwrap()),
                certfile: Some(PathBuf::from(cert)),
                keyfile: Some(PathBuf::from(key)),
                cacertfile: Some(PathBuf::from(ca)),
            }
        );

        // The other forms of the alarm keys; the last one set wins.
        let s = Settings::parse(
            "vm_memory_high_watermark.relative = 0.4\n\
             vm_memory_high_watermark.absolute = 1024MiB\n\
             disk_free_limit.relative = 1.5\n",
            "warren.conf",
        )
        .unwrap();
        assert_eq!(
            s.memory_high_watermark,
            Some(MemoryLimit::Absolute(1 << 30))
        );
        assert_eq!(s.disk_free_limit, Some(DiskLimit::Relative(1.5)));
        assert_eq!(Settings::parse("", "x").unwrap(), Settings::default());
    }

    #[test]
    fn sizes() {
        for (text, n) in [
            ("1000", 1000),
            ("2k", 2048),
            ("2KiB", 2048),
            ("2kB", 2000),
            ("50mb", 50_000_000),
            ("50MB", 50_000_000),
            ("3M", 3 << 20),
            ("3MiB", 3 << 20),
            ("1G", 1 << 30),
            ("2GB", 2_000_000_000),
            ("1TiB", 1 << 40),
        ] {
            assert_eq!(parse_size(text), Ok(n), "{text}");
        }
        for bad in [
            "",
            "MB",
            "12 parsecs",
            "-1",
            "1.5GB",
            "99999999999999999999",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_values_name_file_and_line() {
        assert_eq!(
            err("# comment\n\nnodename = a\n\n\n\nlistners.tcp.default = 5672\n"),
            "warren.conf:7: unknown key \"listners.tcp.default\""
        );
        assert_eq!(
            err("listeners.tcp.default 5672"),
            "warren.conf:1: expected KEY = VALUE, got \"listeners.tcp.default 5672\""
        );
        let cases = [
            (
                "listeners.tcp.default = localhost",
                "is not a port or an IP:PORT",
            ),
            (
                "listeners.tcp.default = 70000",
                "is not a port or an IP:PORT",
            ),
            ("management.tcp.port = http", "is not a port number"),
            ("management.tcp.ip = localhost", "is not an IP address"),
            ("prometheus.tcp.port = -1", "is not a port number"),
            ("prometheus.tcp.ip = 1.2.3", "is not an IP address"),
            ("nodename =", "the value is empty"),
            ("data_dir = ", "the value is empty"),
            (
                "load_definitions = /no/such/defs.json",
                "is not a readable file",
            ),
            (
                "cluster_formation.peer_discovery_backend = dns",
                "only classic_config",
            ),
            (
                "cluster_formation.classic_config.nodes.x = a:1",
                "unknown key",
            ),
            (
                "cluster_formation.classic_config.nodes.1 = rabbit@host",
                "HOST:PORT",
            ),
            ("cluster.peer_addr = 10.0.0.1", "is not a HOST:PORT address"),
            (
                "cluster.secret_file = /no/such/secret",
                "is not a readable file",
            ),
            ("cluster.transport = udp", "tcp or quic"),
            ("cluster.peer_tls = yes", "neither on nor off"),
            ("cluster.ca_dir =", "the value is empty"),
            ("cluster.boot_wait = 5m", "is not a number of seconds"),
            ("net_ticktime = 0", "is not a positive number of seconds"),
            (
                "consumer_timeout = 30m",
                "is not a positive number of milliseconds",
            ),
            (
                "vm_memory_high_watermark.relative = lots",
                "non-negative number",
            ),
            (
                "vm_memory_high_watermark.relative = -0.4",
                "non-negative number",
            ),
            (
                "vm_memory_high_watermark.absolute = 2 apples",
                "is not a size",
            ),
            ("disk_free_limit.absolute = 50 MB!", "is not a size"),
            ("disk_free_limit.relative = NaN", "non-negative number"),
            ("default_user =", "the value is empty"),
            ("default_pass =", "the value is empty"),
            ("log.console.level = loud", "error, warning, info or debug"),
            ("listeners.ssl.default = tls", "is not a port or an IP:PORT"),
            (
                "ssl_options.certfile = /no/cert.pem",
                "is not a readable file",
            ),
            (
                "ssl_options.keyfile = /no/key.pem",
                "is not a readable file",
            ),
            (
                "ssl_options.cacertfile = /no/ca.pem",
                "is not a readable file",
            ),
        ];
        for (line, reason) in cases {
            let e = err(&format!("# first\n{line}\n"));
            assert!(e.starts_with("warren.conf:2: "), "{line}: {e}");
            assert!(e.contains(reason), "{line}: {e}");
        }
        assert_eq!(
            err("# tls\nlisteners.ssl.default = 5671\n"),
            "warren.conf:2: listeners.ssl.default needs ssl_options.certfile and ssl_options.keyfile"
        );
        let missing = Settings::read(Path::new("/no/such/warren.conf")).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("/no/such/warren.conf: cannot read"),
            "{missing}"
        );
    }

    #[test]
    fn precedence_flag_env_file_default() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("warren.conf");
        std::fs::write(
            &conf,
            "nodename = warren@file\n\
             data_dir = /file\n\
             listeners.tcp.default = 5600\n\
             management.tcp.port = 15600\n\
             prometheus.tcp.ip = 127.0.0.9\n\
             cluster.boot_wait = 7\n",
        )
        .unwrap();
        let c = conf.to_str().unwrap();

        // Without file or environment: the defaults.
        let a = args(&[], &[]).unwrap();
        assert_eq!(a.node_name, "warren@localhost");
        assert_eq!(a.amqp_addr, "127.0.0.1:5672");
        assert_eq!(a.settings, Settings::default());

        // The file over the defaults (a bare port is every interface; an
        // IP alone keeps the default port).
        let a = args(&["--config", c], &[]).unwrap();
        assert_eq!(a.node_name, "warren@file");
        assert_eq!(a.data_dir, PathBuf::from("/file"));
        assert_eq!(a.amqp_addr, "0.0.0.0:5600");
        assert_eq!(a.http_addr, "0.0.0.0:15600");
        assert_eq!(a.prometheus_addr, "127.0.0.9:15692");
        assert_eq!(a.cluster.boot_wait, 7);
        assert_eq!(a.cluster.peer_addr, None);
        // WARREN_CONFIG_FILE names it too.
        let b = args(&[], &[(CONFIG_FILE_VAR, c)]).unwrap();
        assert_eq!(b.node_name, "warren@file");

        // The environment over the file.
        let env = [
            ("WARREN_NODENAME", "warren@env"),
            ("WARREN_HTTP_ADDR", "127.0.0.1:15601"),
            ("WARREN_BOOT_WAIT", "8"),
        ];
        let a = args(&["--config", c], &env).unwrap();
        assert_eq!(a.node_name, "warren@env");
        assert_eq!(a.http_addr, "127.0.0.1:15601");
        assert_eq!(a.cluster.boot_wait, 8);
        assert_eq!(a.data_dir, PathBuf::from("/file"));

        // Flags over both, even when a flag repeats its default.
        let a = args(
            &[
                "--config",
                c,
                "--node-name",
                "warren@flag",
                "--boot-wait",
                "300",
                "--amqp-addr",
                "127.0.0.1:5672",
            ],
            &env,
        )
        .unwrap();
        assert_eq!(a.node_name, "warren@flag");
        assert_eq!(a.cluster.boot_wait, 300);
        assert_eq!(a.amqp_addr, "127.0.0.1:5672");
        assert_eq!(a.http_addr, "127.0.0.1:15601");
    }

    #[test]
    fn environment_variables() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "s").unwrap();
        let s = secret.to_str().unwrap();
        let a = args(
            &[],
            &[
                ("WARREN_DATA_DIR", "/env"),
                ("WARREN_AMQP_ADDR", "127.0.0.1:5800"),
                ("WARREN_PROMETHEUS_ADDR", "15800"),
                ("WARREN_PEER_ADDR", "127.0.0.1:25800"),
                ("WARREN_JOIN", "127.0.0.1:25801"),
                ("WARREN_TRANSPORT", "quic"),
                ("WARREN_PEER_TLS", "off"),
                ("WARREN_CLUSTER_SECRET_FILE", s),
                ("WARREN_CLUSTER_CA_DIR", "/ca"),
                ("WARREN_DEFAULT_USER", "admin"),
                ("WARREN_DEFAULT_PASS", "pw"),
                ("WARREN_LOG_LEVEL", "debug"),
            ],
        )
        .unwrap();
        assert_eq!(a.data_dir, PathBuf::from("/env"));
        assert_eq!(a.amqp_addr, "127.0.0.1:5800");
        assert_eq!(a.prometheus_addr, "0.0.0.0:15800");
        assert_eq!(a.cluster.peer_addr.as_deref(), Some("127.0.0.1:25800"));
        assert_eq!(a.cluster.join.as_deref(), Some("127.0.0.1:25801"));
        assert_eq!(a.cluster.transport, PeerTransport::Quic);
        assert_eq!(a.cluster.peer_tls, PeerTls::Off);
        assert_eq!(a.cluster.cluster_secret_file, Some(secret.clone()));
        assert_eq!(a.cluster.cluster_ca_dir, Some(PathBuf::from("/ca")));
        assert_eq!(a.settings.default_user.as_deref(), Some("admin"));
        assert_eq!(a.settings.default_pass.as_deref(), Some("pw"));
        assert_eq!(a.settings.log_level.as_deref(), Some("debug"));

        let e = args(&[], &[("WARREN_BOOT_WAIT", "soon")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "WARREN_BOOT_WAIT: \"soon\" is not a number of seconds"
        );
        let e = args(&[], &[("WARREN_HTTP_ADDR", "nowhere")]).unwrap_err();
        assert!(e.to_string().starts_with("WARREN_HTTP_ADDR: "), "{e}");
        let e = args(&[], &[("WARREN_JOIN", "127.0.0.1:25801")]).unwrap_err();
        assert!(e.to_string().contains("needs cluster.peer_addr"), "{e}");
        let e = args(&[], &[(CONFIG_FILE_VAR, "/no/such/warren.conf")]).unwrap_err();
        assert!(e.to_string().contains("cannot read"), "{e}");
    }

    #[test]
    fn default_user_replaces_guest_on_first_start() {
        let dir = tempfile::tempdir().unwrap();
        let open = || {
            Broker::open(
                warren_broker::BrokerConfig::new(dir.path()),
                Box::new(warren_broker::meta::MemoryStore::default()),
            )
            .unwrap()
        };
        let mut b = open();
        Settings::default().apply_default_user(&mut b).unwrap();
        assert!(b.user("guest").is_some());

        let s = Settings {
            default_user: Some("admin".into()),
            default_pass: Some("pw".into()),
            ..Settings::default()
        };
        s.apply_default_user(&mut b).unwrap();
        assert!(b.user("guest").is_none());
        let u = b.user("admin").unwrap();
        assert!(warren_broker::auth::check_password(&u.password_hash, "pw"));
        assert_eq!(u.tags, vec!["administrator".to_owned()]);
        assert!(!u.loopback_only);
        assert_eq!(b.permissions()[0].user, "admin");

        // default_pass alone changes guest's password; guest stays loopback-only.
        let mut b = open();
        let s = Settings {
            default_pass: Some("pw2".into()),
            ..Settings::default()
        };
        s.apply_default_user(&mut b).unwrap();
        let u = b.user("guest").unwrap();
        assert!(warren_broker::auth::check_password(&u.password_hash, "pw2"));
        assert!(u.loopback_only);
    }
}
