//! The demo shop's arguments: where its database is (`--store`, only on the verbs that reach
//! it), its own verbs, and the demo's server and walkthrough.

use super::*;

/// Where the demo shop is, for the verbs that reach it.
#[derive(Args, Debug, Clone, Default)]
pub struct ShopArg {
    /// The demo shop's database (orders, refund ledger, stored results of its writes), for
    /// tasks that call its tools; default: <db>.store.redb beside a file --db, or the same
    /// PostgreSQL database.
    #[arg(long = "store", env = "WORKER_STORE", value_name = "FILE|URL")]
    pub store: Option<String>,
}

/// The demo shop's verbs, with `--store` before or after the verb.
#[derive(Args, Debug)]
pub struct StoreArgs {
    /// The demo shop's database; default: <db>.store.redb beside a file --db, or the same
    /// PostgreSQL database.
    #[arg(
        long = "store",
        env = "WORKER_STORE",
        value_name = "FILE|URL",
        global = true
    )]
    pub store: Option<String>,
    #[command(subcommand)]
    pub command: StoreCommand,
}

impl StoreArgs {
    pub fn shop(&self) -> ShopArg {
        ShopArg {
            store: self.store.clone(),
        }
    }
}

#[derive(Args, Debug)]
pub struct DemoStoreArgs {
    /// Address to listen on; port 0 picks a free one (printed on the first line of stdout).
    #[arg(long, default_value = "127.0.0.1:8700")]
    pub listen: String,
    /// Connections served at once (one thread each). When all are open, a new one takes the
    /// place of the one that has waited longest for a request; it is answered 503 only when
    /// every open connection is inside a call.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub connections: u16,
    /// A request must arrive whole within this many ms of its first byte (408 after).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub read_timeout_ms: u64,
    /// Fault: added latency of every tool call, in ms.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Fault: fraction of writes whose response is lost after the write was applied.
    #[arg(long, default_value_t = 0.0)]
    pub lose_rate: f64,
    /// Fault: fraction of calls answered 503 before anything is applied.
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Seed of the fault draws.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The environment variable holding the secret approvals are signed with (the workers'
    /// catalog names the same one as the tool's approval_secret_env). Unset: no approved
    /// call is accepted.
    #[arg(long, default_value = "TETHER_APPROVAL_SECRET", value_name = "VAR")]
    pub approval_secret_env: String,
    #[command(flatten)]
    pub shop: ShopArg,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Retired: tasks no longer hold a thread each.
    #[arg(long, hide = true, value_name = "N")]
    pub workers: Option<String>,
    /// Keep the demo's database files in this directory instead of a temporary one.
    #[arg(long)]
    pub keep: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// List the demo shop's orders.
    Orders {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Add orders, or change the customer and total of existing ones (their refunds stay): --order ID:CUSTOMER:TOTAL_CENTS, repeatable.
    #[command(
        after_help = "Example:\n  worker store add-order --order ord_2001:cu_bo:4200 --order ord_2002:cu_cy:15000"
    )]
    AddOrder {
        /// An order: its id, its customer's user id, its total in cents.
        #[arg(
            long = "order",
            value_name = "ID:CUSTOMER:TOTAL_CENTS",
            required = true
        )]
        orders: Vec<String>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The ledger of effects (refunds and emails), in order.
    Ledger {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every write request that reached the store (applied, replayed, refused, ...), in order:
    /// where a duplicate send shows even when the stored result hid it.
    Arrivals {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}
