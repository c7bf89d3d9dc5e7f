//! Starts the `warren` binary as a process for end-to-end tests.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::future::Future;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use base64::Engine as _;
use lapin::{Connection, ConnectionProperties};

/// A running `warren` process.
pub struct Node {
    child: Child,
    /// The AMQP port it listens on.
    pub port: u16,
    /// The management API's address (`127.0.0.1:PORT`).
    pub http: String,
    /// Its data directory.
    pub data_dir: PathBuf,
}

/// `GET path` of the management API at `http` (`HOST:PORT`) as guest: the
/// JSON answer.
pub fn api_get(http: &str, path: &str) -> serde_json::Value {
    api_get_as(http, "guest:guest", path)
}

/// `GET path` of the management API at `http` as `credentials`
/// (`USER:PASSWORD`): the JSON answer.
pub fn api_get_as(http: &str, credentials: &str, path: &str) -> serde_json::Value {
    let auth = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(credentials)
    );
    ureq::get(&format!("http://{http}{path}"))
        .set("Authorization", &auth)
        .call()
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .into_string()
        .map(|t| serde_json::from_str(&t).expect("JSON"))
        .expect("a body")
}

impl Node {
    /// Starts a node on free ports with data in `data_dir`, waiting for its ready line.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Self {
        Self::start_with_env(data_dir, extra, &[])
    }

    /// [`Node::start`] with more environment variables for the process.
    pub fn start_with_env(data_dir: &Path, extra: &[&str], env: &[(&str, &OsStr)]) -> Self {
        Self::spawn(
            Command::new(env!("CARGO_BIN_EXE_warren")),
            data_dir,
            extra,
            env,
        )
    }

    /// [`Node::start`] under an open-files limit (`ulimit -n`, soft and
    /// hard), as a shell sets it before it runs the node in its place.
    pub fn start_with_open_files(data_dir: &Path, limit: u32) -> Self {
        let mut sh = Command::new("sh");
        sh.args(["-c", &format!("ulimit -n {limit} && exec \"$0\" \"$@\"")])
            .arg(env!("CARGO_BIN_EXE_warren"));
        Self::spawn(sh, data_dir, &[], &[])
    }

    fn spawn(
        mut command: Command,
        data_dir: &Path,
        extra: &[&str],
        env: &[(&str, &OsStr)],
    ) -> Self {
        let mut child = command
            .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            // `WARREN_TEST_SHARDS=N` runs a suite's nodes sharded.
            .args(
                std::env::var("WARREN_TEST_SHARDS")
                    .ok()
                    .filter(|_| !extra.contains(&"--shards"))
                    .map(|n| vec!["--shards".to_owned(), n])
                    .unwrap_or_default(),
            )
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start warren");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read ready line");
        // "Warren node NAME ready, AMQP on 127.0.0.1:PORT, HTTP on …"
        let port = line
            .split("AMQP on ")
            .nth(1)
            .and_then(|s| s.split(',').next())
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("no ready line from warren, got {line:?}"));
        let http = line
            .split("HTTP on ")
            .nth(1)
            .and_then(|s| s.split(',').next())
            .unwrap_or_default()
            .trim()
            .to_owned();
        Self {
            child,
            port,
            http,
            data_dir: data_dir.to_owned(),
        }
    }

    /// The guest URL of vhost `/`.
    pub fn url(&self) -> String {
        self.url_as("guest", "guest")
    }

    /// The URL of vhost `/` for a user.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("amqp://{user}:{password}@127.0.0.1:{}/%2f", self.port)
    }

    /// Connects as guest.
    pub async fn connect(&self) -> Connection {
        Connection::connect(&self.url(), ConnectionProperties::default())
            .await
            .expect("connect")
    }

    /// `GET path` of the management API as guest: the JSON answer.
    pub fn api(&self, path: &str) -> serde_json::Value {
        api_get(&self.http, path)
    }

    /// POSTs `body` to the management API as guest; the JSON answer.
    pub fn api_post(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        self.api_send("POST", path, body)
    }

    /// Sends `body` with `method` to the management API as guest; the JSON
    /// answer (null for an empty one).
    pub fn api_send(
        &self,
        method: &str,
        path: &str,
        body: &serde_json::Value,
    ) -> serde_json::Value {
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("guest:guest")
        );
        let text = ureq::request(method, &format!("http://{}{path}", self.http))
            .set("Authorization", &auth)
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
            .into_string()
            .expect("a body");
        if text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&text).expect("JSON")
        }
    }

    /// The process's resident memory (`VmRSS`), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read /proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            * 1024
    }

    /// Kills the process with SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        self.child.wait().expect("wait for warren")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The reply code of a lapin protocol error.
