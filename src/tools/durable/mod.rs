//! The document's store, durable: orders, the ledger of effects, stored results per call key and
//! the arrivals log live in their own redb file, so they survive the worker's crashes the way an
//! external service would. Each write call is one transaction: the effect, the stored result,
//! the order change and the arrival commit together, so a call key takes effect at most once.
//!
//! The store keeps no approvals of its own: an approval lives in the worker database, and the
//! re-sent call carries it (the digest of tool and args that was approved), which the store
//! checks against the call's own digest. A key reused with other arguments is refused as a
//! conflict, never answered with the first call's result. Every write request that reaches the
//! store is appended to the arrivals log, whatever was done with it, so a test can see a
//! duplicate send that the stored results would otherwise hide.

use crossbeam_channel::{Receiver, Sender, bounded};
use redb::{
    ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{Effect, Order, REPLAY_LATENCY_MS, Tools, apply, demo_orders, latency_ms};
use crate::kernel::{ToolReply, ToolRequest};
use crate::store::codec::{decode, encode};
use crate::store::{Error, Opener, Reopening, Result};

const ORDERS: TableDefinition<&str, &[u8]> = TableDefinition::new("orders");
/// sequence -> ledger entry.
const LEDGER: TableDefinition<u64, &[u8]> = TableDefinition::new("ledger");
/// (call key, tool) -> stored result (with the digest of its args) of a write that took effect.
const DONE: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("done_v2");
/// sequence -> arrival: every write request that reached the store.
const ARRIVALS: TableDefinition<u64, &[u8]> = TableDefinition::new("arrivals");
/// call key -> (payload digest, response) of the HTTP service: Stripe's idempotency record.
const IDEMPOTENCY: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency");

/// "format" -> the record format of this file (absent: version 1, JSON records).
const FORMAT: TableDefinition<&str, u64> = TableDefinition::new("format");
const FORMAT_KEY: &str = "format";
const STORE_FORMAT: u64 = 2;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerEntry {
    pub seq: u64,
    /// The tenant the order belongs to; empty for the shared book.
    #[serde(default)]
    pub scope: String,
    pub effect: Effect,
    pub key: String,
    pub user: String,
}

/// A write request as it reached the store, and what the store did with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    pub seq: u64,
    pub key: String,
    pub tool: String,
    /// Digest of tool and args (the document's).
    pub digest: String,
    /// `applied`, `replayed` (a stored result answered it), `needs_approval`, `conflict` (the
    /// key was used for other arguments), `in_flight`, or `refused` (an error, nothing done).
    pub outcome: String,
}

/// What a stored result of a write keeps: the result, and the digest of the call it answers.
#[derive(Serialize, Deserialize)]
struct Stored {
    digest: String,
    result: Value,
}

#[derive(Serialize, Deserialize)]
struct IdempotencyRecord {
    digest: String,
    response: Value,
}

pub struct DurableStore {
    /// Opened again after an I/O error (a full disk freed again), without a restart.
    db: Arc<Reopening>,
    pub path: PathBuf,
    /// Write calls go through one thread that groups concurrent calls into one transaction
    /// (started on the first write), as a service handling many clients would.
    writer: Mutex<Option<Sender<WriteReq>>>,
}

/// One write call, owned, for the group-commit thread.
struct WriteCall {
    scope: String,
    user: String,
    name: String,
    args: serde_json::Map<String, Value>,
    key: String,
    approval: Option<String>,
}

struct WriteReq {
    call: WriteCall,
    reply: Sender<std::result::Result<(Value, bool), String>>,
}

/// Largest number of write calls grouped into one transaction.
const GROUP_MAX: usize = 128;

impl DurableStore {
    /// Opens the store file, creating it with the document's two orders if it is new.
    pub fn open(path: &Path) -> Result<DurableStore> {
        if path.exists() {
            crate::store::check_not_empty(path)?;
        }
        crate::store::create_private(path)?;
        let p = path.to_path_buf();
        DurableStore::open_with(
            path,
            Arc::new(move || crate::store::open_redb(&p, 16 << 20)),
        )
    }

