//! `worker store` (the document's store: orders, ledger, arrivals) and `worker memory`.

use super::*;

pub(super) fn cmd_store(cli: &Cli, c: &StoreCommand) -> CliResult {
    let open = || DurableStore::open(&store_path(cli));
    match c {
        StoreCommand::Orders { json } => {
            let orders = open()?.orders()?;
            if *json {
                print_json(&serde_json::to_value(&orders).unwrap_or(Value::Null));
            } else {
                println!(
                    "{:16} {:10} {:>8} {:>8} status",
                    "order", "customer", "total", "refunded"
                );
                for (id, o) in &orders {
                    println!(
                        "{:16} {:10} {:>8} {:>8} {}",
                        id, o.customer, o.total, o.refunded, o.status
                    );
                }
            }
        }
        StoreCommand::AddOrder { orders } => {
            let mut parsed = Vec::new();
            for o in orders {
                let parts: Vec<&str> = o.split(':').collect();
                let [id, customer, total] = parts.as_slice() else {
                    return Err(CliError::usage(format!(
                        "--order {o:?}: expected ID:CUSTOMER:TOTAL_CENTS"
                    )));
                };
                let total: i64 = total.parse().ok().filter(|t| *t > 0).ok_or_else(|| {
                    CliError::usage(format!(
                        "--order {o:?}: total must be a positive whole number of cents"
                    ))
                })?;
                if id.is_empty() || customer.is_empty() || id.contains('/') {
                    return Err(CliError::usage(format!(
                        "--order {o:?}: id and customer must be non-empty (and the id without '/')"
                    )));
                }
                parsed.push((
                    id.to_string(),
                    Order {
                        customer: customer.to_string(),
                        total,
                        refunded: 0,
                        status: "delivered".into(),
                    },
                ));
            }
            open()?.put_orders(&parsed)?;
            println!("{} order(s) stored", parsed.len());
        }
        StoreCommand::Ledger { json } => {
            let ledger = open()?.ledger()?;
            if *json {
                print_json(&serde_json::to_value(&ledger).unwrap_or(Value::Null));
            } else {
                for e in &ledger {
                    println!("{:6} {:24} {}", e.seq, e.key, e.effect.to_python());
                }
            }
        }
        StoreCommand::Arrivals { json } => {
            let arrivals = open()?.arrivals()?;
            if *json {
                print_json(&serde_json::to_value(&arrivals).unwrap_or(Value::Null));
            } else {
                for a in &arrivals {
                    println!(
                        "{:6} {:24} {:18} {} {}",
                        a.seq, a.key, a.tool, a.digest, a.outcome
                    );
                }
            }
        }
    }
    Ok(())
}

pub(super) fn cmd_memory(cli: &Cli, c: &MemoryCommand) -> CliResult {
    match c {
        MemoryCommand::Add {
            user,
            text,
            source,
            ttl_days,
            by,
        } => {
            if user.trim().is_empty() {
                return Err(CliError::usage("--user must not be empty"));
            }
            let d = decision(by, &None)?;
            let store = Store::open(&cli.db, true)?;
            let note = store.add_note(user, text, source, ttl_days.saturating_mul(86_400), &d)?;
            println!(
                "stored for {} until {} (unix seconds)",
                note.user, note.expires_at_s
            );
        }
        MemoryCommand::List {
            user,
            all,
            json: as_json,
        } => {
            let notes = open_reader(cli)?.notes(user.as_deref(), now_ms(), *all)?;
            if *as_json {
                print_json(&serde_json::to_value(&notes).unwrap_or(Value::Null));
            } else {
                for n in &notes {
                    println!(
                        "{:10} {:16} expires {:>10}  {}",
                        n.user, n.source, n.expires_at_s, n.text
                    );
                }
            }
        }
        MemoryCommand::Forget { user, source, by } => {
            let d = decision(by, &None)?;
            let n = open_existing(cli)?.forget(user, source.as_deref(), &d)?;
            println!("{n} note(s) deleted");
        }
    }
    Ok(())
}
