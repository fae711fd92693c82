//! Time limits as Slurm writes them (`sbatch --time`), so one `resources.time` means the same
//! on a laptop and on a cluster: `minutes`, `minutes:seconds`, `hours:minutes:seconds`,
//! `days-hours`, `days-hours:minutes` or `days-hours:minutes:seconds`; a bare number in a
//! manifest is minutes.

use serde_json::Value;
use std::time::Duration;

/// The longest `time`: a year.
const MAX_TIME: Duration = Duration::from_secs(365 * 24 * 3600);

/// The duration of a `resources.time` value, or why it is not one of Slurm's forms. Zero,
/// which Slurm reads as "no limit", is refused: leaving `time` out says that.
pub fn parse(value: &Value) -> Result<Duration, String> {
    let text = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let not_a_time = || {
        format!(
            "`{text}` is not a time limit: write minutes (`90`), HH:MM:SS (`04:00:00`) or D-HH:MM:SS (`2-00:00:00`), as Slurm's --time takes"
        )
    };
    let (days, clock) = match text.split_once('-') {
        Some((days, clock)) => (Some(days), clock),
        None => (None, text.as_str()),
    };
    let fields: Vec<&str> = clock.split(':').collect();
    let numbers: Option<Vec<u64>> = std::iter::once(days.unwrap_or("0"))
        .chain(fields.iter().copied())
        .map(|f| {
            (!f.is_empty() && f.len() <= 12 && f.bytes().all(|b| b.is_ascii_digit()))
                .then(|| f.parse().ok())
                .flatten()
        })
        .collect();
    let Some(numbers) = numbers else {
        return Err(not_a_time());
    };
    // In seconds, what each field counts, and the most it may be after the first.
    let units: &[(u64, u64)] = match (days.is_some(), fields.len()) {
        (false, 1) => &[(60, u64::MAX)],
        (false, 2) => &[(60, u64::MAX), (1, 59)],
        (false, 3) | (true, 3) => &[(3600, 23), (60, 59), (1, 59)],
        (true, 1) => &[(3600, 23)],
        (true, 2) => &[(3600, 23), (60, 59)],
        _ => return Err(not_a_time()),
    };
    let mut seconds = numbers[0].saturating_mul(86_400);
    for (i, (&n, &(unit, most))) in numbers[1..].iter().zip(units).enumerate() {
        let leading = i == 0 && days.is_none();
        if !leading && n > most {
            return Err(not_a_time());
        }
        seconds = seconds.saturating_add(n.saturating_mul(unit));
    }
    match Duration::from_secs(seconds) {
        d if d.is_zero() => Err(format!(
            "`{text}` is no time at all; to run without a limit, leave `time` out"
        )),
        d if d > MAX_TIME => Err(format!("`{text}`: it takes at most 365 days")),
        d => Ok(d),
    }
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
        let secs = |v: Value| parse(&v).ok().map(|d| d.as_secs());
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
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }
}