pub fn code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(p.get_id()),
        _ => None,
    }
}

/// Runs `f` with a deadline so that a broken broker fails a test instead of hanging it.
pub async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test timed out")
}

/// `warren_amqp::fuzz::LOGIN` (protocol header, start-ok as guest, tune-ok,
/// open of vhost `/`) with the heartbeat of its tune-ok set to `secs`.
pub fn login_with_heartbeat(secs: u16) -> Vec<u8> {
    let mut login = warren_amqp::fuzz::LOGIN.to_vec();
    let at = login
        .windows(4)
        .position(|w| w == [0, 10, 0, 31])
        .expect("LOGIN has a tune-ok");
    login[at + 10..at + 12].copy_from_slice(&secs.to_be_bytes());
    login
}

/// Whether python3 can import pika. Without it `test` says so and passes,
/// unless `WARREN_REQUIRE_PIKA=1`.
pub fn has_pika(test: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .is_ok_and(|s| s.success());
    present_or_skipped(
        test,
        ok,
        "WARREN_REQUIRE_PIKA",
        "python3 cannot import pika (pip install pika)",
    )
}

/// `ok` (a tool `test` needs is there); otherwise says that `test` is
/// skipped and why (`missing`), and fails if `require`=1 asks for the tool.
#[allow(clippy::print_stderr)]
pub fn present_or_skipped(test: &str, ok: bool, require: &str, missing: &str) -> bool {
    if !ok {
        assert!(
            std::env::var(require).as_deref() != Ok("1"),
            "{require}=1 but {missing}"
        );
        eprintln!("{test} skipped: {missing}");
    }
    ok
}

/// Fails with each line where `got`, what `client`'s scenarios printed
/// against Warren (`placement`), differs from the transcript recorded from
/// RabbitMQ 3.10 in `recorded`.
#[allow(clippy::print_stderr)]
pub fn assert_transcript(client: &str, recorded: &Path, got: &str, placement: &str) {
    let recorded = std::fs::read_to_string(recorded).expect("the recorded transcript");
    let want: Vec<&str> = recorded.lines().collect();
    let got: Vec<&str> = got.lines().collect();
    let differing: Vec<String> = (0..want.len().max(got.len()))
        .filter(|&i| want.get(i) != got.get(i))
        .map(|i| {
            format!(
                "line {}:\n  RabbitMQ: {}\n  Warren:   {}",
                i + 1,
                want.get(i).unwrap_or(&"(none)"),
                got.get(i).unwrap_or(&"(none)")
            )
        })
        .collect();
    eprintln!(
        "{client}, {placement}: {} of {} lines as RabbitMQ 3.10's",
        want.len() - differing.len().min(want.len()),
        want.len()
    );
    assert!(
        differing.is_empty(),
        "{client} saw otherwise than on RabbitMQ 3.10 ({placement}):\n{}",
        differing.join("\n")
    );
}

/// The `{case: outcome}` object a probe script prints, run as `python3
/// SCRIPT ARGS…` off the async runtime; the test fails if the script does.
pub async fn probe_json(
    script: String,
    args: Vec<String>,
) -> serde_json::Map<String, serde_json::Value> {
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3").arg(&script).args(&args).output()
    })
    .await
    .unwrap()
    .expect("run python3");
    assert!(
        out.status.success(),
        "the probe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the probe prints a JSON object")
}

/// The cases whose outcome in `got` is not the one `recorded` from
/// RabbitMQ 3.10, one line each.
pub fn differ_from_rabbitmq(
    got: &serde_json::Map<String, serde_json::Value>,
    recorded: &serde_json::Map<String, serde_json::Value>,
) -> Vec<String> {
    got.iter()
        .filter(|(case, outcome)| recorded.get(*case) != Some(*outcome))
        .map(|(case, outcome)| {
            format!(
                "{case}: warren {outcome}, rabbitmq 3.10 {}",
                recorded.get(case).unwrap_or(&serde_json::Value::Null)
            )
        })
        .collect()
}

/// Fails unless a probe's outcomes, case by case, are the ones recorded
/// from RabbitMQ 3.10 (`recorded`, the JSON file's text).
pub fn assert_as_rabbitmq(warren: &serde_json::Map<String, serde_json::Value>, recorded: &str) {
    let rabbit: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(recorded).expect("a recorded JSON object");
    assert_eq!(
        warren.keys().collect::<Vec<_>>(),
        rabbit.keys().collect::<Vec<_>>(),
        "the probe's cases changed: record RabbitMQ 3.10 again"
    );
    let differ = differ_from_rabbitmq(warren, &rabbit);
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}
