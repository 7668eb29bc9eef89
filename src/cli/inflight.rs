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
/// provider holds a connection. Returns the most tasks in flight that fit (fewer than asked,
/// with a warning, when the limit is too low).
pub(super) fn open_files_for(max_in_flight: usize) -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write only the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return max_in_flight;
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
    fitting(max_in_flight, lim.rlim_cur)
}

/// Files a daemon keeps open besides its tasks' connections (its database, sockets, logs, a
/// write's own connection, the blocking routes).
const OPEN_FILES_RESERVED: u64 = 256;

/// The most tasks in flight whose connections fit in `open_files`: a task that found no file
/// for its connection would fail its model call, so the daemon holds fewer, and says so.
fn fitting(max_in_flight: usize, open_files: u64) -> usize {
    let room = open_files.saturating_sub(OPEN_FILES_RESERVED).max(1);
    if (max_in_flight as u64) <= room {
        return max_in_flight;
    }
    let fits = usize::try_from(room).unwrap_or(usize::MAX);
    tracing::warn!(
        max_in_flight,
        open_files,
        runs = fits,
        "the limit of open files is too low for --max-in-flight: each task waiting on a provider holds a connection, so this daemon runs at most {fits} at once; raise the limit (ulimit -n) to run more"
    );
    fits
}

#[cfg(test)]
mod tests {
    use super::fitting;

    #[test]
    fn the_tasks_in_flight_fit_the_open_files() {
        assert_eq!(fitting(10_000, 1_048_576), 10_000);
        assert_eq!(fitting(10_000, 1_024), 768);
        assert_eq!(fitting(500, 756), 500);
        assert_eq!(fitting(500, 200), 1);
    }
}
