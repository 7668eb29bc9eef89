//! How many tasks a daemon holds at once: the open files its connections need, and the
//! answer to the retired `--workers` (one thread per task), which `--max-in-flight` replaced.

use super::{CliError, CliResult};

/// The answer to a retired `--workers`.
pub(super) fn workers_retired(given: &Option<String>, instead: &str) -> CliResult {
    match given {
        None => Ok(()),
        Some(n) => Err(CliError::usage(format!(
            "--workers {n}: worker threads are retired; a task waiting on its model or a tool no longer holds a thread, so the daemon runs many at once on about one thread per core"
        ))
        .hint(instead)),
    }
}

/// Raises this process's limit of open files to its hard limit: every task waiting on a
/// provider holds a connection. Warns when the most tasks in flight may not fit.
pub(super) fn open_files_for(max_in_flight: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write only the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    let open_files = lim.rlim_cur;
    if (max_in_flight as u64).saturating_add(256) > open_files {
        tracing::warn!(
            max_in_flight,
            open_files,
            "the limit of open files may be too low for the tasks in flight: each one waiting on a provider holds a connection; raise it (ulimit -n) or lower --max-in-flight"
        );
    }
}
