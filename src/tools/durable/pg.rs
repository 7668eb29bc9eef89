//! The demo shop in PostgreSQL, in its own schema (`<schema>_store`) of the worker's
//! database: a task taken over on another host sees the same orders, ledger and stored
//! results. A write call is one transaction, under advisory locks on its call key and its
//! order (so concurrent calls from several hosts are serialized as one service would), with
//! the same rules as the file (see [`super::write_in`]) and the same lost-acknowledgment
//! handling as the worker's commits.

use postgres::Transaction;
use postgres::types::Json;
use serde_json::Value;
use std::collections::BTreeMap;

use super::{
    Arrival, Book, LedgerEntry, Stored, WriteCall, fresh_copy, put_orders_in, scoped, write_in,
};
use crate::store::pg::PgStore;
use crate::store::{Error, Result};
use crate::tools::{Effect, Order, demo_orders};

pub struct PgBookStore {
    pg: PgStore,
}

/// A PostgreSQL error inside a store transaction: a lost connection is `Unavailable`, which
/// makes [`PgStore::write`] run the transaction again (nothing of it can have landed before
/// its COMMIT); an error the server answered is final.
fn db(e: postgres::Error) -> Error {
    crate::store::pg::db_error(e)
}

fn from_json<T: serde::de::DeserializeOwned>(v: Value, what: &str) -> Result<T> {
    serde_json::from_value(v).map_err(|e| Error::Corrupt(format!("demo shop {what}: {e}")))
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<Value> {
    serde_json::to_value(v).map_err(|e| Error::Invalid(e.to_string()))
}

/// A PostgreSQL transaction as a [`Book`].
struct PgBook<'s, 'a, 'b> {
    s: &'s PgStore,
    tx: &'a mut Transaction<'b>,
}

impl Book for PgBook<'_, '_, '_> {
    fn done(&mut self, key: &str, tool: &str) -> Result<Option<Stored>> {
        let sql = self
            .s
            .sql("SELECT digest, result FROM {t}.done WHERE key = $1 AND tool = $2");
        let row = self.tx.query_opt(&sql, &[&key, &tool]).map_err(db)?;
        Ok(row.map(|r| Stored {
            digest: r.get(0),
            result: r.get::<_, Json<Value>>(1).0,
        }))
    }

    fn put_done(&mut self, key: &str, tool: &str, stored: &Stored) -> Result<()> {
        let sql = self.s.sql(
            "INSERT INTO {t}.done (key, tool, digest, result) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (key, tool) DO UPDATE SET digest = EXCLUDED.digest, result = EXCLUDED.result",
        );
        self.tx
            .execute(&sql, &[&key, &tool, &stored.digest, &Json(&stored.result)])
            .map_err(db)?;
        Ok(())
    }

    fn order(&mut self, stored_id: &str) -> Result<Option<Order>> {
        let sql = self
            .s
            .sql("SELECT body FROM {t}.orders WHERE id = $1 FOR UPDATE");
        let row = self.tx.query_opt(&sql, &[&stored_id]).map_err(db)?;
        row.map(|r| from_json(r.get::<_, Json<Value>>(0).0, "order"))
            .transpose()
    }

    fn put_order(&mut self, stored_id: &str, o: &Order) -> Result<()> {
        let sql = self.s.sql(
            "INSERT INTO {t}.orders (id, body) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body",
        );
        self.tx
            .execute(&sql, &[&stored_id, &Json(to_json(o)?)])
            .map_err(db)?;
        Ok(())
    }

    fn arrival(&mut self, key: &str, tool: &str, digest: &str, outcome: &str) -> Result<()> {
        let sql = self
            .s
            .sql("INSERT INTO {t}.arrivals (key, tool, digest, outcome) VALUES ($1, $2, $3, $4)");
        self.tx
            .execute(&sql, &[&key, &tool, &digest, &outcome])
            .map_err(db)?;
        Ok(())
    }

    fn ledger(&mut self, scope: &str, effect: &Effect, key: &str, user: &str) -> Result<()> {
        let sql = self
            .s
            .sql("INSERT INTO {t}.ledger (scope, effect, key, user_id) VALUES ($1, $2, $3, $4)");
        self.tx
            .execute(&sql, &[&scope, &Json(to_json(effect)?), &key, &user])
            .map_err(db)?;
        Ok(())
    }
}

/// Serializes the write calls on one call key or one order, across hosts.
fn lock(tx: &mut Transaction<'_>, what: &str) -> Result<()> {
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        &[&format!("tether-store:{what}")],
    )
    .map_err(db)?;
    Ok(())
}

impl PgBookStore {
    /// Connects (the worker's schema and the store's are migrated together) and seeds the
    /// document's two orders into an empty book.
    pub fn open(url: &str, connections: usize) -> Result<PgBookStore> {
        let pg = PgStore::open(url, true, connections, crate::store::pg::DAEMON_RETRY)?;
        let s = PgBookStore { pg };
        let count = s.pg.sql("SELECT count(*) FROM {t}.orders");
        let insert = s
            .pg
            .sql("INSERT INTO {t}.orders (id, body) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING");
        s.pg.write(|tx| {
            let n: i64 = tx.query_one(&count, &[]).map_err(db)?.get(0);
            if n == 0 {
                for (id, o) in demo_orders() {
                    tx.execute(&insert, &[&id, &Json(to_json(&o)?)])
                        .map_err(db)?;
                }
            }
            Ok(())
        })?;
        Ok(s)
    }

