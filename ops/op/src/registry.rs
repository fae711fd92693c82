//! The list of ops a binary offers, and the nearest name to a misspelt one.
//!
//! The engine never names an op: the `nemo-dag` binary hands it a [`Registry`] built from the
//! ops crate's static list, so the engine builds and tests without any ML code.

use crate::{AnyOp, GpuProbe};

/// The ops a manifest may name, in the order `nemo-dag ops` lists them, and how this binary
/// finds a GPU.
#[derive(Clone, Copy)]
pub struct Registry {
    ops: &'static [&'static dyn AnyOp],
    gpu_probe: Option<GpuProbe>,
}

impl Registry {
    /// A registry whose binary has no GPU support: a stage that asks for `cuda` fails.
    pub const fn new(ops: &'static [&'static dyn AnyOp]) -> Self {
        Registry {
            ops,
            gpu_probe: None,
        }
    }

    /// The same ops, with the probe that tells whether CUDA device `N` is usable.
    pub const fn with_gpu_probe(self, probe: GpuProbe) -> Self {
        Registry {
            gpu_probe: Some(probe),
            ..self
        }
    }

    /// How this binary finds a GPU; `None` when it was built without GPU support.
    pub fn gpu_probe(&self) -> Option<GpuProbe> {
        self.gpu_probe
    }

    /// The op a manifest calls `name`.
    pub fn get(&self, name: &str) -> Option<&'static dyn AnyOp> {
        self.ops.iter().copied().find(|op| op.name() == name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &'static dyn AnyOp> + '_ {
        self.ops.iter().copied()
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.ops.iter().map(|op| op.name()).collect()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

/// The candidate closest to `wanted` by edit distance, if it is close enough to be a likely
/// typo: at most a third of the longer name's length (at least one edit), as cargo and just
/// suggest a command. Ties go to the first candidate.
pub fn nearest<'a>(wanted: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut best: Option<(usize, &str)> = None;
    let wanted_len = wanted.chars().count();
    for c in candidates {
        let c_len = c.chars().count();
        let limit = (wanted_len.max(c_len) / 3).max(1);
        // The distance is at least the difference in length: skip what cannot be close
        // without the quadratic table (a multi-megabyte name took seconds and gigabytes).
        if wanted_len.abs_diff(c_len) > limit {
            continue;
        }
        let d = edit_distance(wanted, c);
        if d <= limit && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c)
}

/// Edit distance over characters, a swap of two neighbours counting as one edit (optimal
/// string alignment), so `gpro` is one edit from `grpo`.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    d[0] = (0..=b.len()).collect();
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("pretrain", "pretrain"), 0);
        assert_eq!(edit_distance("pretrian", "pretrain"), 1);
        assert_eq!(edit_distance("gpro", "grpo"), 1);
        assert_eq!(edit_distance("sft", "dpo"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn the_nearest_name_is_suggested_only_when_close() {
        let ops = ["cmd", "pretrain", "sft", "dpo", "grpo", "eval", "tokenize"];
        assert_eq!(nearest("pretrian", ops), Some("pretrain"));
        assert_eq!(nearest("tokenise", ops), Some("tokenize"));
        assert_eq!(nearest("gpro", ops), Some("grpo"));
        assert_eq!(nearest("evals", ops), Some("eval"));
        assert_eq!(nearest("train_everything", ops), None);
        assert_eq!(nearest("xyz", ops), None);
    }
}
