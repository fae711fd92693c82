//! SFT sequence packing, as Nemotron's data prep does it.
//!
//! Step numbers are those of docs/parity.md, "SFT data". The pipeline, per shard:
//!
//! 1. [`pack`]: assign the shard's tokenized conversations to bins of at most `pack_size`
//!    tokens with one of three algorithms ([`Algorithm`], step 9). A conversation is
//!    never split across bins; one longer than `pack_size` is truncated to `pack_size`.
//! 2. [`materialize`]: turn each bin into one row `{input_ids, loss_mask, seq_start_id}`
//!    (step 10), with the loss mask re-aligned per subsequence to label semantics so that
//!    Megatron-Bridge's `GPTSFTPackedDataset.collate_fn` reads it correctly. Rows are not padded.
//! 3. [`PackStats`]: the per-shard numbers Nemotron records in its receipt (step 11).
//!
//! Then, over all shards of a run:
//!
//! 4. [`split_shard_counts`]: turn train/valid/test ratios into whole shard counts
//!    (step 12).
//! 5. [`assign_splits`]: shuffle the shards with CPython's `random.Random(seed)` and deal them
//!    out: test first, then valid, the rest train (Nemotron `distribute_shards_to_splits`).
//!
//! The behaviour follows Nemotron's own code (`NVIDIA-NeMo/Nemotron`,
//! `src/nemotron/data_prep/packing/` and `utils/splits.py`); the less obvious of those
//! points are called out in the item docs below.

use crate::random::PyRandom;
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// 1. Packing algorithms (step 9; Megatron-Bridge `data/packing/algorithms.py`)
// ---------------------------------------------------------------------------------------------

/// The manifest names of the packing algorithms, in the order error messages list them.
pub const ALGORITHM_NAMES: [&str; 3] =
    ["first_fit_decreasing", "first_fit_shuffle", "concatenative"];

/// How a shard's sequences are assigned to bins (step 9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Stable sort by length, longest first, then first fit: deterministic, dense bins.
    FirstFitDecreasing,
    /// Shuffle with CPython's `random.Random(seed)`, then first fit: Nemotron's default
    /// (seed = `seed`, else `sample_seed` = 42). Bins mix short and long sequences.
    FirstFitShuffle { seed: u64 },
    /// Input order; a new bin starts whenever the next sequence does not fit the current one.
    Concatenative,
}

impl Algorithm {
    /// The algorithm a manifest names; `seed` is used by `first_fit_shuffle` only.
    pub fn from_name(name: &str, seed: u64) -> Result<Self, crate::Error> {
        match name {
            "first_fit_decreasing" => Ok(Algorithm::FirstFitDecreasing),
            "first_fit_shuffle" => Ok(Algorithm::FirstFitShuffle { seed }),
            "concatenative" => Ok(Algorithm::Concatenative),
            other => Err(crate::Error::new(format!(
                "unknown packing algorithm `{other}`; valid names: {}",
                ALGORITHM_NAMES.join(", ")
            ))),
        }
    }

    /// The manifest name.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::FirstFitDecreasing => ALGORITHM_NAMES[0],
            Algorithm::FirstFitShuffle { .. } => ALGORITHM_NAMES[1],
            Algorithm::Concatenative => ALGORITHM_NAMES[2],
        }
    }
}

/// Assign sequences of the given lengths to bins of capacity `pack_size`.
///
/// Returns the bins in the order they were opened; each bin lists item indices (into
/// `lengths`) in the order they were placed, which is the order [`materialize`] concatenates
/// them in. Every index appears exactly once, and the clamped lengths of a bin sum to at most
/// `pack_size`.
///
/// Lengths are first clamped to `pack_size` (a longer sequence will be truncated when
/// materialized), and the algorithm sees only clamped lengths — as in Nemotron, whose shard
/// processor clamps before calling the packer. This matters for ties: two over-long sequences
/// are equally long for `first_fit_decreasing` and keep their input order.
///
/// `pack_size` should be positive (the caller validates it; Nemotron rejects 0). With 0 every
/// length clamps to 0 and everything lands in a single bin.
pub fn pack(lengths: &[usize], pack_size: usize, algo: &Algorithm) -> Vec<Vec<usize>> {
    let clamped: Vec<usize> = lengths.iter().map(|&len| len.min(pack_size)).collect();
    match algo {
        Algorithm::FirstFitDecreasing => {
            let mut order: Vec<usize> = (0..clamped.len()).collect();
            // `sort_by` is stable: equal lengths keep ascending index order, as Python's
            // `sort(key=..., reverse=True)` does.
            order.sort_by(|&a, &b| clamped[b].cmp(&clamped[a]));
            first_fit(&clamped, &order, pack_size)
        }
        Algorithm::FirstFitShuffle { seed } => {
            // Nemotron shuffles `(length, index)` pairs; CPython's shuffle only looks at the
            // list's length, so shuffling the indices gives the same permutation. A fresh
            // generator per call matches Nemotron, which builds a new packer per shard.
            let mut order: Vec<usize> = (0..clamped.len()).collect();
            PyRandom::new(*seed).shuffle(&mut order);
            first_fit(&clamped, &order, pack_size)
        }
        Algorithm::Concatenative => concatenative(&clamped, pack_size),
    }
}

