//! The demo shop in a redb file of its own: orders, ledger, stored results, arrivals
//! and idempotency records, with one thread that groups concurrent write calls into one
//! transaction (as a service handling many clients would).

use crossbeam_channel::{Receiver, Sender, bounded};
use redb::{
    ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::{
    Arrival, Book, IdempotencyRecord, LedgerEntry, Stored, WriteCall, fresh_copy, put_orders_in,
    scoped, write_in,
};
use crate::store::codec::{decode, encode};
use crate::store::{Error, Opener, Reopening, Result};
use crate::tools::{Effect, Order, demo_orders};

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

/// The tables a store file may hold (and the one of its first release, `done`).
const STORE_TABLES: [&str; 7] = [
    "orders",
    "ledger",
    "done",
    "done_v2",
    "arrivals",
    "idempotency",
    "format",
];
const FORMAT_KEY: &str = "format";
const STORE_FORMAT: u64 = 2;

pub struct RedbStore {
    /// Opened again after an I/O error (a full disk freed again), without a restart.
    db: Arc<Reopening>,
    /// Write calls go through one thread that groups concurrent calls into one transaction
    /// (started on the first write), as a service handling many clients would.
    writer: Mutex<Option<Sender<WriteReq>>>,
}

struct WriteReq {
    call: WriteCall,
    reply: Sender<std::result::Result<(Value, bool), String>>,
}

/// Largest number of write calls grouped into one transaction.
const GROUP_MAX: usize = 128;

impl RedbStore {
    /// Opens the store file, creating it with the design reference's two orders if it is new.
    pub fn open(path: &Path) -> Result<RedbStore> {
        if path.exists() {
            crate::store::check_not_empty(path)?;
        } else {
            crate::store::create_redb(path)?;
        }
        let p = path.to_path_buf();
        RedbStore::open_with(
            path,
            Arc::new(move || crate::store::open_redb(&p, 16 << 20)),
        )
    }

    /// Opens the store with `open`, which makes a fresh handle each time it is called (again
    /// after an I/O error); tests pass one over a storage backend that fails on demand.
    pub fn open_with(path: &Path, open: Opener) -> Result<RedbStore> {
        let s = RedbStore {
            db: Arc::new(Reopening::new(open)?),
            writer: Mutex::new(None),
        };
        let format = {
            let r = s.db.get()?.begin_read()?;
            match r.open_table(FORMAT) {
                Ok(t) => t.get(FORMAT_KEY)?.map(|g| g.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            }
        };
        match format {
            Some(v) if v > STORE_FORMAT => {
                return Err(Error::NewerVersion {
                    what: format!("demo shop {}", path.display()),
                    found: v,
                    supported: STORE_FORMAT,
                });
            }
            Some(_) => {}
            None => {
                // A new file, or one written as JSON records: seed or rewrite it, at once. A
                // worker database (or any file with tables of another kind) is refused, never
                // seeded: it is judged inside the write.
                let w = s.db.get()?.begin_write()?;
                {
                    use redb::TableHandle;
                    let foreign: Vec<String> = w
                        .list_tables()
                        .map_err(redb::Error::from)?
                        .map(|t| t.name().to_string())
                        .filter(|n| !STORE_TABLES.contains(&n.as_str()))
                        .collect();
                    if !foreign.is_empty() {
                        drop(w);
                        return Err(Error::Io {
                            path: path.to_path_buf(),
                            source: std::io::Error::other(format!(
                                "it is not the demo shop's file (it has the tables {}); is it the worker database (--db)?",
                                foreign.join(", ")
                            )),
                        });
                    }
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
        let w = self.db.get()?.begin_write()?;
        put_orders_in(&mut RedbBook(&w), orders)?;
        w.commit()?;
        Ok(())
    }

    pub fn orders(&self) -> Result<BTreeMap<String, Order>> {
        let r = self.db.get()?.begin_read()?;
        let t = r.open_table(ORDERS)?;
        let mut out = BTreeMap::new();
        for e in t.iter()? {
            let (k, v) = e?;
            out.insert(k.value().to_string(), decode("order", v.value())?);
        }
        Ok(out)
    }

    pub fn ledger(&self) -> Result<Vec<LedgerEntry>> {
        let r = self.db.get()?.begin_read()?;
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
        let r = self.db.get()?.begin_read()?;
        let t = r.open_table(DONE)?;
        match t.get((key, tool))? {
            Some(g) => Ok(Some(decode::<Stored>("stored result", g.value())?.result)),
            None => Ok(None),
        }
    }

    /// Every write request that reached the store, in order.
    pub fn arrivals(&self) -> Result<Vec<Arrival>> {
        let r = self.db.get()?.begin_read()?;
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
        let r = self.db.get()?.begin_read()?;
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
                                bad.push(format!("demo shop {} {:?}: {e}", $what, k.value()));
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
        let w = self.db.get()?.begin_write()?;
        log_arrival(&w, key, tool, digest, outcome)?;
        w.commit()?;
        Ok(())
    }

    /// The HTTP service's stored response for an idempotency key: (payload digest, response).
    pub fn idempotent_response(&self, key: &str) -> Result<Option<(String, Value)>> {
        let r = self.db.get()?.begin_read()?;
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
        let w = self.db.get()?.begin_write()?;
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

    /// The one order a read call names.
    pub fn read_order(&self, scope: &str, order_id: &str) -> Result<BTreeMap<String, Order>> {
        let r = self.db.get()?.begin_read()?;
        load_order(&r.open_table(ORDERS)?, scope, order_id)
    }

    /// One write call, through the group-commit thread.
    pub fn write(&self, call: WriteCall) -> Result<(Value, bool)> {
        let (tx, rx) = bounded(1);
        let sender = self.writer_handle()?;
        sender
            .send(WriteReq { call, reply: tx })
            .map_err(|_| Error::Conflict("the demo shop's writer has stopped".into()))?;
        rx.recv()
            .map_err(|_| Error::Conflict("the demo shop's writer has stopped".into()))?
            .map_err(Error::Corrupt)
    }

    fn writer_handle(&self) -> Result<Sender<WriteReq>> {
        let mut guard = self
            .writer
            .lock()
            .map_err(|_| Error::Conflict("the demo shop's writer lock is poisoned".into()))?;
        if let Some(tx) = guard.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = bounded::<WriteReq>(GROUP_MAX);
        let db = Arc::clone(&self.db);
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || group_writer(&db, &rx))
            .map_err(|e| {
                Error::Conflict(format!("cannot start the demo shop's writer thread: {e}"))
            })?;
        *guard = Some(tx.clone());
        Ok(tx)
    }
}

fn group_writer(db: &Reopening, rx: &Receiver<WriteReq>) {
    while let Some(batch) = crate::group::recv_batch(rx, GROUP_MAX) {
        let results: Result<Vec<(Value, bool)>> = (|| {
            let w = db.get()?.begin_write()?;
            let mut out = Vec::with_capacity(batch.len());
            for req in &batch {
                out.push(write_in(&mut RedbBook(&w), &req.call)?);
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

/// The redb file's write transaction as a [`Book`].
struct RedbBook<'a>(&'a WriteTransaction);

impl Book for RedbBook<'_> {
    fn done(&mut self, key: &str, tool: &str) -> Result<Option<Stored>> {
        let t = self.0.open_table(DONE)?;
        let g = t.get((key, tool))?;
        g.map(|g| decode("stored result", g.value())).transpose()
    }

    fn put_done(&mut self, key: &str, tool: &str, stored: &Stored) -> Result<()> {
        self.0
            .open_table(DONE)?
            .insert((key, tool), encode(stored)?.as_slice())?;
        Ok(())
    }

    fn order(&mut self, stored_id: &str) -> Result<Option<Order>> {
        let t = self.0.open_table(ORDERS)?;
        let g = t.get(stored_id)?;
        g.map(|g| decode("order", g.value())).transpose()
    }

    fn put_order(&mut self, stored_id: &str, o: &Order) -> Result<()> {
        self.0
            .open_table(ORDERS)?
            .insert(stored_id, encode(o)?.as_slice())?;
        Ok(())
    }

    fn arrival(&mut self, key: &str, tool: &str, digest: &str, outcome: &str) -> Result<()> {
        log_arrival(self.0, key, tool, digest, outcome)
    }

    fn ledger(&mut self, scope: &str, effect: &Effect, key: &str, user: &str) -> Result<()> {
        let mut ledger = self.0.open_table(LEDGER)?;
        let seq = ledger.last()?.map_or(1, |(k, _)| k.value() + 1);
        let entry = LedgerEntry {
            seq,
            scope: scope.to_string(),
            effect: effect.clone(),
            key: key.to_string(),
            user: user.to_string(),
        };
        ledger.insert(seq, encode(&entry)?.as_slice())?;
        Ok(())
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
