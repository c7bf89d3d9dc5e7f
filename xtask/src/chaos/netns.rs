//! A private network namespace for one run: created with `ip netns add`
//! (`lo` up), deleted when dropped. Processes start in it with `ip netns
//! exec`, iptables rules are set in it, and a thread enters it with
//! `setns(2)` (which moves only the calling thread; threads and processes
//! it starts afterwards inherit the namespace).

use std::ffi::OsStr;
use std::os::fd::AsRawFd as _;
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// A network namespace this process created; deleted on drop.
#[derive(Debug)]
pub(crate) struct Netns {
    name: String,
}

impl Netns {
    /// Creates the namespace `name` with its loopback up, and checks that
    /// iptables works in it.
    pub(crate) fn create(name: &str) -> anyhow::Result<Self> {
        run(Command::new("ip").args(["netns", "add", name]))
            .context("creating a network namespace (needs root and iproute2)")?;
        let ns = Self {
            name: name.to_owned(),
        };
        run(Command::new("ip").args(["-n", name, "link", "set", "lo", "up"]))?;
        ns.iptables(&["-S"])
            .context("iptables in the namespace (apt-get install iptables)")?;
        Ok(ns)
    }

    /// The namespace's name (`ip netns list`).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `program` to be run inside the namespace (`ip netns exec NS program`;
    /// `ip` execs it, so the child's pid is the program's).
    pub(crate) fn command(&self, program: impl AsRef<OsStr>) -> Command {
        exec_in(Some(&self.name), program)
    }

    /// Runs `iptables ARGS` in the namespace.
    pub(crate) fn iptables(&self, args: &[&str]) -> anyhow::Result<()> {
        run(self.command("iptables").args(args))
    }

    /// Runs `tc ARGS` in the namespace.
    pub(crate) fn tc(&self, args: &[&str]) -> anyhow::Result<()> {
        run(self.command("tc").args(args))
    }

    /// Runs `f` on a new thread that has entered the namespace, so that its
    /// sockets (and the threads and runtimes it builds) live there.
    pub(crate) fn run<T: Send>(
        &self,
        f: impl FnOnce() -> anyhow::Result<T> + Send,
    ) -> anyhow::Result<T> {
        std::thread::scope(|s| {
            s.spawn(|| {
                self.enter()?;
                f()
            })
            .join()
            .unwrap_or_else(|_| bail!("the thread inside {} panicked", self.name))
        })
    }

    /// Moves the calling thread into the namespace.
    fn enter(&self) -> anyhow::Result<()> {
        let path = format!("/var/run/netns/{}", self.name);
        let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
        // SAFETY: `setns` only reads the descriptor, which `file` keeps open
        // for the call, and changes nothing but this thread's namespace.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            bail!("setns {path}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// `program`, run through `ip netns exec NS` when `netns` names one.
pub(crate) fn exec_in(netns: Option<&str>, program: impl AsRef<OsStr>) -> Command {
    match netns {
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// Runs `cmd`; an error with its stderr if it fails.
fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