/// First fit: visit items in `order`; put each into the earliest-opened bin whose remaining
/// capacity is at least its length, else open a new bin (Megatron-Bridge `first_fit`).
///
/// The search uses a max segment tree over remaining capacities, as Megatron-Bridge does, so a
/// shard of n sequences packs in O(n log n); the result is exactly that of the linear scan.
/// The trick: give every possible bin (at most one per item) a leaf, with unopened bins at
/// full capacity. Because every length is ≤ `pack_size`, the leftmost leaf with enough room is
/// either the first open bin that fits or, if none does, the first unopened bin — which is
/// precisely "open a new bin".
fn first_fit(lengths: &[usize], order: &[usize], pack_size: usize) -> Vec<Vec<usize>> {
    let mut tree = CapacityTree::new(order.len(), pack_size);
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for &item in order {
        let len = lengths[item];
        let leaf = tree.leftmost_at_least(len).unwrap_or(bins.len());
        if leaf == bins.len() {
            bins.push(Vec::new());
        }
        bins[leaf].push(item);
        tree.consume(leaf, len);
    }
    bins
}

/// Concatenative packing: keep input order, start a new bin when the next item does not fit
/// into the current (last) bin. Earlier bins are never revisited.
fn concatenative(lengths: &[usize], pack_size: usize) -> Vec<Vec<usize>> {
    let mut bins: Vec<Vec<usize>> = Vec::new();
    let mut used = 0usize;
    for (item, &len) in lengths.iter().enumerate() {
        match bins.last_mut() {
            Some(bin) if used + len <= pack_size => {
                bin.push(item);
                used += len;
            }
            _ => {
                bins.push(vec![item]);
                used = len;
            }
        }
    }
    bins
}

/// A max segment tree over the remaining capacity of `n` bins.
struct CapacityTree {
    /// Number of leaves (a power of two ≥ n); leaf `i` lives at `max[leaves + i]`.
    leaves: usize,
    /// `max[node]` = largest remaining capacity in the node's subtree (1-based heap layout).
    max: Vec<usize>,
}

impl CapacityTree {
    /// `n` bins, all with `capacity` left; padding leaves have none.
    fn new(n: usize, capacity: usize) -> Self {
        let leaves = n.max(1).next_power_of_two();
        let mut max = vec![0; 2 * leaves];
        max[leaves..leaves + n].fill(capacity);
        for node in (1..leaves).rev() {
            max[node] = max[2 * node].max(max[2 * node + 1]);
        }
        CapacityTree { leaves, max }
    }

    /// The leftmost bin with at least `len` capacity left.
    fn leftmost_at_least(&self, len: usize) -> Option<usize> {
        if self.max[1] < len {
            return None;
        }
        let mut node = 1;
        while node < self.leaves {
            node = if self.max[2 * node] >= len {
                2 * node
            } else {
                2 * node + 1
            };
        }
        Some(node - self.leaves)
    }