    /// Opens the store with `open`, which makes a fresh handle each time it is called (again
    /// after an I/O error); tests pass one over a storage backend that fails on demand.
    pub fn open_with(path: &Path, open: Opener) -> Result<DurableStore> {
        let s = DurableStore {
            db: Arc::new(Reopening::new(open)?),
            path: path.to_path_buf(),
            writer: Mutex::new(None),
        };
        let format = {
            let r = s.db.get().begin_read()?;
            match r.open_table(FORMAT) {
                Ok(t) => t.get(FORMAT_KEY)?.map(|g| g.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            }
        };
        match format {
            Some(v) if v > STORE_FORMAT => {
                return Err(Error::NewerVersion {
                    what: format!("store {}", path.display()),
                    found: v,
                    supported: STORE_FORMAT,
                });
            }
            Some(_) => {}
            None => {
                // A new file, or one written as JSON records: seed or rewrite it, at once.
                let w = s.db.get().begin_write()?;
                {
                    let mut orders = w.open_table(ORDERS)?;
                    if orders.is_empty()? {
                        for (id, o) in demo_orders() {
                            orders.insert(id.as_str(), encode(&o)?.as_slice())?;
                        }
                    }
                    use crate::store::codec::migrate_table;
                    migrate_table::<_, Order>(&mut orders, "order")?;
                    migrate_table::<_, LedgerEntry>(&mut w.open_table(LEDGER)?, "ledger entry")?;
                    migrate_table::<_, Stored>(&mut w.open_table(DONE)?, "stored result")?;
                    migrate_table::<_, Arrival>(&mut w.open_table(ARRIVALS)?, "arrival")?;
                    migrate_table::<_, IdempotencyRecord>(
                        &mut w.open_table(IDEMPOTENCY)?,
                        "idempotency record",
                    )?;
                    w.open_table(FORMAT)?.insert(FORMAT_KEY, STORE_FORMAT)?;
                }
                w.commit()?;
            }
        }
        Ok(s)
    }

    /// Adds orders, or changes the customer and total of existing ones: what was refunded
    /// stays (a total below it is refused), so re-adding an order never undoes refunds.
    pub fn put_orders(&self, orders: &[(String, Order)]) -> Result<()> {
        let w = self.db.get().begin_write()?;
        {
            let mut t = w.open_table(ORDERS)?;
            for (id, o) in orders {
                let existing = match t.get(id.as_str())? {
                    Some(g) => Some(decode::<Order>("order", g.value())?),
                    None => None,
                };
                let mut o = o.clone();
                if let Some(old) = existing {
                    if o.total < old.refunded {
                        return Err(Error::Invalid(format!(
                            "order {id}: a total of {} is below the {} already refunded",
                            o.total, old.refunded
                        )));
                    }
                    o.refunded = old.refunded;
                    o.status = old.status;
                }
                t.insert(id.as_str(), encode(&o)?.as_slice())?;
            }
        }
        w.commit()?;
        Ok(())
    }

    pub fn orders(&self) -> Result<BTreeMap<String, Order>> {
        let r = self.db.get().begin_read()?;
        let t = r.open_table(ORDERS)?;
        let mut out = BTreeMap::new();
        for e in t.iter()? {
            let (k, v) = e?;
            out.insert(k.value().to_string(), decode("order", v.value())?);
        }
        Ok(out)
    }

    pub fn ledger(&self) -> Result<Vec<LedgerEntry>> {
        let r = self.db.get().begin_read()?;
        let t = r.open_table(LEDGER)?;
        let mut out = Vec::new();
        for e in t.iter()? {
            let (_, v) = e?;
            out.push(decode("ledger entry", v.value())?);
        }
        Ok(out)
    }

    /// The stored result of a call key, if the write took effect: what a lookup endpoint answers.
    pub fn lookup(&self, key: &str, tool: &str) -> Result<Option<Value>> {
        let r = self.db.get().begin_read()?;
        let t = r.open_table(DONE)?;
        match t.get((key, tool))? {
            Some(g) => Ok(Some(decode::<Stored>("stored result", g.value())?.result)),
            None => Ok(None),
        }
    }

    /// Every write request that reached the store, in order.
    pub fn arrivals(&self) -> Result<Vec<Arrival>> {
        let r = self.db.get().begin_read()?;
        let t = match r.open_table(ARRIVALS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::new();
        for e in t.iter()? {
            let (_, v) = e?;
            out.push(decode("arrival", v.value())?);
        }
        Ok(out)
    }

    /// Decodes every record of the store; returns how many were read and the damaged ones.
    pub fn check(&self) -> Result<(u64, Vec<String>)> {
        let r = self.db.get().begin_read()?;
        let mut n = 0;
        let mut bad = Vec::new();
        macro_rules! scan {
            ($table:expr, $ty:ty, $what:expr) => {
                match r.open_table($table) {
                    Ok(t) => {
                        for e in t.iter()? {
                            let (k, v) = e?;
                            n += 1;
                            if let Err(e) = decode::<$ty>($what, v.value()) {
                                bad.push(format!("store {} {:?}: {e}", $what, k.value()));
                            }
                        }
                    }
                    Err(redb::TableError::TableDoesNotExist(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            };
        }
        scan!(ORDERS, Order, "order");
        scan!(LEDGER, LedgerEntry, "ledger entry");
        scan!(DONE, Stored, "stored result");
        scan!(ARRIVALS, Arrival, "arrival");
        scan!(IDEMPOTENCY, IdempotencyRecord, "idempotency record");
        Ok((n, bad))
    }

    /// Logs a write request that the HTTP front answered without reaching the store's rules
    /// (a stored response, a conflicting payload, a key in flight).
    pub fn arrive(&self, key: &str, tool: &str, digest: &str, outcome: &str) -> Result<()> {
        let w = self.db.get().begin_write()?;
        log_arrival(&w, key, tool, digest, outcome)?;
        w.commit()?;
        Ok(())
    }

    /// The HTTP service's stored response for an idempotency key: (payload digest, response).
    pub fn idempotent_response(&self, key: &str) -> Result<Option<(String, Value)>> {
        let r = self.db.get().begin_read()?;
        let t = match r.open_table(IDEMPOTENCY) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        match t.get(key)? {
            Some(g) => {
                let r: IdempotencyRecord = decode("idempotency record", g.value())?;
                Ok(Some((r.digest, r.response)))
            }
            None => Ok(None),
        }
    }

    pub fn remember_response(&self, key: &str, digest: &str, response: &Value) -> Result<()> {
        let w = self.db.get().begin_write()?;
        w.open_table(IDEMPOTENCY)?.insert(
            key,
            encode(&IdempotencyRecord {
                digest: digest.to_string(),
                response: response.clone(),
            })?
            .as_slice(),
        )?;
        w.commit()?;
        Ok(())
    }

    /// One call as the service runs it. Errors of the store itself become error results.
    ///
    /// `scope` names a tenant: its orders are stored apart, and the first time a scope touches
    /// one of the document's order ids it gets a fresh copy of that order, so each demo task
    /// runs against the document's store as it starts out. `approval` is the digest an
    /// operator approved, carried by the request; it counts only if it is this call's digest.
    #[allow(clippy::too_many_arguments)]
    pub fn call_once(
        &self,
        scope: &str,
        user: &str,
        name: &str,
        args: &serde_json::Map<String, Value>,
        key: &str,
        write: bool,
        approval: Option<&str>,
    ) -> Result<(Value, bool)> {
        if !write {
            let order_id = args.get("order_id").and_then(Value::as_str).unwrap_or("");
            let r = self.db.get().begin_read()?;
            let mut orders = load_order(&r.open_table(ORDERS)?, scope, order_id)?;
            let (res, _) = apply(&mut orders, &|_, _| false, user, name, args);
            return Ok((res, false));
        }
        let call = WriteCall {
            scope: scope.to_string(),
            user: user.to_string(),
            name: name.to_string(),
            args: args.clone(),
            key: key.to_string(),
            approval: approval.map(str::to_string),
        };
        let (tx, rx) = bounded(1);
        let sender = self.writer_handle()?;
        sender
            .send(WriteReq { call, reply: tx })
            .map_err(|_| Error::Conflict("the store's writer has stopped".into()))?;
        rx.recv()
            .map_err(|_| Error::Conflict("the store's writer has stopped".into()))?
            .map_err(Error::Corrupt)
    }

    fn writer_handle(&self) -> Result<Sender<WriteReq>> {
        let mut guard = self
            .writer
            .lock()
            .map_err(|_| Error::Conflict("store writer lock poisoned".into()))?;
        if let Some(tx) = guard.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = bounded::<WriteReq>(GROUP_MAX);
        let db = Arc::clone(&self.db);
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || group_writer(&db, &rx))
            .map_err(|e| Error::Conflict(format!("cannot start the store's writer thread: {e}")))?;
        *guard = Some(tx.clone());
        Ok(tx)
    }
}

fn group_writer(db: &Reopening, rx: &Receiver<WriteReq>) {
    while let Some(batch) = crate::group::recv_batch(rx, GROUP_MAX) {
        let results: Result<Vec<(Value, bool)>> = (|| {
            let w = db.get().begin_write()?;
            let mut out = Vec::with_capacity(batch.len());
            for req in &batch {
                out.push(write_in(&w, &req.call)?);
            }
            w.commit()?;
            Ok(out)
        })();
        // The calls of a failed batch get the error (their outcome is for the caller to
        // settle); after a disk error the handle is opened again for the next batch.
        let results = results.map_err(|e| {
            db.after(&e);
            e.to_string()
        });
        match results {
            Ok(out) => {
                for (req, r) in batch.into_iter().zip(out) {
                    let _ = req.reply.send(Ok(r));
                }
            }
            Err(e) => {
                for req in batch {
                    let _ = req.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

fn log_arrival(
    w: &WriteTransaction,
    key: &str,
    tool: &str,
    digest: &str,
    outcome: &str,
) -> Result<()> {
    let mut t = w.open_table(ARRIVALS)?;
    let seq = t.last()?.map_or(1, |(k, _)| k.value() + 1);
    let a = Arrival {
        seq,
        key: key.to_string(),
        tool: tool.to_string(),
        digest: digest.to_string(),
        outcome: outcome.to_string(),
    };
    t.insert(seq, encode(&a)?.as_slice())?;
    Ok(())
}

/// One write call inside a (shared) write transaction: a stored result is replayed (or, for
/// other arguments under the same key, refused as a conflict); otherwise the store's rules
/// run, and an effect commits with its stored result and order change. The arrival is logged
/// in the same transaction.
fn write_in(w: &WriteTransaction, c: &WriteCall) -> Result<(Value, bool)> {
    let (scope, user, name, args, key) = (
        c.scope.as_str(),
        c.user.as_str(),
        c.name.as_str(),
        &c.args,
        c.key.as_str(),
    );
    let digest = crate::kernel::state::digest(name, args);
    let order_id = args.get("order_id").and_then(Value::as_str).unwrap_or("");
    let stored_id = scoped(scope, order_id);
    let mut done = w.open_table(DONE)?;
    if let Some(g) = done.get((key, name))? {
        let stored: Stored = decode("stored result", g.value())?;
        drop(g);
        if stored.digest != digest {
            log_arrival(w, key, name, &digest, "conflict")?;
            return Ok((
                serde_json::json!({"status": "error", "code": "key_conflict",
                    "detail": "this call key was used for a call with other arguments; nothing was done"}),
                false,
            ));
        }
        log_arrival(w, key, name, &digest, "replayed")?;
        return Ok((stored.result, true));
    }
    let mut orders_t = w.open_table(ORDERS)?;
    let mut orders = load_order(&orders_t, scope, order_id)?;
    let is_approved = c.approval.as_deref() == Some(digest.as_str());
    let approved = |_: &str, _: &str| is_approved;
    let (res, effect) = apply(&mut orders, &approved, user, name, args);
    let outcome = match (&effect, res.get("status").and_then(Value::as_str)) {
        (Some(_), _) => "applied",
        (None, Some("needs_approval")) => "needs_approval",
        _ => "refused",
    };
    log_arrival(w, key, name, &digest, outcome)?;
    if let Some(effect) = effect {
        for o in orders.values() {
            orders_t.insert(stored_id.as_str(), encode(o)?.as_slice())?;
        }
        let stored = Stored {
            digest,
            result: res.clone(),
        };
        done.insert((key, name), encode(&stored)?.as_slice())?;
        let mut ledger = w.open_table(LEDGER)?;
        let seq = ledger.last()?.map_or(1, |(k, _)| k.value() + 1);
        let entry = LedgerEntry {
            seq,
            scope: scope.to_string(),
            effect,
            key: key.to_string(),
            user: user.to_string(),
        };
        ledger.insert(seq, encode(&entry)?.as_slice())?;
    }
    Ok((res, false))
}

/// The one order a call names, as the book `apply` works on (empty if there is no such order).
fn load_order(
    t: &impl ReadableTable<&'static str, &'static [u8]>,
    scope: &str,
    order_id: &str,
) -> Result<BTreeMap<String, Order>> {
    // A '/' would reach into another tenant's book (`scope/order`): no such order here.
    if order_id.contains('/') {
        return Ok(BTreeMap::new());
    }
    let found = match t.get(scoped(scope, order_id).as_str())? {
        Some(g) => Some(decode::<Order>("order", g.value())?),
        None => fresh_copy(scope, order_id),
    };
    Ok(found
        .into_iter()
        .map(|o| (order_id.to_string(), o))
        .collect())
}

/// A tenant's first sight of one of the document's orders is a fresh copy of it.
fn fresh_copy(scope: &str, order_id: &str) -> Option<Order> {
    if scope.is_empty() {
        None
    } else {
        demo_orders().remove(order_id)
    }
}

/// The durable store as the tools of one task, with that task's latency overrides.
pub struct DurableTools<'a> {
    pub store: &'a DurableStore,
    pub scope: &'a str,
    pub latency_ms: &'a BTreeMap<String, u64>,
}

impl Tools for DurableTools<'_> {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply {
        let name = req.call.name.as_str();
        let write = req.access == crate::kernel::Access::Write;
        match self.store.call_once(
            self.scope,
            req.user_id,
            name,
            &req.call.args,
            req.key,
            write,
            req.approval,
        ) {
            Ok((mut result, true)) => {
                if let Some(o) = result.as_object_mut() {
                    o.insert("replayed".into(), Value::Bool(true));
                }
                ToolReply {
                    result,
                    latency_ms: REPLAY_LATENCY_MS,
                }
            }
            Ok((result, false)) => ToolReply {
                result,
                latency_ms: latency_ms(name, self.latency_ms.get(name).copied()),
            },
            // The service failed: for a write nobody knows whether it applied.
            Err(e) => ToolReply {
                result: if write {
                    serde_json::json!({"status": "unknown", "code": "store_error", "detail": e.to_string()})
                } else {
                    serde_json::json!({"status": "error", "code": "store_error", "detail": e.to_string()})
                },
                latency_ms: 0,
            },
        }
    }
}

fn scoped(scope: &str, order_id: &str) -> String {
    if scope.is_empty() {
        order_id.to_string()
    } else {
        format!("{scope}/{order_id}")
    }
}

/// The rows of the store's records (see [`crate::store::codec`]).
mod rows;
