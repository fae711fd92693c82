//! Verifiable rewards, after NeMo-Gym's `math_with_judge` and `mcqa` resource servers.
//!
//! - `math`: the answer is the content of the **last** `\boxed{…}` in the response (braces
//!   balanced). It is compared by value with the expected answer: both are normalised (spaces,
//!   `$`, thousands commas and a trailing `.` dropped) and, when both parse as numbers, compared
//!   numerically (`47`, `47.0` and `4.7e1` are the same answer); otherwise as strings.
//! - `mcq` (`strict_single_letter_boxed`): the last `\boxed{…}` must hold exactly one letter, and
//!   it must be the expected one.
//!
//! - `format`: the response's form only, whatever its answer: 1.0 when it ends with a
//!   non-empty `\boxed{…}` (nothing after it but a closing `.` and whitespace), as the math
//!   prompt asks ("put the answer (and only answer) inside \boxed{}"). A shaping reward.
//! - `exact`: the whole response, trimmed, equals the expected answer, trimmed
//!   (lm-evaluation-harness's `exact_match` without filters).
//!
//! A response with no `\boxed{}` scores 0 in `math`, `mcq` and `format`.

/// The content of the last `\boxed{…}` in `text`, if there is a complete one.
pub fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

fn normalise(answer: &str) -> String {
    answer
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '$')
        .collect::<String>()
        .trim_end_matches('.')
        .to_string()
}

fn as_number(s: &str) -> Option<f64> {
    let plain: String = s.chars().filter(|c| *c != ',').collect();
    plain.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// 1.0 when the last boxed answer of `response` equals `expected` by value, else 0.0.
pub fn math(response: &str, expected: &str) -> f64 {
    let Some(got) = last_boxed(response) else {
        return 0.0;
    };
    let (got, want) = (normalise(got), normalise(expected));
    let same = match (as_number(&got), as_number(&want)) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * b.abs().max(1.0),
        _ => got == want,
    };
    if same { 1.0 } else { 0.0 }
}

/// 1.0 when the last boxed answer is exactly the expected single letter.
pub fn mcq(response: &str, expected: &str) -> f64 {
    match last_boxed(response).map(str::trim) {
        Some(got) if got.chars().count() == 1 && got.eq_ignore_ascii_case(expected.trim()) => 1.0,
        _ => 0.0,
    }
}

/// 1.0 when the response ends with a non-empty boxed answer (then at most `.` and spaces).
pub fn format(response: &str, _expected: &str) -> f64 {
    let Some(start) = response.rfind("\\boxed{") else {
        return 0.0;
    };
    let Some(inner) = last_boxed(response) else {
        return 0.0;
    };
    let after = &response[start + "\\boxed{".len() + inner.len() + 1..];
    let tail_ok = after.trim().trim_end_matches('.').trim().is_empty();
    if !inner.trim().is_empty() && tail_ok {
        1.0
    } else {
        0.0
    }
}

/// 1.0 when the trimmed response is exactly the trimmed expected answer.
pub fn exact(response: &str, expected: &str) -> f64 {
    f64::from(response.trim() == expected.trim())
}

/// The environments [`score`] knows.
pub const ENVIRONMENTS: &str = "math, mcq, format, exact";

/// Score by environment name; an unknown environment is an error.
pub fn score(env: &str, response: &str, expected: &str) -> Result<f64, crate::Error> {
    match env {
        "math" => Ok(math(response, expected)),
        "mcq" => Ok(mcq(response, expected)),
        "format" => Ok(format(response, expected)),
        "exact" => Ok(exact(response, expected)),
        other => Err(crate::Error::new(format!(
            "no reward environment `{other}` ({ENVIRONMENTS})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_complete_boxed_answer_counts() {
        assert_eq!(
            last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}"),
            Some(r"\frac{1}{2}")
        );
        assert_eq!(last_boxed(r"\boxed{3"), None);
        assert_eq!(last_boxed("no box"), None);
    }

    #[test]
    fn math_answers_compare_by_value() {
        assert_eq!(math(r"The answer is \boxed{47}.", "47"), 1.0);
        assert_eq!(math(r"\boxed{47.0}", "47"), 1.0);
        assert_eq!(math(r"\boxed{$1,000}", "1000"), 1.0);
        assert_eq!(math(r"\boxed{ -3 }", "-3"), 1.0);
        assert_eq!(math(r"\boxed{46}", "47"), 0.0);
        assert_eq!(math("47", "47"), 0.0, "no box, no reward");
        assert_eq!(
            math(r"\boxed{x+1}", "x + 1"),
            1.0,
            "non-numbers compare as text"
        );
        assert_eq!(
            math(r"\boxed{12} wait, \boxed{13}", "12"),
            0.0,
            "the last box counts"
        );
    }

    #[test]
    fn mcq_needs_exactly_the_letter() {
        assert_eq!(mcq(r"\boxed{B}", "B"), 1.0);
        assert_eq!(mcq(r"\boxed{b}", "B"), 1.0);
        assert_eq!(mcq(r"\boxed{B) 42}", "B"), 0.0);
        assert_eq!(mcq(r"\boxed{C}", "B"), 0.0);
        assert!(score("judge", "", "").is_err());
    }

    #[test]
    fn format_rewards_a_final_boxed_answer_whatever_its_value() {
        assert_eq!(
            format(r"So the sum is 5. The answer is \boxed{7}.", "5"),
            1.0
        );
        assert_eq!(format(r"\boxed{7}  ", ""), 1.0);
        assert_eq!(format(r"\boxed{\frac{1}{2}}.", ""), 1.0);
        assert_eq!(format(r"\boxed{7} and then more text", ""), 0.0);
        assert_eq!(format(r"\boxed{ }", ""), 0.0);
        assert_eq!(format(r"\boxed{7", ""), 0.0);
        assert_eq!(format("no box at all", ""), 0.0);
    }

    #[test]
    fn exact_compares_whole_trimmed_responses() {
        assert_eq!(exact(" Paris\n", "Paris"), 1.0);
        assert_eq!(exact("Paris.", "Paris"), 0.0);
        assert!(
            score("chess", "", "")
                .unwrap_err()
                .message
                .contains("format")
        );
    }
}