    /// Take `len` from bin `leaf`'s remaining capacity.
    fn consume(&mut self, leaf: usize, len: usize) {
        let mut node = self.leaves + leaf;
        self.max[node] -= len;
        while node > 1 {
            node /= 2;
            self.max[node] = self.max[2 * node].max(self.max[2 * node + 1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Materializing a bin into a packed row (step 10; Nemotron `packing/materialize.py`)
// ---------------------------------------------------------------------------------------------

/// One tokenized training sequence (a conversation, or one user turn of a reasoning
/// conversation): token ids and, per token, 1 where the token belongs to an assistant chunk.
/// `mask` has one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub mask: Vec<u8>,
}

/// One packed row, the unit Megatron-Bridge's packed dataset reads (one Parquet row).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedRow {
    /// The bin's sequences concatenated, unpadded (length ≤ `pack_size`).
    pub input_ids: Vec<i32>,
    /// Label-aligned loss mask, same length as `input_ids`.
    pub loss_mask: Vec<u8>,
    /// Start offset of each subsequence: first 0, strictly increasing, last < row length.
    pub seq_start_id: Vec<i32>,
}

/// Build the packed row for one bin (indices into `seqs`, in bin order).
///
/// Each sequence is truncated to `pack_size` tokens and appended, and the row never grows past
/// `pack_size` tokens: as in Nemotron, a sequence that would overflow the row is cut to the
/// space left (this cannot happen for bins from [`pack`]). Empty sequences are skipped, so
/// `seq_start_id` stays strictly increasing.
///
/// The loss mask is re-aligned **per subsequence** to label semantics. Megatron-Bridge's
/// collate function trains position `j` of a subsequence `[s, e)` to predict token `j + 1` and
/// reads `loss_mask[s..e-1]`, so the stored value at `j` must say whether token `j + 1`
/// is trained: for a subsequence of length L, `aligned[j] = mask[j + 1]` for `j < L − 1` and
/// `aligned[L − 1] = 0` (a single-token subsequence gets `[0]`). Nothing bleeds across a
/// boundary: the last position of a subsequence is 0 whatever the next subsequence starts with.
///
/// Token ids are written as `i32` (the Parquet schema is `list<int32>`); every real vocabulary
/// is far below 2³¹. A mask shorter than its tokens reads as 0 past its end.
///
/// # Panics
/// If an index in `bin` is out of range for `seqs` (bins come from [`pack`] over the same list).
pub fn materialize(seqs: &[Sequence], bin: &[usize], pack_size: usize) -> PackedRow {
    let mut row = PackedRow::default();
    for &index in bin {
        let seq = &seqs[index];
        let room = pack_size.saturating_sub(row.input_ids.len());
        if room == 0 {
            break;
        }
        let len = seq.tokens.len().min(pack_size).min(room);
        if len == 0 {
            continue;
        }
        row.seq_start_id.push(row.input_ids.len() as i32);
        row.input_ids
            .extend(seq.tokens[..len].iter().map(|&t| t as i32));
        let mask_at = |j: usize| seq.mask.get(j).copied().unwrap_or(0);
        row.loss_mask.extend((1..len).map(mask_at));
        row.loss_mask.push(0);
    }
    row
}

// ---------------------------------------------------------------------------------------------
// 3. Per-shard statistics (step 11)
// ---------------------------------------------------------------------------------------------

/// What Nemotron records about one shard's packing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackStats {
    /// Sequences in the shard.
    pub num_sequences: usize,
    /// Bins, i.e. packed rows.
    pub num_packed_sequences: usize,
    /// Tokens after clamping each sequence to `pack_size`.
    pub total_tokens: usize,
    /// Sequences longer than `pack_size` (truncated when materialized).
    pub num_truncated_to_pack_size: usize,
    /// Sequences per bin, rounded to 2 decimals as Python's `round` does; 0 with no bins.
    pub packing_factor: f64,
    /// Tokens / (bins · pack_size) · 100, rounded to 1 decimal as Python's `round` does;
    /// 0 with no bins.
    pub packing_efficiency: f64,
}

impl PackStats {
    /// Statistics of a shard whose sequences have `lengths` (before clamping) and were packed
    /// into `num_bins` bins of `pack_size`.
    pub fn compute(lengths: &[usize], num_bins: usize, pack_size: usize) -> Self {
        let num_sequences = lengths.len();
        let total_tokens: usize = lengths.iter().map(|&len| len.min(pack_size)).sum();
        let num_truncated_to_pack_size = lengths.iter().filter(|&&len| len > pack_size).count();
        let capacity = num_bins * pack_size;
        let (packing_factor, packing_efficiency) = if num_bins == 0 || capacity == 0 {
            (0.0, 0.0)
        } else {
            // Same operation order as Nemotron: divide, then scale to a percentage.
            (
                py_round(num_sequences as f64 / num_bins as f64, 2),
                py_round(total_tokens as f64 / capacity as f64 * 100.0, 1),
            )
        };
        PackStats {
            num_sequences,
            num_packed_sequences: num_bins,
            total_tokens,
            num_truncated_to_pack_size,
            packing_factor,
            packing_efficiency,
        }
    }
}

/// Python's `round(x, ndigits)` for floats, bit for bit.
///
/// CPython rounds the *exact* binary value of `x` to `ndigits` decimals, ties to even, then
/// reads the decimal back as the nearest double. So `round(1.125, 2) == 1.12` (an exact tie,
/// to even) while `round(2.675, 2) == 2.67` (the double is just below 2.675). Naive
/// `(x * 100).round() / 100` gets both wrong. Supports `ndigits` up to 22.
pub fn py_round(x: f64, ndigits: u32) -> f64 {
    // Doubles of magnitude ≥ 2^52 are integers already; rounding to ≥ 0 decimals keeps them.
    if !x.is_finite() || x == 0.0 || x.abs() >= 4_503_599_627_370_496.0 || ndigits > 22 {
        return x;
    }
    // |x| = m · 2^-shift exactly, with shift ≥ 1 because |x| < 2^52.
    let bits = x.abs().to_bits();
    let biased_exp = ((bits >> 52) & 0x7ff) as i64;
    let fraction = bits & ((1u64 << 52) - 1);
    let (m, exp) = if biased_exp == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1u64 << 52), biased_exp - 1075)
    };
    let shift = (-exp) as u32;
    // |x| · 10^ndigits = num / 2^shift; num < 2^53 · 10^22 < 2^127.
    let num = u128::from(m) * 10u128.pow(ndigits);
    let q = if shift >= 128 {
        0 // num / 2^shift < 1/2
    } else {
        let q = num >> shift;
        let rem = num & ((1u128 << shift) - 1);
        let half = 1u128 << (shift - 1);
        if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        }
    };
    // Rust's float parsing is correctly rounded, like CPython's strtod.
    let magnitude: f64 = format!("{q}e-{ndigits}").parse().unwrap_or(f64::NAN);
    magnitude.copysign(x)
}

// ---------------------------------------------------------------------------------------------
// 4–5. Train/valid/test splits at shard granularity (step 12; Nemotron `utils/splits.py`)
// ---------------------------------------------------------------------------------------------

