//! The demo shop, durable: orders, the ledger of effects, stored results per call key and
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

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Effect, Order, REPLAY_LATENCY_MS, Tools, apply, demo_orders, latency_ms};
use crate::kernel::{ToolReply, ToolRequest};
use crate::store::{Opener, Result};

mod pg;
mod redb;
/// The rows of the store's records (see [`crate::store::codec`]).
mod rows;
/// The demo shop: in a redb file of its own beside the worker's file, or in its own
/// schema of the worker's PostgreSQL database, so a task taken over on another host sees the
/// same effects. Every method means the same on both.
pub struct DurableStore {
    inner: Inner,
    /// The file, or where the database is (never a password).
    pub path: PathBuf,
}

enum Inner {
    Redb(redb::RedbStore),
    Pg(Box<pg::PgBookStore>),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match &$self.inner {
            Inner::Redb($s) => $e,
            Inner::Pg($s) => $e,
        }
    };
}

impl DurableStore {
    /// Opens the store file, creating it with the design reference's two orders if it is new.
    pub fn open(path: &Path) -> Result<DurableStore> {
        Ok(DurableStore {
            inner: Inner::Redb(redb::RedbStore::open(path)?),
            path: path.to_path_buf(),
        })
    }

    /// Opens the store `db` names: a PostgreSQL URL (the store's schema beside the worker's)
    /// or a file.
    pub fn open_target(db: &str) -> Result<DurableStore> {
        DurableStore::open_sized(db, 4)
    }

    /// [`DurableStore::open_target`] with a PostgreSQL pool of `connections` (a daemon's
    /// threads call the store at once).
    pub fn open_sized(db: &str, connections: usize) -> Result<DurableStore> {
        if crate::store::pg::is_url(db) {
            let book = pg::PgBookStore::open(db, connections)?;
            let path = PathBuf::from(book.display());
            return Ok(DurableStore {
                inner: Inner::Pg(Box::new(book)),
                path,
            });
        }
        DurableStore::open(Path::new(db))
    }

    /// Opens the store file with `open`, which makes a fresh handle each time it is called
    /// (again after an I/O error); tests pass one over a storage backend that fails on demand.
    pub fn open_with(path: &Path, open: Opener) -> Result<DurableStore> {
        Ok(DurableStore {
            inner: Inner::Redb(redb::RedbStore::open_with(path, open)?),
            path: path.to_path_buf(),
        })
    }

    /// Adds orders, or changes the customer and total of existing ones: what was refunded
    /// stays (a total below it is refused), so re-adding an order never undoes refunds.
    pub fn put_orders(&self, orders: &[(String, Order)]) -> Result<()> {
        both!(self, s => s.put_orders(orders))
    }

    pub fn orders(&self) -> Result<BTreeMap<String, Order>> {
        both!(self, s => s.orders())
    }

    pub fn ledger(&self) -> Result<Vec<LedgerEntry>> {
        both!(self, s => s.ledger())
    }

    /// The stored result of a call key, if the write took effect: what a lookup endpoint answers.
    pub fn lookup(&self, key: &str, tool: &str) -> Result<Option<Value>> {
        both!(self, s => s.lookup(key, tool))
    }

    /// Every write request that reached the store, in order.
    pub fn arrivals(&self) -> Result<Vec<Arrival>> {
        both!(self, s => s.arrivals())
    }

    /// Decodes every record of the store; returns how many were read and the damaged ones.
    pub fn check(&self) -> Result<(u64, Vec<String>)> {
        both!(self, s => s.check())
    }

    /// Logs a write request that the HTTP front answered without reaching the store's rules
    /// (a stored response, a conflicting payload, a key in flight).
    pub fn arrive(&self, key: &str, tool: &str, digest: &str, outcome: &str) -> Result<()> {
        both!(self, s => s.arrive(key, tool, digest, outcome))
    }

    /// The HTTP service's stored response for an idempotency key: (payload digest, response).
    pub fn idempotent_response(&self, key: &str) -> Result<Option<(String, Value)>> {
        both!(self, s => s.idempotent_response(key))
    }

    pub fn remember_response(&self, key: &str, digest: &str, response: &Value) -> Result<()> {
        both!(self, s => s.remember_response(key, digest, response))
    }

    /// One call as the service runs it. Errors of the store itself become error results.
    ///
    /// `scope` names a tenant: its orders are stored apart, and the first time a scope touches
    /// one of the design reference's order ids it gets a fresh copy of that order, so each demo task
    /// runs against the demo shop as it starts out. `approval` is the digest an
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
            let mut orders = both!(self, s => s.read_order(scope, order_id))?;
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
        both!(self, s => s.write(call))
    }
}

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
    /// Digest of tool and args (the design reference's).
    pub digest: String,
    /// `applied`, `replayed` (a stored result answered it), `needs_approval`, `conflict` (the
    /// key was used for other arguments), `in_flight`, or `refused` (an error, nothing done).
    pub outcome: String,
}

