//! A daemon as its redb file's only writer (the default): the lock that says so, waited for
//! while a predecessor that was just killed is still being ended by the system, and the file
//! opened in that mode, waited for while a verb holds it for a moment.

use super::*;

/// The sole writer's lock of the file, or a refusal naming the daemon that has it. A daemon
/// that was just killed (a supervisor restarting it) holds the lock until the system has
/// finished ending it: that is waited for, up to 10 s, and said in the log.
pub(super) fn claim_sole(db: &str) -> Result<std::fs::File, CliError> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut said = false;
    loop {
        match crate::local::claim(Path::new(db)).map_err(CliError::op)? {
            crate::local::Claim::Held(lock) => return Ok(lock),
            crate::local::Claim::Elsewhere(Some(pid))
                if std::time::Instant::now() < until && ending(pid) =>
            {
                if !said {
                    tracing::info!(
                        pid,
                        "the previous daemon on this file has ended but the system has not yet let go of its lock; waiting for it (up to 10 s)"
                    );
                    said = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            crate::local::Claim::Elsewhere(pid) => return Err(refused(db, pid)),
        }
    }
}

/// Whether process `pid` is ending: a zombie, or exiting (the kernel still releasing what it
/// held, the file's lock among them). A process that cannot be seen (gone, in another pid
/// namespace, hidden) is not taken for one: a lock held without a visible ending holder is
/// someone else's, refused at once.
fn ending(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // After the command's closing parenthesis: state, ppid, pgrp, session, tty, tpgid, flags.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    const PF_EXITING: u64 = 0x4;
    let exiting = fields
        .get(6)
        .and_then(|f| f.parse::<u64>().ok())
        .is_some_and(|flags| flags & PF_EXITING != 0);
    matches!(fields.first(), Some(&("Z" | "X" | "x"))) || exiting
}

/// The refusal to run beside the daemon that holds the file.
fn refused(db: &str, pid: Option<u32>) -> CliError {
    let who = pid.map_or_else(
        || "another daemon".to_string(),
        |p| format!("the daemon with pid {p}"),
    );
    CliError::op(format!(
        "{who} already runs on {db}; a daemon is its file's only one unless every daemon on it is started with --shared"
    ))
    .hint("stop that daemon first (SIGTERM lets it finish its steps), run this one on another file, or start every daemon on the file with --shared")
}

/// The file opened (created if need be) as its only writer. Verbs that share
/// the file for writing hold it for a moment each: the open waits for them, up to 10 s;
/// anything that holds it longer (a daemon started with --shared, a `worker console`)
/// is named in the refusal.
pub(super) fn open_sole(db: &str) -> Result<Db, CliError> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match RedbStore::open_as(Path::new(db), true, store::Sharing::Sole) {
            Ok(s) => return Ok(Arc::new(s)),
            Err(store::Error::InUse(_)) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(store::Error::InUse(path)) => {
                return Err(CliError::op(format!(
                    "{} stayed open for writing in another process for 10 s, so this daemon cannot be its only writer",
                    path.display()
                ))
                .hint("a daemon started with --shared, or a `worker console`, shares the file for writing: stop it, or start this daemon with --shared too"));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
