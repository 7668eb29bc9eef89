//! This process as a lease owner: who holds a claim (host, pid, start time, a random
//! instance id), and whether the owner of a lease on this host is gone.

use crate::store::Lease;

/// This process as a lease owner: host, pid and start time (which tell a dead process on
/// this host from a live one), and a random instance id made at start, which keeps two
/// processes apart even when hosts or containers share a name and pid numbers.
#[derive(Clone, Debug)]
pub struct Identity {
    pub host: String,
    pub pid: u32,
    pub start_ticks: u64,
    pub instance: u64,
}

impl Identity {
    pub fn current() -> Identity {
        static INSTANCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let pid = std::process::id();
        Identity {
            host: hostname(),
            pid,
            start_ticks: start_ticks(pid).unwrap_or(0),
            instance: *INSTANCE.get_or_init(crate::store::random_u64),
        }
    }

    pub fn owner(&self) -> String {
        format!(
            "{}:{}:{}:{:016x}",
            self.host, self.pid, self.start_ticks, self.instance
        )
    }

    pub fn lease(&self, now_ms: u64, lease_ms: u64) -> Lease {
        Lease {
            owner: self.owner(),
            host: self.host.clone(),
            pid: self.pid,
            start_ticks: self.start_ticks,
            expires_at_ms: now_ms.saturating_add(lease_ms),
            token: 0,
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields after it follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// A lease whose owner is a process on this host that no longer exists can be taken over at
/// once, without waiting for it to expire. Other hosts' leases are left to expire.
pub fn owner_is_dead(lease: &Lease) -> bool {
    if lease.host != hostname() || !std::path::Path::new("/proc/self/stat").exists() {
        return false;
    }
    match start_ticks(lease.pid) {
        None => true,
        Some(t) => t != lease.start_ticks,
    }
}