/// Whole-shard split sizes `(train, valid, test)` for `total_shards` shards (step 12).
///
/// - The ratios must each be finite and ≥ 0 and sum to 1 within 1e-6.
/// - With `total_shards ≤ 2` everything goes to train.
/// - Otherwise valid and test each get 0 shards if their ratio is 0, else
///   `max(1, round(total · ratio))` with Python's `round` (ties to even: 2.5 → 2).
/// - Train always keeps at least one shard: if valid + test > total − 1, both are scaled by
///   `(total − 1) / (valid + test)` and truncated (then, should they still exceed the budget,
///   test gives way), as Nemotron does.
/// - Train is the **remainder** `total − valid − test`; `train` itself only takes part in the
///   sum check, exactly as in Nemotron.
///
/// `total_shards = 0` gives `(0, 0, 0)`; the caller rejects an empty train split. (Nemotron
/// passes the per-dataset `num_shards` here while pooling every dataset's shards in
/// [`assign_splits`]; choosing what to pass is the caller's business.)
///
/// Differs from Nemotron only in rejecting a negative ratio, which Nemotron treats as 0.
pub fn split_shard_counts(
    total_shards: usize,
    train: f64,
    valid: f64,
    test: f64,
) -> Result<(usize, usize, usize), crate::Error> {
    for (name, ratio) in [("train", train), ("valid", valid), ("test", test)] {
        if !ratio.is_finite() || ratio < 0.0 {
            return Err(crate::Error::new(format!(
                "{name} ratio must be a number ≥ 0, got {ratio}"
            )));
        }
    }
    let sum = train + valid + test;
    if (sum - 1.0).abs() > 1e-6 {
        return Err(crate::Error::new(format!(
            "split ratios must sum to 1.0, got {sum} (train={train}, valid={valid}, test={test})"
        )));
    }
    if total_shards <= 2 {
        return Ok((total_shards, 0, 0));
    }
    let ratio_to_shards = |ratio: f64| -> usize {
        if ratio <= 0.0 {
            0
        } else {
            ((total_shards as f64 * ratio).round_ties_even() as usize).max(1)
        }
    };
    let mut test_n = ratio_to_shards(test);
    let mut valid_n = ratio_to_shards(valid);
    let max_non_train = total_shards - 1;
    if test_n + valid_n > max_non_train {
        let scale = max_non_train as f64 / (test_n + valid_n) as f64;
        test_n = (test_n as f64 * scale) as usize;
        valid_n = (valid_n as f64 * scale) as usize;
        if test_n + valid_n > max_non_train {
            test_n = max_non_train.saturating_sub(valid_n);
        }
    }
    Ok((total_shards - valid_n - test_n, valid_n, test_n))
}