    pub fn display(&self) -> String {
        format!("{} (schema {}_store)", self.pg.display(), self.pg.schema())
    }

    pub fn put_orders(&self, orders: &[(String, Order)]) -> Result<()> {
        self.pg
            .write(|tx| put_orders_in(&mut PgBook { s: &self.pg, tx }, orders))
    }

    pub fn orders(&self) -> Result<BTreeMap<String, Order>> {
        let sql = self.pg.sql("SELECT id, body FROM {t}.orders ORDER BY id");
        let rows = self.pg.read(|c| c.client.query(&sql, &[]))?;
        rows.iter()
            .map(|r| Ok((r.get(0), from_json(r.get::<_, Json<Value>>(1).0, "order")?)))
            .collect()
    }

    pub fn ledger(&self) -> Result<Vec<LedgerEntry>> {
        let sql = self
            .pg
            .sql("SELECT seq, scope, effect, key, user_id FROM {t}.ledger ORDER BY seq");
        let rows = self.pg.read(|c| c.client.query(&sql, &[]))?;
        rows.iter()
            .map(|r| {
                Ok(LedgerEntry {
                    seq: u64::try_from(r.get::<_, i64>(0)).unwrap_or(0),
                    scope: r.get(1),
                    effect: from_json(r.get::<_, Json<Value>>(2).0, "ledger entry")?,
                    key: r.get(3),
                    user: r.get(4),
                })
            })
            .collect()
    }

    pub fn lookup(&self, key: &str, tool: &str) -> Result<Option<Value>> {
        let sql = self
            .pg
            .sql("SELECT result FROM {t}.done WHERE key = $1 AND tool = $2");
        let row = self.pg.read(|c| c.client.query_opt(&sql, &[&key, &tool]))?;
        Ok(row.map(|r| r.get::<_, Json<Value>>(0).0))
    }

    pub fn arrivals(&self) -> Result<Vec<Arrival>> {
        let sql = self
            .pg
            .sql("SELECT seq, key, tool, digest, outcome FROM {t}.arrivals ORDER BY seq");
        let rows = self.pg.read(|c| c.client.query(&sql, &[]))?;
        Ok(rows
            .iter()
            .map(|r| Arrival {
                seq: u64::try_from(r.get::<_, i64>(0)).unwrap_or(0),
                key: r.get(1),
                tool: r.get(2),
                digest: r.get(3),
                outcome: r.get(4),
            })
            .collect())
    }

    pub fn check(&self) -> Result<(u64, Vec<String>)> {
        let mut bad = Vec::new();
        let orders = self.pg.sql("SELECT id, body FROM {t}.orders");
        let rows = self.pg.read(|c| c.client.query(&orders, &[]))?;
        for r in &rows {
            if let Err(e) = from_json::<Order>(r.get::<_, Json<Value>>(1).0, "order") {
                bad.push(format!("demo shop order {:?}: {e}", r.get::<_, String>(0)));
            }
        }
        let n = rows.len() as u64 + self.ledger()?.len() as u64 + self.arrivals()?.len() as u64;
        Ok((n, bad))
    }

    pub fn arrive(&self, key: &str, tool: &str, digest: &str, outcome: &str) -> Result<()> {
        self.pg
            .write(|tx| PgBook { s: &self.pg, tx }.arrival(key, tool, digest, outcome))
    }

    pub fn idempotent_response(&self, key: &str) -> Result<Option<(String, Value)>> {
        let sql = self
            .pg
            .sql("SELECT digest, response FROM {t}.idempotency WHERE key = $1");
        let row = self.pg.read(|c| c.client.query_opt(&sql, &[&key]))?;
        Ok(row.map(|r| (r.get(0), r.get::<_, Json<Value>>(1).0)))
    }

    pub fn remember_response(&self, key: &str, digest: &str, response: &Value) -> Result<()> {
        let sql = self.pg.sql(
            "INSERT INTO {t}.idempotency (key, digest, response) VALUES ($1, $2, $3) \
             ON CONFLICT (key) DO UPDATE SET digest = EXCLUDED.digest, response = EXCLUDED.response",
        );
        self.pg.write(|tx| {
            tx.execute(&sql, &[&key, &digest, &Json(response)])
                .map_err(db)?;
            Ok(())
        })
    }

    pub fn read_order(&self, scope: &str, order_id: &str) -> Result<BTreeMap<String, Order>> {
        if order_id.contains('/') {
            return Ok(BTreeMap::new());
        }
        let sql = self.pg.sql("SELECT body FROM {t}.orders WHERE id = $1");
        let id = scoped(scope, order_id);
        let rows = self.pg.query(&sql, &[&id])?;
        let found = match rows.first() {
            Some(r) => Some(from_json(r.get::<_, Json<Value>>(0).0, "order")?),
            None => fresh_copy(scope, order_id),
        };
        Ok(found
            .into_iter()
            .map(|o| (order_id.to_string(), o))
            .collect())
    }

    pub fn write(&self, call: WriteCall) -> Result<(Value, bool)> {
        let order_id = call
            .args
            .get("order_id")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        self.pg.write(|tx| {
            lock(tx, &format!("key:{}", call.key))?;
            lock(tx, &format!("order:{}", scoped(&call.scope, &order_id)))?;
            write_in(&mut PgBook { s: &self.pg, tx }, &call)
        })
    }
}
