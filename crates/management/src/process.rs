//! What the node's process uses, as `/api/nodes` and `/metrics` show it:
//! file descriptors (Linux's `/proc/self`), the open-files limit, and the
//! tokio tasks alive. Each is `None` where it cannot be read: the API then
//! leaves the field out rather than show a made-up number. Client sockets
//! are the node's own count (`NodeControl::client_sockets`).

/// Open file descriptors (`/proc/self/fd`): RabbitMQ's `fd_used`. Every
/// descriptor counts: files, client and peer sockets, listeners.
pub(crate) fn fds() -> Option<u64> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
}

/// The process's open-files limit (the soft `RLIMIT_NOFILE`, from
/// `/proc/self/limits`): RabbitMQ's `fd_total`. `None` when unlimited.
pub(crate) fn fd_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_fd_limit(&limits)
}

/// The soft limit on the "Max open files" line of a `/proc/PID/limits` text.
fn parse_fd_limit(limits: &str) -> Option<u64> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    rest.split_whitespace().next()?.parse().ok()
}

/// CPU time the process has used, user and system (`/proc/self/stat`), in
/// seconds: the standard `process_cpu_seconds_total`.
pub(crate) fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let ticks = parse_cpu_ticks(&stat)?;
    Some(ticks as f64 / rustix::param::clock_ticks_per_second() as f64)
}

/// utime + stime of a `/proc/PID/stat` line: its 14th and 15th fields,
/// counted after the command name (which may hold spaces and parentheses).
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // `rest` starts at field 3 (the state).
    let mut fields = rest.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(user + system)
}

/// Tasks alive on the tokio runtime that runs the caller — for the API's
/// handlers, the node's main runtime: client connections, queue replicas,
/// rings, links, HTTP requests (the metadata store runs on a runtime of
/// its own, not counted). Warren's `proc_used`: RabbitMQ counts Erlang
/// processes, the nearest thing.
pub(crate) fn tasks_alive() -> Option<u64> {
    let handle = tokio::runtime::Handle::try_current().ok()?;
    u64::try_from(handle.metrics().num_alive_tasks()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_after_a_command_name_with_spaces() {
        let stat =
            "4242 (warren (x) y) S 1 4242 4242 0 -1 4194560 1500 0 0 0 731 269 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_cpu_ticks(stat), Some(1000));
        assert_eq!(parse_cpu_ticks("4242 (warren) S 1"), None);
    }

    #[test]
    fn this_process_has_used_some_cpu() {
        let mut spin = 0u64;
        while cpu_seconds().is_some_and(|s| s == 0.0) {
            spin = spin.wrapping_add(1);
        }
        assert!(cpu_seconds().is_some_and(|s| s > 0.0), "{spin}");
    }

    #[test]
    fn the_soft_open_files_limit_is_read() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max processes             127473               127473               processes \n\
                    Max open files            20000                524288               files     \n";
        assert_eq!(parse_fd_limit(text), Some(20_000));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(parse_fd_limit(unlimited), None);
        assert_eq!(parse_fd_limit(""), None);
    }

    #[test]
    fn this_process_has_descriptors_and_a_limit() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let fds = fds().unwrap();
        assert!(
            fds >= 4,
            "stdin, stdout and stderr beside the listener: {fds}"
        );
        assert!(fd_limit().unwrap() >= fds);
        drop(listener);
    }

    #[tokio::test]
    async fn tasks_alive_counts_spawned_tasks() {
        assert_eq!(tasks_alive(), Some(0));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = rx.await;
        });
        assert_eq!(tasks_alive(), Some(1));
        drop(tx);
        task.await.unwrap();
        assert_eq!(std::thread::spawn(tasks_alive).join().unwrap(), None);
    }
}