/// Deal shards into `(train, valid, test)` (Nemotron `distribute_shards_to_splits`).
///
/// The shards are shuffled with CPython's `random.Random(seed).shuffle` (pretraining uses seed
/// 42, SFT the packing seed); the first `test_n` go to test, the next `valid_n` to valid and the
/// rest to train, each in shuffled order. Counts larger than what is left are capped (test
/// first, then valid), as Nemotron does.
pub fn assign_splits<T>(
    shards: Vec<T>,
    seed: u64,
    valid_n: usize,
    test_n: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut test = shards;
    PyRandom::new(seed).shuffle(&mut test);
    let test_n = test_n.min(test.len());
    let valid_n = valid_n.min(test.len() - test_n);
    let mut valid = test.split_off(test_n);
    let train = valid.split_off(valid_n);
    (train, valid, test)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected bins, split counts and shard assignments marked "CPython" were printed by a small
    // Python 3.11 re-implementation written from Nemotron's code (steps 9 and 12, using
    // `random.Random(seed).shuffle`); the deterministic ones were also derived by hand.

    const FFD: Algorithm = Algorithm::FirstFitDecreasing;
    const CONCAT: Algorithm = Algorithm::Concatenative;
    fn shuffle(seed: u64) -> Algorithm {
        Algorithm::FirstFitShuffle { seed }
    }

    const L1: [usize; 8] = [5, 3, 8, 2, 7, 1, 4, 6];
    /// Two over-long items (12 and 15 → 10) and tied lengths.
    const L2: [usize; 6] = [12, 4, 4, 15, 6, 4];
    /// 40 lengths in 1..=40 (CPython `random.Random(2024).randint(1, 40)`), packed into 64.
    const L3: [usize; 40] = [
        31, 12, 38, 20, 13, 27, 17, 35, 16, 32, 23, 27, 34, 40, 14, 20, 35, 22, 34, 5, 14, 30, 10,
        35, 14, 27, 4, 23, 27, 30, 8, 9, 21, 25, 22, 23, 13, 21, 28, 27,
    ];

    fn bins(v: &[&[usize]]) -> Vec<Vec<usize>> {
        v.iter().map(|b| b.to_vec()).collect()
    }

    /// Every index exactly once, and no bin over `pack_size` (after clamping).
    fn check_invariants(lengths: &[usize], pack_size: usize, got: &[Vec<usize>]) {
        let mut seen = vec![0usize; lengths.len()];
        for bin in got {
            assert!(!bin.is_empty(), "empty bin");
            let used: usize = bin.iter().map(|&i| lengths[i].min(pack_size)).sum();
            assert!(used <= pack_size, "bin {bin:?} holds {used} > {pack_size}");
            for &i in bin {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "indices seen {seen:?}");
    }

    /// The textbook linear-scan first fit, to check the segment tree against.
    fn naive_first_fit(lengths: &[usize], order: &[usize], pack_size: usize) -> Vec<Vec<usize>> {
        let mut bins: Vec<Vec<usize>> = Vec::new();
        let mut remaining: Vec<usize> = Vec::new();
        for &i in order {
            let len = lengths[i].min(pack_size);
            match remaining.iter().position(|&r| r >= len) {
                Some(b) => {
                    bins[b].push(i);
                    remaining[b] -= len;
                }
                None => {
                    bins.push(vec![i]);
                    remaining.push(pack_size - len);
                }
            }
        }
        bins
    }

    #[test]
    fn algorithm_names_round_trip() {
        for name in ALGORITHM_NAMES {
            assert_eq!(Algorithm::from_name(name, 7).unwrap().name(), name);
        }
        assert_eq!(
            Algorithm::from_name("first_fit_shuffle", 7).unwrap(),
            shuffle(7)
        );
        let err = Algorithm::from_name("best_fit", 0).unwrap_err();
        assert!(err.message.contains("best_fit"), "{err}");
        for name in ALGORITHM_NAMES {
            assert!(err.message.contains(name), "{err}");
        }
    }

    #[test]
    fn first_fit_decreasing_hand_made() {
        // Sorted: 8(#2) 7(#4) 6(#7) 5(#0) 4(#6) 3(#1) 2(#3) 1(#5); each opens a bin until
        // 4 fills 6's bin, 3 fills 7's, 2 fills 8's and 1 joins 5's.
        assert_eq!(
            pack(&L1, 10, &FFD),
            bins(&[&[2, 3], &[4, 1], &[7, 6], &[0, 5]])
        );
        // Clamped [10, 4, 4, 10, 6, 4]: the two clamped items tie and keep input order
        // (sorting raw lengths would put #3 first); then 6, 4, 4, 4 by index.
        assert_eq!(pack(&L2, 10, &FFD), bins(&[&[0], &[3], &[4, 1], &[2, 5]]));
        // CPython cross-check on a longer list.
        assert_eq!(
            pack(&L3, 64, &FFD),
            bins(&[
                &[13, 10],
                &[2, 33],
                &[7, 38],
                &[16, 5],
                &[23, 11],
                &[12, 21],
                &[18, 29],
                &[9, 0],
                &[25, 28, 22],
                &[39, 27, 14],
                &[35, 17, 6],
                &[34, 32, 37],
                &[3, 15, 8, 30],
                &[20, 24, 4, 36, 31],
                &[1, 19, 26],
            ])
        );
    }

    #[test]
    fn concatenative_hand_made() {
        // 5+3 | 8+2 | 7+1 | 4+6: a bin closes as soon as the next item does not fit.
        assert_eq!(
            pack(&L1, 10, &CONCAT),
            bins(&[&[0, 1], &[2, 3], &[4, 5], &[6, 7]])
        );
        assert_eq!(
            pack(&L2, 10, &CONCAT),
            bins(&[&[0], &[1, 2], &[3], &[4, 5]])
        );
        // Earlier bins are never revisited: 9 | 9 | 1 would be 9+1 | 9 under first fit.
        assert_eq!(pack(&[9, 9, 1], 10, &CONCAT), bins(&[&[0], &[1, 2]]));
        assert_eq!(pack(&[9, 2, 1], 10, &CONCAT), bins(&[&[0], &[1, 2]]));
        assert_eq!(pack(&[9, 2, 1], 10, &FFD), bins(&[&[0, 2], &[1]]));
        assert_eq!(
            pack(&L3, 64, &CONCAT),
            bins(&[
                &[0, 1],
                &[2, 3],
                &[4, 5, 6],
                &[7, 8],
                &[9, 10],
                &[11, 12],
                &[13, 14],
                &[15, 16],
                &[17, 18, 19],
                &[20, 21, 22],
                &[23, 24],
                &[25, 26, 27],
                &[28, 29],
                &[30, 31, 32, 33],
                &[34, 35, 36],
                &[37, 38],
                &[39],
            ])
        );
    }

    #[test]
    fn first_fit_shuffle_matches_cpython() {
        // CPython: random.Random(seed).shuffle([(len, idx), ...]) then first fit.
        assert_eq!(
            pack(&L1, 10, &shuffle(42)),
            bins(&[&[3, 4, 5], &[6, 7], &[2], &[0, 1]])
        );
        assert_eq!(
            pack(&L1, 10, &shuffle(0)),
            bins(&[&[4, 1], &[5, 2], &[0, 3], &[7, 6]])
        );
        assert_eq!(
            pack(&L1, 10, &shuffle((1 << 40) + 7)),
            bins(&[&[0, 5, 6], &[3, 1], &[4], &[2], &[7]])
        );
        assert_eq!(
            pack(&L2, 10, &shuffle(7)),
            bins(&[&[4, 5], &[0], &[3], &[1, 2]])
        );
        assert_eq!(
            pack(&L3, 64, &shuffle(42)),
            bins(&[
                &[9, 3, 30, 26],
                &[10, 36, 25],
                &[24, 11, 4, 22],
                &[32, 21, 31],
                &[28, 23],
                &[18, 34, 19],
                &[12, 35],
                &[13, 20],
                &[37, 29, 1],
                &[16, 39],
                &[33, 2],
                &[0, 38],
                &[27, 5, 14],
                &[6, 8, 15],
                &[17, 7],
            ])
        );
    }

    #[test]
    fn same_seed_same_bins() {
        for seed in [0, 1, 42, u64::MAX] {
            assert_eq!(pack(&L3, 64, &shuffle(seed)), pack(&L3, 64, &shuffle(seed)));
        }
        assert_ne!(pack(&L3, 64, &shuffle(42)), pack(&L3, 64, &shuffle(43)));
    }

    #[test]
    fn empty_input_gives_no_bins() {
        for algo in [FFD, CONCAT, shuffle(42)] {
            assert!(pack(&[], 16, &algo).is_empty());
        }
    }

    #[test]
    fn invariants_and_segment_tree_match_linear_scan() {
        let mut rng = PyRandom::new(99);
        for round in 0..200 {
            let pack_size = 1 + rng.randbelow(64) as usize;
            let n = rng.randbelow(60) as usize;
            // Some lengths exceed pack_size, some are zero.
            let lengths: Vec<usize> = (0..n)
                .map(|_| rng.randbelow(pack_size as u64 + 8) as usize)
                .collect();
            for algo in [FFD, CONCAT, shuffle(round)] {
                let got = pack(&lengths, pack_size, &algo);
                check_invariants(&lengths, pack_size, &got);
            }
            let clamped: Vec<usize> = lengths.iter().map(|&l| l.min(pack_size)).collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| clamped[b].cmp(&clamped[a]));
            assert_eq!(
                pack(&lengths, pack_size, &FFD),
                naive_first_fit(&lengths, &order, pack_size)
            );
            let mut order: Vec<usize> = (0..n).collect();
            PyRandom::new(round).shuffle(&mut order);
            assert_eq!(
                pack(&lengths, pack_size, &shuffle(round)),
                naive_first_fit(&lengths, &order, pack_size)
            );
        }
    }

    #[test]
    fn over_long_sequences_are_truncated_and_counted() {
        let got = pack(&L2, 10, &FFD);
        check_invariants(&L2, 10, &got);
        // The clamped items fill a bin each.
        assert!(got.contains(&vec![0]) && got.contains(&vec![3]));
        let stats = PackStats::compute(&L2, got.len(), 10);
        assert_eq!(stats.num_truncated_to_pack_size, 2);
        assert_eq!(stats.total_tokens, 10 + 4 + 4 + 10 + 6 + 4);
        // Exactly pack_size is not truncated.
        assert_eq!(
            PackStats::compute(&[10, 11, 9], 3, 10).num_truncated_to_pack_size,
            1
        );

        let seqs = vec![Sequence {
            tokens: (1..=6).collect(),
            mask: vec![0, 0, 1, 1, 1, 1],
        }];
        let row = materialize(&seqs, &[0], 4);
        assert_eq!(row.input_ids, vec![1, 2, 3, 4]);
        // Aligned over the truncated subsequence: its last kept position gets 0.
        assert_eq!(row.loss_mask, vec![0, 1, 1, 0]);
        assert_eq!(row.seq_start_id, vec![0]);
    }

    fn seq(tokens: &[u32], mask: &[u8]) -> Sequence {
        Sequence {
            tokens: tokens.to_vec(),
            mask: mask.to_vec(),
        }
    }

    #[test]
    fn materialize_concatenates_in_bin_order_with_label_aligned_mask() {
        let seqs = vec![
            seq(&[1, 2, 3, 4], &[0, 0, 1, 1]),
            seq(&[5, 6, 7], &[1, 1, 1]),
            seq(&[9], &[1]),
        ];
        let row = materialize(&seqs, &[0, 1, 2], 16);
        assert_eq!(row.input_ids, vec![1, 2, 3, 4, 5, 6, 7, 9]);
        // A: [0,1,1,0]; B: [1,1,0] — position 3 stays 0 although B's first token is trained
        // (no bleed); C (single token): [0].
        assert_eq!(row.loss_mask, vec![0, 1, 1, 0, 1, 1, 0, 0]);
        assert_eq!(row.seq_start_id, vec![0, 4, 7]);

        let row = materialize(&seqs, &[2, 1, 0], 16);
        assert_eq!(row.input_ids, vec![9, 5, 6, 7, 1, 2, 3, 4]);
        assert_eq!(row.loss_mask, vec![0, 1, 1, 0, 0, 1, 1, 0]);
        assert_eq!(row.seq_start_id, vec![0, 1, 4]);

        // A lone single-token sequence.
        let row = materialize(&seqs, &[2], 16);
        assert_eq!(
            (row.input_ids, row.loss_mask, row.seq_start_id),
            (vec![9], vec![0], vec![0])
        );
    }

    #[test]
    fn materialize_never_exceeds_pack_size_and_skips_empty_sequences() {
        let seqs = vec![
            seq(&[1, 2, 3], &[1, 1, 1]),
            seq(&[], &[]),
            seq(&[4, 5, 6], &[1, 1, 1]),
            seq(&[7], &[1]),
        ];
        // Not a bin `pack` would make: the second non-empty sequence is cut to the space left.
        let row = materialize(&seqs, &[0, 1, 2, 3], 4);
        assert_eq!(row.input_ids, vec![1, 2, 3, 4]);
        assert_eq!(row.loss_mask, vec![1, 1, 0, 0]);
        assert_eq!(row.seq_start_id, vec![0, 3]);
        // A short mask reads as 0 rather than panicking.
        let row = materialize(&[seq(&[1, 2, 3], &[1])], &[0], 8);
        assert_eq!(row.loss_mask, vec![0, 0, 0]);
    }

    #[test]
    fn packed_rows_satisfy_seq_start_id_rules() {
        let mut rng = PyRandom::new(5);
        let seqs: Vec<Sequence> = (0..50)
            .map(|_| {
                let len = 1 + rng.randbelow(40) as usize;
                Sequence {
                    tokens: (0..len).map(|_| rng.randbelow(1000) as u32).collect(),
                    mask: (0..len).map(|_| rng.randbelow(2) as u8).collect(),
                }
            })
            .collect();
        let lengths: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let pack_size = 32;
        for algo in [FFD, CONCAT, shuffle(42)] {
            for bin in pack(&lengths, pack_size, &algo) {
                let row = materialize(&seqs, &bin, pack_size);
                assert!(row.input_ids.len() <= pack_size);
                assert_eq!(row.loss_mask.len(), row.input_ids.len());
                assert_eq!(row.seq_start_id.len(), bin.len());
                assert_eq!(row.seq_start_id[0], 0);
                assert!(row.seq_start_id.windows(2).all(|w| w[0] < w[1]));
                assert!((*row.seq_start_id.last().unwrap() as usize) < row.input_ids.len());
                // Per subsequence: the aligned mask is the original shifted left, then 0.
                let mut bounds: Vec<usize> = row.seq_start_id.iter().map(|&s| s as usize).collect();
                bounds.push(row.input_ids.len());
                for (k, &i) in bin.iter().enumerate() {
                    let (s, e) = (bounds[k], bounds[k + 1]);
                    let len = e - s;
                    let original = &seqs[i].mask[..len];
                    let mut expected = original[1..].to_vec();
                    expected.push(0);
                    assert_eq!(&row.loss_mask[s..e], &expected[..]);
                    let ids: Vec<i32> = seqs[i].tokens[..len].iter().map(|&t| t as i32).collect();
                    assert_eq!(&row.input_ids[s..e], &ids[..]);
                }
            }
        }
    }

    #[test]
    fn stats_as_nemotron_computes_them() {
        let stats = PackStats::compute(&L2, 4, 10);
        assert_eq!(
            stats,
            PackStats {
                num_sequences: 6,
                num_packed_sequences: 4,
                total_tokens: 38,
                num_truncated_to_pack_size: 2,
                packing_factor: 1.5,
                packing_efficiency: 95.0,
            }
        );
        // Values from CPython: round(n / bins, 2), round(tokens / (bins * pack) * 100, 1).
        // 9/8 = 1.125 is an exact tie → 1.12 (to even); 11/8 = 1.375 → 1.38.
        let ones = |n: usize| vec![1usize; n];
        assert_eq!(PackStats::compute(&ones(9), 8, 1000).packing_factor, 1.12);
        assert_eq!(PackStats::compute(&ones(11), 8, 1000).packing_factor, 1.38);
        assert_eq!(PackStats::compute(&ones(7), 3, 1000).packing_factor, 2.33);
        // 1/16 · 100 = 6.25 → 6.2 (to even); 3/16 · 100 = 18.75 → 18.8; 2/9 · 100 → 22.2.
        assert_eq!(PackStats::compute(&[1], 1, 16).packing_efficiency, 6.2);
        assert_eq!(PackStats::compute(&[3], 1, 16).packing_efficiency, 18.8);
        assert_eq!(PackStats::compute(&[2], 3, 3).packing_efficiency, 22.2);
        assert_eq!(PackStats::compute(&[1], 1, 3).packing_efficiency, 33.3);
        // No bins: both 0.
        let empty = PackStats::compute(&[], 0, 10);
        assert_eq!((empty.packing_factor, empty.packing_efficiency), (0.0, 0.0));
        assert_eq!(empty.num_sequences, 0);
    }

    #[test]
    fn py_round_matches_cpython() {
        // (x, ndigits, round(x, ndigits)) as printed by CPython 3.11.
        let cases: [(f64, u32, f64); 17] = [
            (2.675, 2, 2.67),
            (0.125, 2, 0.12),
            (0.375, 2, 0.38),
            (1.005, 2, 1.0),
            (87.25, 1, 87.2),
            (87.35, 1, 87.3),
            (2.5, 0, 2.0),
            (0.5, 0, 0.0),
            (1.5, 0, 2.0),
            (-0.125, 2, -0.12),
            (100.0, 1, 100.0),
            (66.66666666666667, 1, 66.7),
            (1e-320, 2, 0.0),
            (0.005, 2, 0.01),
            (0.015, 2, 0.01),
            (0.025, 2, 0.03),
            (5e15 + 0.5, 1, 5e15 + 0.5),
        ];
        for (x, n, expected) in cases {
            assert_eq!(
                py_round(x, n).to_bits(),
                expected.to_bits(),
                "round({x}, {n})"
            );
        }
    }

    #[test]
    fn split_counts_match_nemotron() {
        // (total, train, valid, test) → (train, valid, test), from CPython running the
        // recipe's conversion.
        type Case = ((usize, f64, f64, f64), (usize, usize, usize));
        let cases: [Case; 16] = [
            ((128, 0.98, 0.01, 0.01), (126, 1, 1)),
            ((1000, 0.98, 0.01, 0.01), (980, 10, 10)),
            // A ratio that rounds to 0 shards still gets 1.
            ((3, 0.98, 0.01, 0.01), (1, 1, 1)),
            ((50, 0.98, 0.01, 0.01), (48, 1, 1)),
            // ≤ 2 shards: everything to train.
            ((2, 0.98, 0.01, 0.01), (2, 0, 0)),
            ((1, 0.98, 0.01, 0.01), (1, 0, 0)),
            ((0, 0.98, 0.01, 0.01), (0, 0, 0)),
            // Ratio 0 ⇒ 0 shards.
            ((10, 1.0, 0.0, 0.0), (10, 0, 0)),
            ((10, 0.9, 0.1, 0.0), (9, 1, 0)),
            // Python rounding, ties to even: 2.5 → 2, 1.5 → 2, 3.5 → 4.
            ((250, 0.98, 0.01, 0.01), (246, 2, 2)),
            ((150, 0.98, 0.01, 0.01), (146, 2, 2)),
            ((10, 0.5, 0.25, 0.25), (6, 2, 2)),
            ((10, 0.3, 0.35, 0.35), (2, 4, 4)),
            // Train keeps ≥ 1: 2 + 2 > 2 scales to 1 + 1; 2 + 2 > 3 scales to 1 + 1.
            ((3, 0.0, 0.5, 0.5), (1, 1, 1)),
            ((4, 0.2, 0.4, 0.4), (2, 1, 1)),
            // 2.5 → 2 each (to even), which fits without scaling.
            ((5, 0.0, 0.5, 0.5), (1, 2, 2)),
        ];
        for ((total, tr, va, te), expected) in cases {
            assert_eq!(
                split_shard_counts(total, tr, va, te),
                Ok(expected),
                "{total} shards, ratios {tr}/{va}/{te}"
            );
        }
        for total in 3..200 {
            let (train, valid, test) = split_shard_counts(total, 0.0, 0.5, 0.5).unwrap();
            assert!(train >= 1);
            assert_eq!(train + valid + test, total);
        }
    }

    #[test]
    fn split_ratios_are_validated() {
        let err = split_shard_counts(10, 0.9, 0.1, 0.1).unwrap_err();
        assert!(err.message.contains("sum to 1.0"), "{err}");
        assert!(split_shard_counts(10, 0.98, 0.01, 0.0100005).is_ok());
        assert!(split_shard_counts(10, 1.1, -0.1, 0.0).is_err());
        assert!(split_shard_counts(10, f64::NAN, 0.5, 0.5).is_err());
    }

    #[test]
    fn assign_splits_matches_python_shuffle() {
        // CPython: s = list(range(n)); random.Random(seed).shuffle(s);
        // test = s[:t], valid = s[t:t+v], train = s[t+v:]
        let shards: Vec<u32> = (0..10).collect();
        assert_eq!(
            assign_splits(shards.clone(), 42, 1, 1),
            (vec![2, 8, 5, 6, 9, 4, 0, 1], vec![3], vec![7])
        );
        assert_eq!(
            assign_splits(shards.clone(), 42, 2, 3),
            (vec![6, 9, 4, 0, 1], vec![8, 5], vec![7, 3, 2])
        );
        assert_eq!(
            assign_splits((0..20).collect::<Vec<u32>>(), 7, 1, 2),
            (
                vec![18, 7, 6, 19, 3, 14, 0, 9, 5, 16, 8, 13, 2, 1, 12, 4, 10],
                vec![11],
                vec![17, 15]
            )
        );
        // Counts are capped: test first, then valid.
        assert_eq!(
            assign_splits(vec![0u32, 1, 2], 42, 5, 5),
            (vec![], vec![], vec![1, 0, 2])
        );
        // Deterministic, and works on any item type (e.g. (weight, path) pairs).
        let named: Vec<(String, String)> = (0..10)
            .map(|i| ("1.0".to_string(), format!("shard_{i:06}")))
            .collect();
        let a = assign_splits(named.clone(), 42, 1, 1);
        assert_eq!(a, assign_splits(named, 42, 1, 1));
        assert_eq!(a.2[0].1, "shard_000007");
    }
}

