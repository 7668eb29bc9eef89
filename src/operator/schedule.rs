//! Schedules: when a cron expression's ticks fall in its time zone (croner for the
//! expression, the IANA database of chrono-tz for the zone), and firing the due ones. A daemon
//! fires them every second (`worker schedule tick` once, by hand); several daemons
//! may fire the same tick at once: its task is enqueued under a key made of the schedule's
//! name and the tick's time, so the tick enqueues one task whoever fires it and however
//! often, and the schedule's latest tick only moves forward.
//!
//! Time zones: a tick is a wall-clock time of the zone. A time the zone skips (clocks go
//! forward) fires at the first moment after the gap; a time it repeats (clocks go back) fires
//! once, at its first occurrence.

use chrono::{TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;

use crate::operator::submit::{Origin, TaskRequest, new_task};
use crate::store::schedule::{CatchUp, Schedule};
use crate::store::{Backend, Enqueued};

/// How late a tick may be found and still fire under [`CatchUp::None`].
pub const ON_TIME_MS: u64 = 60_000;
/// The most ticks looked at in one pass (a schedule every second, a day down: 86,400).
const TICKS_MAX: usize = 200_000;

/// The expression, parsed; five fields, or six with seconds first.
pub fn parse(expr: &str) -> Result<Cron, String> {
    Cron::new(expr)
        .with_seconds_optional()
        .parse()
        .map_err(|e| format!("--cron {expr:?}: {e} (five fields: minute hour day-of-month month day-of-week, or six with seconds first)"))
}

/// The zone named, from the IANA database.
pub fn zone(name: &str) -> Result<Tz, String> {
    name.parse::<Tz>().map_err(|_| {
        format!("--tz {name:?} is not a time zone of the IANA database (e.g. UTC, Europe/Paris, America/New_York)")
    })
}

/// The first tick of `s` after `after_ms`, in ms.
pub fn next_tick(s: &Schedule, after_ms: u64) -> Result<Option<u64>, String> {
    let (cron, tz) = (parse(&s.cron)?, zone(&s.tz)?);
    Ok(next_after(&cron, tz, after_ms))
}

fn next_after(cron: &Cron, tz: Tz, after_ms: u64) -> Option<u64> {
    let at = Utc
        .timestamp_millis_opt(i64::try_from(after_ms).ok()?)
        .single()?
        .with_timezone(&tz);
    let next = cron.find_next_occurrence(&at, false).ok()?;
    u64::try_from(next.timestamp_millis()).ok()
}

/// The ticks of `s` to fire at `now_ms`, oldest first, and how many are passed over. Every
/// tick after its last one and at most [`ON_TIME_MS`] old fires (a daemon's pass may find
/// several); of older ones (missed while no daemon ran), the latest fires under
/// [`CatchUp::Latest`] and none under [`CatchUp::None`].
pub fn due(s: &Schedule, now_ms: u64) -> Result<Due, String> {
    let (cron, tz) = (parse(&s.cron)?, zone(&s.tz)?);
    let mut at = s.last_tick_ms;
    let (mut late, mut fire) = (Vec::new(), Vec::new());
    for _ in 0..TICKS_MAX {
        match next_after(&cron, tz, at) {
            Some(t) if t <= now_ms && t > at => {
                if now_ms - t <= ON_TIME_MS {
                    fire.push(t);
                } else {
                    late.push(t);
                }
                at = t;
            }
            _ => break,
        }
    }
    let last = fire.last().or(late.last()).copied();
    let mut skipped = late.len();
    if s.catch_up == CatchUp::Latest
        && let Some(&t) = late.last()
    {
        fire.insert(0, t);
        skipped -= 1;
    }
    Ok(Due {
        fire,
        skipped,
        last,
    })
}

/// The ticks a pass fires, and those it passes over.
#[derive(Debug, PartialEq)]
pub struct Due {
    /// Oldest first.
    pub fire: Vec<u64>,
    /// Missed ticks passed over.
    pub skipped: usize,
    /// The latest tick due, fired or not: the schedule moves past it.
    pub last: Option<u64>,
}

/// The key a tick's task is enqueued under.
pub fn tick_key(name: &str, tick_ms: u64) -> String {
    format!("schedule:{name}:{}", crate::clock::rfc3339(tick_ms))
}

/// A tick fired.
#[derive(Debug)]
pub struct Fired {
    pub schedule: String,
    pub tick_ms: u64,
    /// The tick's task (`created` false: another daemon, or an earlier pass that stopped
    /// before recording the tick, had enqueued it).
    pub task: Enqueued,
}

/// What firing every due tick of every active schedule at `now_ms` did: the ticks fired, with
/// each tick's task built in `cfg` (the firing daemon's config), and the ticks passed over.
/// A tick whose task cannot be built or is refused is reported and passed over, so it never
/// holds back the ticks after it; one the database could not take (unavailable, failing) is
/// left due, to be fired at the next pass.
#[derive(Debug, Default)]
pub struct Pass {
    pub fired: Vec<Fired>,
    /// (schedule, how many missed ticks it passed over).
    pub skipped: Vec<(String, usize)>,
    pub failed: Vec<String>,
    /// How many schedules are active (not paused).
    pub active: usize,
}

pub fn fire_due(
    store: &dyn Backend,
    cfg: Option<&crate::config::Config>,
    now_ms: u64,
) -> crate::store::Result<Pass> {
    let mut pass = Pass::default();
    for s in store.schedules()? {
        if s.paused {
            continue;
        }
        pass.active += 1;
        if let Err(e) = fire_one(store, cfg, &s, now_ms, &mut pass) {
            pass.failed.push(format!("schedule {:?}: {e}", s.name));
        }
    }
    Ok(pass)
}

fn fire_one(
    store: &dyn Backend,
    cfg: Option<&crate::config::Config>,
    s: &Schedule,
    now_ms: u64,
    pass: &mut Pass,
) -> Result<(), String> {
    let due = due(s, now_ms)?;
    if due.skipped > 0 {
        pass.skipped.push((s.name.clone(), due.skipped));
    }
    for &tick in &due.fire {
        match fire_tick(store, cfg, s, tick, now_ms) {
            Ok(task) => {
                advance(store, &s.name, tick, true)?;
                pass.fired.push(Fired {
                    schedule: s.name.clone(),
                    tick_ms: tick,
                    task,
                });
            }
            Err(Refused::Later(e)) => return Err(e),
            Err(Refused::Tick(e)) => {
                advance(store, &s.name, tick, false)?;
                pass.failed.push(format!(
                    "schedule {:?}: the tick of {} was passed over: {e}",
                    s.name,
                    crate::clock::rfc3339(tick)
                ));
            }
        }
    }
    // Ticks passed over only: the schedule moves past them.
    if let (None, Some(t)) = (due.fire.last(), due.last) {
        advance(store, &s.name, t, false)?;
    }
    Ok(())
}

/// Why a tick enqueued no task.
enum Refused {
    /// The tick's own task cannot be made or was refused: it is passed over.
    Tick(String),
    /// The database could not take it now: the tick stays due.
    Later(String),
}

/// Enqueues the task of `s`'s tick at `tick` under the tick's key.
fn fire_tick(
    store: &dyn Backend,
    cfg: Option<&crate::config::Config>,
    s: &Schedule,
    tick: u64,
    now_ms: u64,
) -> Result<Enqueued, Refused> {
    let mut req: TaskRequest = serde_json::from_value(s.task.clone())
        .map_err(|e| Refused::Tick(format!("its task cannot be read: {e}")))?;
    req.key = Some(tick_key(&s.name, tick));
    let t = new_task(req, cfg, Origin::Schedule).map_err(Refused::Tick)?;
    match store.enqueue(&[t], now_ms) {
        Ok(mut made) => made
            .pop()
            .ok_or_else(|| Refused::Later("the enqueue returned no task".into())),
        Err(e @ (crate::store::Error::Conflict(_) | crate::store::Error::Invalid(_))) => {
            Err(Refused::Tick(e.to_string()))
        }
        Err(e) => Err(Refused::Later(e.to_string())),
    }
}

/// The schedule's latest tick moves forward to `tick` (never back), counted if it fired.
fn advance(store: &dyn Backend, name: &str, tick: u64, fired: bool) -> Result<(), String> {
    store
        .update_schedule(name, &mut |x| {
            if tick > x.last_tick_ms {
                x.last_tick_ms = tick;
                x.fired += u64::from(fired);
            }
        })
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(rfc: &str) -> u64 {
        crate::clock::parse_rfc3339(rfc).expect("a time")
    }

    fn ticks(expr: &str, tz: &str, from: &str, n: usize) -> Vec<String> {
        let (cron, tz) = (parse(expr).expect("cron"), zone(tz).expect("tz"));
        let mut at = ms(from);
        (0..n)
            .map(|_| {
                at = next_after(&cron, tz, at).expect("a tick");
                crate::clock::rfc3339(at)
            })
            .collect()
    }

    #[test]
    fn a_repeated_hour_fires_once_and_a_skipped_time_after_the_gap() {
        // New York goes back from 02:00 EDT to 01:00 EST on 2026-11-01: 01:30 happens twice.
        assert_eq!(
            ticks("30 1 * * *", "America/New_York", "2026-10-31T12:00:00Z", 3),
            [
                "2026-11-01T05:30:00.000Z", // 01:30 EDT, the first 01:30 of the 1st
                "2026-11-02T06:30:00.000Z", // 01:30 EST
                "2026-11-03T06:30:00.000Z"
            ]
        );
        // It goes forward from 02:00 EST to 03:00 EDT on 2026-03-08: 02:30 does not exist.
        assert_eq!(
            ticks("30 2 * * *", "America/New_York", "2026-03-07T12:00:00Z", 3),
            [
                "2026-03-08T07:00:00.000Z", // 03:00 EDT, the first moment after the gap
                "2026-03-09T06:30:00.000Z", // 02:30 EDT
                "2026-03-10T06:30:00.000Z"
            ]
        );
        // The same expression in UTC knows no such thing.
        assert_eq!(
            ticks("30 2 * * *", "UTC", "2026-03-07T12:00:00Z", 1),
            ["2026-03-08T02:30:00.000Z"]
        );
    }

    #[test]
    fn bad_expressions_and_zones_say_what_is_wrong() {
        assert!(parse("61 * * * *").unwrap_err().contains("five fields"));
        assert!(zone("Mars/Olympus").unwrap_err().contains("IANA"));
        assert!(parse("*/5 * * * 1-5").is_ok());
        assert!(parse("*/10 * * * * *").is_ok());
    }
}
