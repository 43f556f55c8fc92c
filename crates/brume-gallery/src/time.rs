//! Timestamps: the gallery stores UTC milliseconds since the Unix epoch and shows
//! RFC 3339; no date crate needed for that much calendar arithmetic.

use crate::error::{GalleryError, Result};

/// Now, in milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

/// `2026-12-07T23:42:52Z` (UTC, whole seconds).
pub fn format_rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, sod) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", sod / 3600, sod / 60 % 60, sod % 60)
}

/// Parses a time given by a person or a URL: RFC 3339 (`2026-12-07T10:00:00Z`,
/// `...+02:00`, fractional seconds, a space for `T`), a date (`2026-12-07`, UTC
/// midnight) or Unix seconds. `field` names the argument in the error.
pub fn parse_time(s: &str, field: &'static str) -> Result<i64> {
    let err = || GalleryError::invalid(field, format!("{s:?} is not a date (YYYY-MM-DD), an RFC 3339 time or Unix seconds"));
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && s.len() <= 12 {
        return s.parse::<i64>().map(|v| v * 1000).map_err(|_| err());
    }
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Result<i64> {
        let part = s.get(r).ok_or_else(err)?;
        if part.is_empty() || !part.bytes().all(|c| c.is_ascii_digit()) {
            return Err(err());
        }
        part.parse().map_err(|_| err())
    };
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return Err(err());
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return Err(err());
    }
    let mut ms = days_from_civil(y, mo, d) * 86_400_000;
    if b.len() == 10 {
        return Ok(ms);
    }
    if !(b[10] == b'T' || b[10] == b't' || b[10] == b' ') || b.len() < 16 || b[13] != b':' {
        return Err(err());
    }
    let (h, mi) = (num(11..13)?, num(14..16)?);
    let mut i = 16;
    let mut sec = 0;
    if b.get(i) == Some(&b':') {
        sec = num(17..19)?;
        i = 19;
        if b.get(i) == Some(&b'.') {
            i += 1;
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                return Err(err());
            }
            let frac = &s[start..i.min(start + 3)];
            ms += format!("{frac:0<3}").parse::<i64>().map_err(|_| err())?;
        }
    }
    if h > 23 || mi > 59 || sec > 60 {
        return Err(err());
    }
    ms += ((h * 60 + mi) * 60 + sec) * 1000;
    match &s[i..] {
        "" | "Z" | "z" => Ok(ms),
        off if off.len() == 6 && (off.starts_with('+') || off.starts_with('-')) && off.as_bytes()[3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            let offset = (oh * 60 + om) * 60_000;
            Ok(if off.starts_with('+') { ms - offset } else { ms + offset })
        }
        _ => Err(err()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        assert_eq!(format_rfc3339(0), "1970-01-01T00:00:00Z");
        let t = parse_time("2026-12-07T23:42:52Z", "t").unwrap();
        assert_eq!(format_rfc3339(t), "2026-12-07T23:42:52Z");
        assert_eq!(parse_time("2026-12-08T01:42:52.5+02:00", "t").unwrap(), t + 500);
        assert_eq!(parse_time("2026-12-07", "t").unwrap() + ((23 * 60 + 42) * 60 + 52) * 1000, t);
        assert_eq!(parse_time("1700000000", "t").unwrap(), 1_700_000_000_000);
        assert_eq!(format_rfc3339(parse_time("2000-02-29 12:00", "t").unwrap()), "2000-02-29T12:00:00Z");
        for bad in [
            "",
            "2026-1",
            "2026-13-01",
            "2026-12-07T",
            "2026-12-07T10:00+2",
            "yesterday",
            "2026-12-07T10:00:00Zjunk",
        ] {
            assert!(parse_time(bad, "t").is_err(), "{bad}");
        }
    }
}
