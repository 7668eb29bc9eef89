//! The rows of the demo shop: what [`crate::store::codec`] stores for each of its
//! records (orders, ledger entries, arrivals, stored results, idempotency records).

use super::{Arrival, Effect, IdempotencyRecord, LedgerEntry, Order, Stored};
use crate::store::codec::{Json, Record};
use serde::{Deserialize, Serialize};

type R<T> = std::result::Result<T, String>;

#[derive(Serialize, Deserialize)]
pub struct OrderRow {
    customer: String,
    total: i64,
    refunded: i64,
    status: String,
}

impl Record for Order {
    type Row = OrderRow;
    fn to_row(&self) -> OrderRow {
        OrderRow {
            customer: self.customer.clone(),
            total: self.total,
            refunded: self.refunded,
            status: self.status.clone(),
        }
    }
    fn from_row(r: OrderRow) -> R<Order> {
        Ok(Order {
            customer: r.customer,
            total: r.total,
            refunded: r.refunded,
            status: r.status,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub enum EffectRow {
    Refund { order: String, amount_cents: i64 },
    Email { order: String },
}

#[derive(Serialize, Deserialize)]
pub struct LedgerRow {
    seq: u64,
    scope: String,
    effect: EffectRow,
    key: String,
    user: String,
}

impl Record for LedgerEntry {
    type Row = LedgerRow;
    fn to_row(&self) -> LedgerRow {
        LedgerRow {
            seq: self.seq,
            scope: self.scope.clone(),
            effect: match &self.effect {
                Effect::Refund {
                    order,
                    amount_cents,
                } => EffectRow::Refund {
                    order: order.clone(),
                    amount_cents: *amount_cents,
                },
                Effect::Email { order } => EffectRow::Email {
                    order: order.clone(),
                },
            },
            key: self.key.clone(),
            user: self.user.clone(),
        }
    }
    fn from_row(r: LedgerRow) -> R<LedgerEntry> {
        Ok(LedgerEntry {
            seq: r.seq,
            scope: r.scope,
            effect: match r.effect {
                EffectRow::Refund {
                    order,
                    amount_cents,
                } => Effect::Refund {
                    order,
                    amount_cents,
                },
                EffectRow::Email { order } => Effect::Email { order },
            },
            key: r.key,
            user: r.user,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub struct ArrivalRow {
    seq: u64,
    key: String,
    tool: String,
    digest: String,
    outcome: String,
}

impl Record for Arrival {
    type Row = ArrivalRow;
    fn to_row(&self) -> ArrivalRow {
        ArrivalRow {
            seq: self.seq,
            key: self.key.clone(),
            tool: self.tool.clone(),
            digest: self.digest.clone(),
            outcome: self.outcome.clone(),
        }
    }
    fn from_row(r: ArrivalRow) -> R<Arrival> {
        Ok(Arrival {
            seq: r.seq,
            key: r.key,
            tool: r.tool,
            digest: r.digest,
            outcome: r.outcome,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub struct StoredRow {
    digest: String,
    result: Json,
}

impl Record for Stored {
    type Row = StoredRow;
    fn to_row(&self) -> StoredRow {
        StoredRow {
            digest: self.digest.clone(),
            result: Json::of(&self.result),
        }
    }
    fn from_row(r: StoredRow) -> R<Stored> {
        Ok(Stored {
            digest: r.digest,
            result: r.result.value()?,
        })
    }
}

impl Record for IdempotencyRecord {
    type Row = StoredRow;
    fn to_row(&self) -> StoredRow {
        StoredRow {
            digest: self.digest.clone(),
            result: Json::of(&self.response),
        }
    }
    fn from_row(r: StoredRow) -> R<IdempotencyRecord> {
        Ok(IdempotencyRecord {
            digest: r.digest,
            response: r.result.value()?,
        })
    }
}
