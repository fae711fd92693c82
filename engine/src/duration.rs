//! Time limits as Slurm writes them (`sbatch --time`), so one `resources.time` means the same
//! on a laptop and on a cluster: `minutes`, `minutes:seconds`, `hours:minutes:seconds`,
//! `days-hours`, `days-hours:minutes` or `days-hours:minutes:seconds`; a bare number in a
//! manifest is minutes.

use serde_json::Value;
use std::time::Duration;

/// The duration of a `resources.time` value, or `None` if it is not one of Slurm's forms
/// (or is zero, which Slurm reads as "no limit" and nemo-dag refuses).
pub fn parse(value: &Value) -> Option<Duration> {
    let secs = match value {
        Value::Number(n) => n.as_u64()?.checked_mul(60)?,
        Value::String(s) => parse_text(s.trim())?,
        _ => return None,
    };
    (secs > 0).then(|| Duration::from_secs(secs))
}

fn parse_text(text: &str) -> Option<u64> {
    let number = |s: &str| -> Option<u64> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let (days, clock) = match text.split_once('-') {
        Some((d, rest)) => (Some(number(d)?), rest),
        None => (None, text),
    };
    let parts: Vec<u64> = clock.split(':').map(number).collect::<Option<_>>()?;
    let secs = match (days, parts.as_slice()) {
        (None, [m]) => m.checked_mul(60)?,
        (None, [m, s]) => m.checked_mul(60)?.checked_add(*s)?,
        (None, [h, m, s]) | (Some(_), [h, m, s]) => h
            .checked_mul(3600)?
            .checked_add(m.checked_mul(60)?)?
            .checked_add(*s)?,
        (Some(_), [h]) => h.checked_mul(3600)?,
        (Some(_), [h, m]) => h.checked_mul(3600)?.checked_add(m.checked_mul(60)?)?,
        _ => return None,
    };
    secs.checked_add(days.unwrap_or(0).checked_mul(86_400)?)
}

/// A duration as people read it: `1h 02m 03s`, `45s`.
pub fn show(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m {s:02}s"),
        (h, m, s) => format!("{h}h {m:02}m {s:02}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_slurm_form_parses() {
        let secs = |v: Value| parse(&v).map(|d| d.as_secs());
        assert_eq!(secs(json!(90)), Some(5400), "a bare number is minutes");
        assert_eq!(secs(json!("90")), Some(5400));
        assert_eq!(secs(json!("1:30")), Some(90));
        assert_eq!(secs(json!("01:00:00")), Some(3600));
        assert_eq!(secs(json!("2-0")), Some(2 * 86_400));
        assert_eq!(secs(json!("1-2:30")), Some(86_400 + 2 * 3600 + 1800));
        assert_eq!(secs(json!("1-00:00:05")), Some(86_405));
    }

    #[test]
    fn nonsense_is_refused() {
        for bad in [
            json!("0"),
            json!(0),
            json!(-5),
            json!(1.5),
            json!("soon"),
            json!("1:2:3:4"),
            json!("-1"),
            json!("1h"),
            json!(""),
            json!("99999999999999999999"),
            json!(true),
        ] {
            assert_eq!(parse(&bad), None, "{bad}");
        }
    }
}
