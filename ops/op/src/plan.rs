//! What a stage will need, known before it runs: the memory of its peak and the work of a step.
//!
//! Every op may plan a stage from its params and what its upstream stages will hand it
//! ([`Facts`]: the model they produce, the vocabulary of a tokenizer). The engine walks the
//! graph in order, so a `sft` stage plans with the model its `pretrain` input declares, long
//! before that model exists. `validate`, `status`, `run --dry-run` and `show` print the
//! [`Estimate`]; `run` refuses a stage whose estimate exceeds its device before anything runs,
//! and `exec` records the estimate beside the measured peak in `artifact.json`.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// What a stage tells the stages that consume it, before it runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// The model it produces, as a `model:` section (every size resolved, `vocab` included).
    pub model: Option<Value>,
    /// The vocabulary size of the tokenizer it produces (at most).
    pub vocab: Option<usize>,
    /// The length of a row of the data it produces (a `pack` artifact's `pack_size`).
    pub sequence: Option<usize>,
}

/// What a stage's inputs will be, as far as is known before they exist.
#[derive(Debug, Default)]
pub struct Upstream<'a> {
    /// Input name → the facts of the stage that produces it.
    pub stages: BTreeMap<&'a str, Facts>,
    /// Input name → a file the manifest names (a tokenizer.json, a model directory).
    pub files: BTreeMap<&'a str, &'a Path>,
}

/// A stage's plan: what it hands downstream, and what one of its steps costs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub facts: Facts,
    pub estimate: Option<Estimate>,
}

/// The peak memory of a stage, in named parts, and the work of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Where the estimate holds: `cpu` (the native trainer, f32) or a GPU.
    pub device: String,
    /// Bytes at the peak, by part (`parameters`, `gradients`, `optimizer`, `activations`,
    /// `logits`, `kv cache`, `runtime` …), in the order they are shown.
    pub memory: Vec<(String, u64)>,
    /// Floating-point operations of one optimizer step (forward and backward), or of the
    /// whole stage for one that takes no steps.
    pub flops_per_step: f64,
    /// Optimizer steps the stage takes (0: none).
    pub steps: u64,
    /// What the figures assume, in a line (`micro-batch 8 × 128 tokens, 2 at once`).
    pub basis: String,
    /// When the plan cannot know how long the rows will be (preference pairs, rollouts),
    /// `memory` takes every row at its longest and this is the peak with every row at its
    /// shortest: the stage needs between the two.
    #[serde(default)]
    pub least_bytes: Option<u64>,
}

impl Estimate {
    /// The whole peak, in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.memory.iter().map(|(_, b)| b).sum()
    }

    /// What the stage needs for certain: the whole peak, or its least when rows may be
    /// shorter than their longest.
    pub fn certain_bytes(&self) -> u64 {
        self.least_bytes.unwrap_or_else(|| self.peak_bytes())
    }

    /// The figures as JSON, for `artifact.json` and `--json` listings.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "device": self.device,
            "peak_bytes": self.peak_bytes(),
            "least_bytes": self.least_bytes,
            "memory": self.memory.iter().map(|(k, v)| (k.clone(), Value::from(*v))).collect::<serde_json::Map<_, _>>(),
            "flops_per_step": self.flops_per_step,
            "steps": self.steps,
            "basis": self.basis,
        })
    }
}

impl fmt::Display for Estimate {
    /// `≈ 1.2 GiB peak on cpu (parameters 28 MiB, …) · 3.1 TFLOP/step × 300 steps`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.least_bytes {
            None => write!(f, "≈ {}", bytes(self.peak_bytes()))?,
            Some(least) => write!(f, "{} to {}", bytes(least), bytes(self.peak_bytes()))?,
        }
        write!(f, " peak on {} (", self.device)?;
        for (i, (name, b)) in self.memory.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name} {}", bytes(*b))?;
        }
        write!(f, ") · {}", flops(self.flops_per_step))?;
        if self.steps > 0 {
            write!(f, "/step × {} steps", self.steps)?;
        }
        if !self.basis.is_empty() {
            write!(f, " · {}", self.basis)?;
        }
        Ok(())
    }
}

/// The device of an estimate that holds for each GPU of a launched stage's ranks (the busiest).
pub const EACH_GPU: &str = "each GPU";

impl Estimate {
    /// Whether the figures are each GPU's ([`EACH_GPU`]) rather than one machine's memory.
    pub fn per_gpu(&self) -> bool {
        self.device == EACH_GPU
    }
}

/// A size as people write it: `80GiB`, `81559 MiB` (binary units, as `nvidia-smi` prints
/// them), `80G` (Slurm's, binary too), `80GB` (decimal), or a number of bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let at = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..at], t[at..].trim());
    let scale: f64 = match unit {
        "" | "B" => 1.0,
        "K" | "KiB" => 1024.0,
        "M" | "MiB" => 1024.0 * 1024.0,
        "G" | "GiB" => 1024.0 * 1024.0 * 1024.0,
        "T" | "TiB" => 1024.0f64.powi(4),
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        _ => {
            return Err(format!(
                "`{text}`: unknown unit `{unit}` (write 80GiB, 81559MiB, 80G or 80GB)"
            ));
        }
    };
    match number.parse::<f64>() {
        Ok(n) if n > 0.0 && n.is_finite() => Ok((n * scale) as u64),
        _ => Err(format!(
            "`{text}` is not a size (write 80GiB, 81559MiB, 80G or 80GB)"
        )),
    }
}

/// `512 B`, `28.0 MiB`, `1.2 GiB`, `3.4 TiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `3.1 TFLOP`, `820 MFLOP`.
pub fn flops(n: f64) -> String {
    const UNITS: [&str; 7] = ["", "K", "M", "G", "T", "P", "E"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}FLOP", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_in_binary_units_and_work_in_decimal_ones() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(28 << 20), "28.0 MiB");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
        assert_eq!(flops(3.1e12), "3.1 TFLOP");
        assert_eq!(flops(12.0), "12.0 FLOP");
    }

    #[test]
    fn sizes_parse_in_the_units_people_write() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("81559 MiB"), Ok(81559 << 20));
        assert_eq!(parse_bytes("80G"), Ok(80 << 30));
        assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("1.5TiB"), Ok(3 << 39));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        for bad in ["", "GiB", "80 gigs", "-1G", "0G"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_estimate_reads_as_its_parts_and_their_sum() {
        let e = Estimate {
            device: "cpu".into(),
            memory: vec![
                ("parameters".into(), 1 << 20),
                ("activations".into(), 3 << 20),
            ],
            flops_per_step: 2.0e9,
            steps: 10,
            basis: "micro-batch 2 × 64 tokens".into(),
            least_bytes: None,
        };
        assert_eq!(e.peak_bytes(), 4 << 20);
        assert_eq!(
            e.to_string(),
            "≈ 4.0 MiB peak on cpu (parameters 1.0 MiB, activations 3.0 MiB) · 2.0 GFLOP/step × 10 steps · micro-batch 2 × 64 tokens"
        );
        assert_eq!(e.to_json()["peak_bytes"], 4 << 20);
        assert_eq!(e.certain_bytes(), 4 << 20);
        let bounded = Estimate {
            least_bytes: Some(2 << 20),
            ..e
        };
        assert!(
            bounded
                .to_string()
                .starts_with("2.0 MiB to 4.0 MiB peak on cpu"),
            "{bounded}"
        );
        assert_eq!(bounded.certain_bytes(), 2 << 20);
    }
}