/// Step 12, non-uniform weights: keep whole shards of each dataset so that a split's row
/// mix matches the normalized weights. With `rows_i` the rows dataset `i` has in the split and
/// `w_i` its normalized weight, the target total is `T = min_i rows_i / w_i`; each dataset keeps
/// its shards, in split order, while one more moves its kept rows closer to `w_i · T`, and always
/// keeps at least one. `shards` is `(dataset index, rows)` in split order; `weights[d] > 0`.
/// Returns the positions of the kept shards, in order.
pub fn subsample_by_weight(shards: &[(usize, usize)], weights: &[f64]) -> Vec<usize> {
    let total_w: f64 = weights.iter().sum();
    let mut rows = vec![0usize; weights.len()];
    for &(d, r) in shards {
        rows[d] += r;
    }
    let target = (0..weights.len())
        .filter(|&d| rows[d] > 0)
        .map(|d| rows[d] as f64 / (weights[d] / total_w))
        .fold(f64::INFINITY, f64::min);
    let mut kept_rows = vec![0usize; weights.len()];
    let mut kept = Vec::new();
    for (pos, &(d, r)) in shards.iter().enumerate() {
        let want = weights[d] / total_w * target;
        let closer = ((kept_rows[d] + r) as f64 - want).abs() < (kept_rows[d] as f64 - want).abs();
        if kept_rows[d] == 0 || closer {
            kept_rows[d] += r;
            kept.push(pos);
        }
    }
    kept
}

#[cfg(test)]
mod weighted_tests {
    use super::subsample_by_weight;

    #[test]
    fn shards_are_kept_to_match_the_weights() {
        // Dataset 0: 4 shards of 100 rows; dataset 1: 4 shards of 100 rows; weights 3:1.
        // T = min(400 / 0.75, 400 / 0.25) = 533.3: dataset 0 wants 400 (keeps all four),
        // dataset 1 wants 133.3 (one shard: 100 is closer than 200).
        let shards = [
            (0, 100),
            (1, 100),
            (0, 100),
            (1, 100),
            (0, 100),
            (1, 100),
            (0, 100),
            (1, 100),
        ];
        assert_eq!(
            subsample_by_weight(&shards, &[3.0, 1.0]),
            vec![0, 1, 2, 4, 6]
        );
        // Uniform weights keep everything.
        assert_eq!(subsample_by_weight(&shards, &[1.0, 1.0]).len(), 8);
        // A dataset always keeps at least one shard, however small its weight.
        assert_eq!(
            subsample_by_weight(&[(0, 100), (1, 500)], &[1.0, 0.001]),
            vec![0, 1]
        );
    }
}
