//! The committer: the executor's tasks hand their commits to one thread that groups them into
//! shared transactions (group commit: each commit stays atomic, many share an fsync), or
//! commit directly where a server commits in parallel (PostgreSQL) or there is no one to share
//! with (the simulation). A commit refused because its claim
//! was superseded comes back as `CommitFail::LeaseLost`.

use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Stats;
use crate::store::{Backend, Commit, CommitOutcome};

/// Why a commit did not happen.
#[derive(Clone, Debug, PartialEq)]
pub enum CommitFail {
    LeaseLost,
    Failed(String),
}

pub(super) struct CommitRequest {
    commit: Commit,
    reply: tokio::sync::oneshot::Sender<std::result::Result<CommitOutcome, CommitFail>>,
}

/// Handle that runs use to commit: through the committer thread (group commit), or
/// directly in the caller's thread, one transaction per commit (a simulation's workers).
#[derive(Clone)]
pub struct Committer {
    pub(super) route: Route,
}

#[derive(Clone)]
pub(super) enum Route {
    Thread(Sender<CommitRequest>),
    Direct(Arc<dyn Backend>),
}

impl Committer {
    /// Commits in the calling thread, each commit in its own transaction.
    pub fn direct(store: Arc<dyn Backend>) -> Committer {
        Committer {
            route: Route::Direct(store),
        }
    }

    /// Commits `commit`, waiting in this thread.
    pub fn commit(&self, commit: Commit) -> std::result::Result<CommitOutcome, CommitFail> {
        match &self.route {
            Route::Direct(store) => direct(store.as_ref(), &commit),
            Route::Thread(tx) => Self::hand_over(tx, commit)?
                .blocking_recv()
                .map_err(|_| stopped())?,
        }
    }

    /// Commits `commit` from a task of the executor: the wait for the committer holds no
    /// thread; a direct commit (a blocking client) runs off the executor's threads.
    pub async fn commit_async(
        &self,
        commit: Commit,
    ) -> std::result::Result<CommitOutcome, CommitFail> {
        match &self.route {
            Route::Direct(store) => super::blocking(|| direct(store.as_ref(), &commit)),
            Route::Thread(tx) => Self::hand_over(tx, commit)?.await.map_err(|_| stopped())?,
        }
    }

    fn hand_over(
        tx: &Sender<CommitRequest>,
        commit: Commit,
    ) -> std::result::Result<Reply, CommitFail> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        tx.send(CommitRequest { commit, reply })
            .map_err(|_| stopped())?;
        Ok(rx)
    }
}

type Reply = tokio::sync::oneshot::Receiver<std::result::Result<CommitOutcome, CommitFail>>;

fn stopped() -> CommitFail {
    CommitFail::Failed("the committer has stopped".into())
}

/// One commit in its own transaction, counted.
fn direct(store: &dyn Backend, commit: &Commit) -> std::result::Result<CommitOutcome, CommitFail> {
    let started = std::time::Instant::now();
    let result = commit_alone(store, commit);
    observe_commit(started, 1);
    result
}

/// Largest number of commits grouped into one transaction.
const GROUP_MAX: usize = 256;

pub(super) fn committer_loop(store: &dyn Backend, rx: Receiver<CommitRequest>, stats: &Stats) {
    while let Some(batch) = crate::group::recv_batch(&rx, GROUP_MAX) {
        let started = std::time::Instant::now();
        let results = group_commit(store, &batch);
        observe_commit(started, batch.len());
        stats.transactions.fetch_add(1, Ordering::Relaxed);
        stats
            .commits
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for (req, res) in batch.into_iter().zip(results) {
            let _ = req.reply.send(res);
        }
    }
}

fn group_commit(
    store: &dyn Backend,
    batch: &[CommitRequest],
) -> Vec<std::result::Result<CommitOutcome, CommitFail>> {
    let commits: Vec<&Commit> = batch.iter().map(|r| &r.commit).collect();
    match store.commit_batch(&commits) {
        Ok(results) => results.into_iter().map(refused).collect(),
        // Something failed mid-write, so nothing of that transaction landed. Each commit is
        // tried again alone, so one bad commit fails only itself, never its whole group.
        Err(_) if batch.len() > 1 => batch
            .iter()
            .map(|r| commit_alone(store, &r.commit))
            .collect(),
        Err(e) => vec![Err(CommitFail::Failed(e))],
    }
}

/// Counts a transaction of `n` commits and its latency.
fn observe_commit(started: std::time::Instant, n: usize) {
    let m = crate::metrics::global();
    m.commits.inc_by(n as u64);
    m.commit_group.observe(n as f64);
    m.commit_seconds.observe(started.elapsed().as_secs_f64());
}

fn commit_alone(store: &dyn Backend, c: &Commit) -> std::result::Result<CommitOutcome, CommitFail> {
    match store.commit_batch(&[c]) {
        Ok(mut one) => refused(one.pop().flatten()),
        Err(e) => Err(CommitFail::Failed(e)),
    }
}

/// A commit the backend refused because its claim was superseded.
fn refused(o: Option<CommitOutcome>) -> std::result::Result<CommitOutcome, CommitFail> {
    o.ok_or(CommitFail::LeaseLost)
}
