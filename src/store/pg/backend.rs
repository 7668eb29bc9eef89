//! The PostgreSQL backend as the storage interface: each method of [`crate::store::Backend`]
//! answered by the `PgStore` transaction that implements it.

use crossbeam_channel::Receiver;

use super::PgStore;
use crate::store::Result;

impl crate::store::Backend for PgStore {
    fn db_id(&self) -> &str {
        &self.db_id
    }

    fn describe(&self) -> String {
        format!("PostgreSQL at {} (schema {})", self.display(), self.schema)
    }

    fn local_owners(&self) -> bool {
        false
    }

    fn groups_commits(&self) -> bool {
        false
    }

    fn heartbeat(&self, owner: &str, now_ms: u64, until_ms: u64) -> Result<()> {
        PgStore::heartbeat(self, owner, now_ms, until_ms)
    }

    fn sign_off(&self, owner: &str) -> Result<()> {
        PgStore::sign_off(self, owner)
    }

    fn wakeups(&self) -> Option<Receiver<()>> {
        self.listen()
    }

    fn enqueue(
        &self,
        tasks: &[crate::store::NewTask],
        now_ms: u64,
    ) -> Result<Vec<crate::store::Enqueued>> {
        PgStore::enqueue(self, tasks, now_ms)
    }

    fn claim(
        &self,
        lease: &crate::store::Lease,
        max: usize,
        now_ms: u64,
    ) -> Result<Vec<crate::store::TaskRecord>> {
        PgStore::claim(self, lease, max, now_ms)
    }

    fn ready_count(&self) -> Result<u64> {
        PgStore::ready_count(self)
    }

    fn claim_left(&self, id: &str, token: u64, now_ms: u64) -> Result<Option<u64>> {
        PgStore::claim_left(self, id, token, now_ms)
    }

    fn renew_claim(&self, id: &str, token: u64, now_ms: u64, lease_ms: u64) -> Result<bool> {
        PgStore::renew_claim(self, id, token, now_ms, lease_ms)
    }

    fn running_count(&self) -> Result<u64> {
        let sql = self.sql("SELECT count(*) FROM {s}.tasks WHERE status = 'running'");
        let n: i64 = self.read(|c| Ok(c.client.query_one(&sql, &[])?.get(0)))?;
        Ok(super::rows::u64_of(n))
    }

    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&crate::store::Lease) -> bool,
        live: &dyn Fn(&str, &crate::store::Lease) -> bool,
    ) -> Result<Vec<String>> {
        PgStore::recover(self, now_ms, is_dead, live)
    }

    fn commit_batch(
        &self,
        commits: &[&crate::store::Commit],
    ) -> std::result::Result<Vec<Option<crate::store::CommitOutcome>>, String> {
        PgStore::commit_batch(self, commits)
    }

    fn decide(
        &self,
        f: &mut dyn FnMut(&mut dyn crate::store::ops::DecisionTx) -> Result<()>,
    ) -> Result<()> {
        PgStore::decide(self, f)
    }

    fn call(&self, key: &str) -> Result<Option<crate::store::CallRecord>> {
        PgStore::call(self, key)
    }

    fn reply(&self, task_id: &str, step: u32) -> Result<Option<crate::model::RecordedReply>> {
        PgStore::reply(self, task_id, step)
    }

    fn task(&self, id: &str) -> Result<crate::store::TaskRecord> {
        PgStore::task(self, id)
    }

    fn tasks(&self) -> Result<Vec<crate::store::TaskRecord>> {
        PgStore::tasks(self)
    }

    fn damaged(&self) -> Result<Vec<(String, String)>> {
        PgStore::damaged(self)
    }

    fn list(&self, q: &crate::store::list::ListQuery) -> Result<crate::store::list::Page> {
        PgStore::list(self, q)
    }

    fn counts(&self) -> Result<Vec<(crate::store::QueueStatus, u64)>> {
        PgStore::counts(self)
    }

    fn oldest_queued_ms(&self) -> Result<Option<u64>> {
        PgStore::oldest_queued_ms(self)
    }

    fn task_by_key(&self, key: &str) -> Result<Option<String>> {
        PgStore::task_by_key(self, key)
    }

    fn spans(&self, task_id: &str) -> Result<Vec<crate::kernel::Span>> {
        PgStore::spans(self, task_id)
    }

    fn replies(&self, task_id: &str) -> Result<Vec<crate::model::RecordedReply>> {
        PgStore::replies(self, task_id)
    }

    fn outbox(&self, max: usize) -> Result<Vec<crate::store::OutboxEntry>> {
        PgStore::outbox(self, max)
    }

    fn outbox_trim(&self, keep: usize) -> Result<(u64, u64)> {
        PgStore::outbox_trim(self, keep)
    }

    fn outbox_release(&self) -> Result<()> {
        PgStore::outbox_release(self)
    }

    fn outbox_done(&self, seqs: &[u64]) -> Result<()> {
        PgStore::outbox_done(self, seqs)
    }

    fn calls(&self, task_id: &str) -> Result<Vec<crate::store::CallRecord>> {
        PgStore::calls(self, task_id)
    }

    fn events(&self, task: Option<&str>) -> Result<Vec<crate::store::ops::Event>> {
        PgStore::events(self, task)
    }

    fn held_ids(&self) -> Result<Vec<String>> {
        PgStore::held_ids(self)
    }

    fn due_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        PgStore::due_approvals(self, now_ms)
    }

    fn add_note(
        &self,
        user: &str,
        text: &str,
        source: &str,
        ttl_s: u64,
        d: &crate::store::ops::Decision,
    ) -> Result<crate::kernel::memory::Note> {
        PgStore::add_note(self, user, text, source, ttl_s, d)
    }

    fn notes(
        &self,
        user: Option<&str>,
        now_ms: u64,
        all: bool,
    ) -> Result<Vec<crate::kernel::memory::Note>> {
        PgStore::notes(self, user, now_ms, all)
    }

    fn forget(
        &self,
        user: &str,
        source: Option<&str>,
        d: &crate::store::ops::Decision,
    ) -> Result<usize> {
        PgStore::forget(self, user, source, d)
    }

    fn check(&self) -> Result<crate::store::CheckReport> {
        PgStore::check(self)
    }

    fn purge(
        &self,
        before_ms: u64,
        batch: usize,
        d: &crate::store::ops::Decision,
    ) -> Result<Vec<String>> {
        PgStore::purge(self, before_ms, batch, d)
    }
}