/// What a stored result of a write keeps: the result, and the digest of the call it answers.
#[derive(Serialize, Deserialize)]
pub(crate) struct Stored {
    pub digest: String,
    pub result: Value,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct IdempotencyRecord {
    pub digest: String,
    pub response: Value,
}

/// One write call, owned, for the group-commit thread.
pub(crate) struct WriteCall {
    pub scope: String,
    pub user: String,
    pub name: String,
    pub args: serde_json::Map<String, Value>,
    pub key: String,
    pub approval: Option<String>,
}

/// The storage one write call runs in: a redb write transaction or a PostgreSQL one. The
/// call's rules ([`write_in`]) are written once, against it.
pub(crate) trait Book {
    /// The stored result of `key` for `tool`, if that write took effect.
    fn done(&mut self, key: &str, tool: &str) -> Result<Option<Stored>>;
    fn put_done(&mut self, key: &str, tool: &str, stored: &Stored) -> Result<()>;
    /// The stored order under `stored_id` (a tenant's id is `scope/order`).
    fn order(&mut self, stored_id: &str) -> Result<Option<Order>>;
    fn put_order(&mut self, stored_id: &str, o: &Order) -> Result<()>;
    fn arrival(&mut self, key: &str, tool: &str, digest: &str, outcome: &str) -> Result<()>;
    fn ledger(&mut self, scope: &str, effect: &Effect, key: &str, user: &str) -> Result<()>;
}

/// One write call inside a (shared) write transaction: a stored result is replayed (or, for
/// other arguments under the same key, refused as a conflict); otherwise the store's rules
/// run, and an effect commits with its stored result and order change. The arrival is logged
/// in the same transaction.
pub(crate) fn write_in(b: &mut dyn Book, c: &WriteCall) -> Result<(Value, bool)> {
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
    if let Some(stored) = b.done(key, name)? {
        if stored.digest != digest {
            b.arrival(key, name, &digest, "conflict")?;
            return Ok((
                serde_json::json!({"status": "error", "code": "key_conflict",
                    "detail": "this call key was used for a call with other arguments; nothing was done"}),
                false,
            ));
        }
        b.arrival(key, name, &digest, "replayed")?;
        return Ok((stored.result, true));
    }
    let mut orders = book_of(b, scope, order_id)?;
    let is_approved = c.approval.as_deref() == Some(digest.as_str());
    let approved = |_: &str, _: &str| is_approved;
    let (res, effect) = apply(&mut orders, &approved, user, name, args);
    let outcome = match (&effect, res.get("status").and_then(Value::as_str)) {
        (Some(_), _) => "applied",
        (None, Some("needs_approval")) => "needs_approval",
        _ => "refused",
    };
    b.arrival(key, name, &digest, outcome)?;
    if let Some(effect) = effect {
        for o in orders.values() {
            b.put_order(&stored_id, o)?;
        }
        let stored = Stored {
            digest,
            result: res.clone(),
        };
        b.put_done(key, name, &stored)?;
        b.ledger(scope, &effect, key, user)?;
    }
    Ok((res, false))
}

/// Adds orders, or changes the customer and total of existing ones, in `b`: what was refunded
/// stays (a total below it is refused), so re-adding an order never undoes refunds.
pub(crate) fn put_orders_in(b: &mut dyn Book, orders: &[(String, Order)]) -> Result<()> {
    for (id, o) in orders {
        let mut o = o.clone();
        if let Some(old) = b.order(id)? {
            if o.total < old.refunded {
                return Err(crate::store::Error::Invalid(format!(
                    "order {id}: a total of {} is below the {} already refunded",
                    o.total, old.refunded
                )));
            }
            o.refunded = old.refunded;
            o.status = old.status;
        }
        b.put_order(id, &o)?;
    }
    Ok(())
}

/// The one order a call names, as the book `apply` works on, read through a [`Book`].
fn book_of(b: &mut dyn Book, scope: &str, order_id: &str) -> Result<BTreeMap<String, Order>> {
    if order_id.contains('/') {
        return Ok(BTreeMap::new());
    }
    let found = match b.order(&scoped(scope, order_id))? {
        Some(o) => Some(o),
        None => fresh_copy(scope, order_id),
    };
    Ok(found
        .into_iter()
        .map(|o| (order_id.to_string(), o))
        .collect())
}

/// A tenant's first sight of one of the design reference's orders is a fresh copy of it.
pub(crate) fn fresh_copy(scope: &str, order_id: &str) -> Option<Order> {
    if scope.is_empty() {
        None
    } else {
        demo_orders().remove(order_id)
    }
}

/// The demo shop as a daemon's route: opened the first time a task calls one of its tools,
/// so a daemon whose tasks never name it never opens it; or handed in already open. A failed
/// open is tried again at the next call.
pub struct DemoShop {
    target: String,
    connections: usize,
    shop: std::sync::Mutex<Option<Arc<DurableStore>>>,
}

impl DemoShop {
    /// The demo shop at `target` (a redb path or a PostgreSQL URL), not opened yet.
    pub fn at(target: &str, connections: usize) -> DemoShop {
        DemoShop {
            target: target.to_string(),
            connections,
            shop: std::sync::Mutex::new(None),
        }
    }

    /// A demo shop already open.
    pub fn opened(shop: Arc<DurableStore>) -> DemoShop {
        DemoShop {
            target: String::new(),
            connections: 1,
            shop: std::sync::Mutex::new(Some(shop)),
        }
    }

    /// The open demo shop, opening it on first use.
    pub fn get(&self) -> std::result::Result<Arc<DurableStore>, String> {
        let mut shop = self.shop.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = shop.as_ref() {
            return Ok(Arc::clone(s));
        }
        let opened = Arc::new(
            DurableStore::open_sized(&self.target, self.connections)
                .map_err(|e| format!("the demo shop at {} cannot be opened: {e}", self.target))?,
        );
        *shop = Some(Arc::clone(&opened));
        Ok(opened)
    }

    /// Whether the shop is open on a local file, whose reads take microseconds (a read may
    /// then run in place on an executor's thread; one to a database server may not).
    pub fn is_open_locally(&self) -> bool {
        let shop = self.shop.lock().unwrap_or_else(|e| e.into_inner());
        shop.as_ref()
            .is_some_and(|s| matches!(s.inner, Inner::Redb(_)))
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

pub(crate) fn scoped(scope: &str, order_id: &str) -> String {
    if scope.is_empty() {
        order_id.to_string()
    } else {
        format!("{scope}/{order_id}")
    }
}
