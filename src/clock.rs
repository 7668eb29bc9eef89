//! Wall-clock time as operators read it: milliseconds since the epoch (what the database
//! stores), RFC 3339 in UTC (what the CLI, the console and JSON print), relative ages for
//! tables ("3m ago"), and the inverse: an RFC 3339 time or a duration back ("30d" ago).
//!
//! The calendar arithmetic is the proleptic Gregorian one of Howard Hinnant's `days_from_civil`
//! and `civil_from_days`, exact for every u64 millisecond value a task can hold.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `ms` as RFC 3339 in UTC with milliseconds: `2026-11-30T01:29:36.123Z`.
pub fn rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (y, mo, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s / 60 % 60,
        s % 60,
        ms % 1000
    )
}

/// A duration, short: `45s`, `10m`, `24h`, `3d` (the largest whole unit).
pub fn duration_text(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// How long before `now_ms` the time `ms` was, short: `42s ago`, `5m ago`, `3h ago`, `2d ago`
/// (`in 5m` for a time still to come).
pub fn ago(ms: u64, now_ms: u64) -> String {
    let (d, future) = if ms <= now_ms {
        (now_ms - ms, false)
    } else {
        (ms - now_ms, true)
    };
    let text = duration_text(d);
    if future {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

/// Parses an RFC 3339 time (`2026-11-30T01:29:36Z`, fractions and offsets allowed, or a date
/// alone, `2026-11-30`, meaning its midnight UTC) into ms since the epoch.
pub fn parse_rfc3339(s: &str) -> Result<u64, String> {
    let ms = rfc3339_ms(s)?;
    u64::try_from(ms).map_err(|_| format!("{s:?} is before 1970"))
}

/// [`parse_rfc3339`], with a time before 1970 read as 1970 (for a bound such as `since`,
/// which no task is older than anyway).
pub fn parse_rfc3339_from_epoch(s: &str) -> Result<u64, String> {
    Ok(u64::try_from(rfc3339_ms(s)?).unwrap_or(0))
}

/// Milliseconds since the epoch of an RFC 3339 time, negative before 1970.
fn rfc3339_ms(s: &str) -> Result<i64, String> {
    let bad = || format!("{s:?} is not an RFC 3339 time (like 2026-11-30T08:00:00Z or 2026-11-30)");
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Result<i64, String> {
        let t = s.get(r).ok_or_else(bad)?;
        if t.is_empty() || !t.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        t.parse().map_err(|_| bad())
    };
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return Err(bad());
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return Err(bad());
    }
    let days = days_from_civil(y, mo as u32, d as u32);
    if civil_from_days(days) != (y, mo as u32, d as u32) {
        return Err(bad());
    }
    let mut ms = days * 86_400_000;
    if b.len() > 10 {
        if !matches!(b[10], b'T' | b't' | b' ') || b.len() < 19 || b[13] != b':' || b[16] != b':' {
            return Err(bad());
        }
        let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if h > 23 || mi > 59 || sec > 60 {
            return Err(bad());
        }
        ms += (h * 3600 + mi * 60 + sec) * 1000;
        let mut rest = &s[19..];
        if let Some(frac) = rest.strip_prefix('.') {
            let digits: String = frac.chars().take_while(char::is_ascii_digit).collect();
            if digits.is_empty() {
                return Err(bad());
            }
            let milli: String = digits.chars().chain("000".chars()).take(3).collect();
            ms += milli.parse::<i64>().map_err(|_| bad())?;
            rest = &frac[digits.len()..];
        }
        match rest {
            "Z" | "z" => {}
            _ if rest.len() == 6
                && matches!(rest.as_bytes()[0], b'+' | b'-')
                && rest.as_bytes()[3] == b':' =>
            {
                let oh = num(s.len() - 5..s.len() - 3)?;
                let om = num(s.len() - 2..s.len())?;
                let off = (oh * 60 + om) * 60_000;
                ms -= if rest.starts_with('+') { off } else { -off };
            }
            _ => return Err(bad()),
        }
    }
    Ok(ms)
}

/// `30d`, `12h`, `90m`, `45s` as milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected a whole number with a unit, like 30d or 12h"))?;
    let ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?}: the unit must be s, m, h or d")),
    };
    n.checked_mul(ms)
        .ok_or_else(|| format!("{s:?} is too long a duration"))
}

/// A point in time given as RFC 3339, or as a duration before `now_ms` (`90s`, `30m`, `12h`,
/// `7d`), as `--since` and `--until` take it.
pub fn parse_when(s: &str, now_ms: u64) -> Result<u64, String> {
    if s.trim().starts_with(|c: char| c.is_ascii_digit())
        && let Ok(ago) = parse_duration_ms(s)
    {
        return Ok(now_ms.saturating_sub(ago));
    }
    parse_rfc3339(s).map_err(|e| format!("{e}, or a duration ago like 30m, 12h or 7d"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses_back() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_002_176_123), "2026-11-30T01:29:36.123Z");
        for ms in [0, 951_782_400_000, 1_796_002_176_123, 4_102_444_799_999] {
            assert_eq!(parse_rfc3339(&rfc3339(ms)), Ok(ms));
        }
        assert_eq!(parse_rfc3339("2026-11-30"), Ok(1_795_996_800_000));
        assert_eq!(
            parse_rfc3339("2026-11-30T02:29:36+01:00"),
            parse_rfc3339("2026-11-30T01:29:36Z")
        );
        for bad in [
            "",
            "2026-13-01",
            "2026-02-30",
            "2026-11-30T25:00:00Z",
            "yesterday",
            "2026-11-30T01:29:36",
        ] {
            assert!(parse_rfc3339(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn relative_times() {
        assert_eq!(ago(1_000, 43_000), "42s ago");
        assert_eq!(ago(0, 5 * 60_000), "5m ago");
        assert_eq!(ago(0, 2 * 86_400_000 + 5), "2d ago");
        assert_eq!(ago(10 * 60_000, 0), "in 10m");
        assert_eq!(parse_when("7d", 10 * 86_400_000), Ok(3 * 86_400_000));
        assert!(parse_when("7 days", 0).is_err());
    }
}
