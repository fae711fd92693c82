//! CPython's `random.Random(seed)`, re-implemented bit for bit for integer seeds.
//!
//! Nemotron makes two seeded choices with Python's standard-library generator, and nemo-dag
//! must make the same ones to produce the same artifacts:
//! - `first_fit_shuffle` packing shuffles a shard's sequences with `random.Random(seed)`
//!   before first-fit (Nemotron `FirstFitShufflePacker`);
//! - train/valid/test splitting shuffles the pooled shards with `random.Random(42)` for
//!   pretraining and `random.Random(packing_seed)` for SFT (`distribute_shards_to_splits`).
//!
//! What CPython does, and what this module reproduces:
//! - The generator is the 32-bit Mersenne Twister MT19937 ([`Mt19937`]).
//! - An integer seed is made non-negative (`abs`), cut into 32-bit words, least significant
//!   first (at least one word, so seed 0 is the key `[0]`), and fed to the reference
//!   `init_by_array` routine (itself started from `init_genrand(19650218)`).
//! - `getrandbits(k)` for `k <= 32` keeps the *top* `k` bits of one output; for larger `k`
//!   it fills 32-bit words from the least significant end, each from one output, the last
//!   one keeping only its top bits. `getrandbits(0)` is 0 and consumes nothing.
//! - `_randbelow(n)` draws `getrandbits(n.bit_length())` until the value is below `n`.
//! - `shuffle(x)` is Fisher–Yates from the end: for `i` from `len-1` down to 1, swap `x[i]`
//!   with `x[_randbelow(i + 1)]`.
//! - `random()` combines two outputs into a 53-bit float: `(a >> 5, b >> 6)` →
//!   `(a * 2^26 + b) / 2^53`.
//!
//! The unit tests compare against values printed by CPython 3.11.

use super::Mt19937;

/// A generator in the same state as CPython's `random.Random(seed)`.
#[derive(Clone, Debug)]
pub struct PyRandom {
    mt: Mt19937,
}

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed.
    pub fn new(seed: u64) -> Self {
        let low = seed as u32;
        let high = (seed >> 32) as u32;
        if high == 0 {
            Self::from_key(&[low])
        } else {
            Self::from_key(&[low, high])
        }
    }

    /// `random.Random(seed)` for a possibly negative integer seed (CPython seeds with `abs(seed)`).
    pub fn new_signed(seed: i64) -> Self {
        Self::new(seed.unsigned_abs())
    }

    /// Seed from the 32-bit words of `abs(seed)`, least significant first, as CPython does for
    /// integers of any size. An empty key is treated as `[0]` (CPython always uses one word).
    pub fn from_key(key: &[u32]) -> Self {
        PyRandom {
            mt: Mt19937::from_key(key),
        }
    }

    /// The next 32-bit output (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        self.mt.next_u32()
    }

    /// `getrandbits(k)` for `k <= 64`.
    ///
    /// # Panics
    /// If `k > 64` (CPython allows any `k`; nemo-dag never needs more than 64 bits).
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        assert!(k <= 64, "getrandbits supports at most 64 bits, got {k}");
        if k == 0 {
            return 0;
        }
        if k <= 32 {
            return u64::from(self.next_u32() >> (32 - k));
        }
        // Words are filled from the least significant end; the last keeps its top bits.
        let low = u64::from(self.next_u32());
        let high = u64::from(self.next_u32() >> (64 - k));
        (high << 32) | low
    }

    /// `_randbelow(n)`: a uniform integer in `[0, n)` by rejection on `getrandbits`.
    ///
    /// `n == 0` returns 0 without consuming anything (CPython would loop forever).
    pub fn randbelow(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let k = u64::BITS - n.leading_zeros(); // n.bit_length()
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `shuffle(x)`: CPython's in-place Fisher–Yates.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.randbelow(i as u64 + 1) as usize;
            x.swap(i, j);
        }
    }

    /// `random()`: a float in `[0, 1)` with 53 random bits.
    pub fn random(&mut self) -> f64 {
        let a = f64::from(self.next_u32() >> 5);
        let b = f64::from(self.next_u32() >> 6);
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Every expected value below was printed by CPython 3.11's `random.Random(seed)`, e.g.
    //   python3 -c "import random; r=random.Random(42); print([r.getrandbits(32) for _ in range(5)])"
    // Seeds: 0 and 42 (one key word), 2**40+7 = 1099511627783 and 2**64-1 (two key words).

    #[test]
    fn getrandbits_32_matches_cpython() {
        let cases: [(u64, [u64; 5]); 4] = [
            (
                0,
                [3626764237, 1654615998, 3255389356, 3823568514, 1806341205],
            ),
            (
                42,
                [2746317213, 478163327, 107420369, 3184935163, 1181241943],
            ),
            (
                (1 << 40) + 7,
                [2635837658, 3209733218, 3500038837, 4028389051, 4058793509],
            ),
            (
                u64::MAX,
                [93740670, 1068495656, 1452108352, 2657516307, 910393425],
            ),
        ];
        for (seed, expected) in cases {
            let mut r = PyRandom::new(seed);
            let got: Vec<u64> = (0..5).map(|_| r.getrandbits(32)).collect();
            assert_eq!(got, expected, "seed {seed}");
        }
    }

    #[test]
    fn random_matches_cpython() {
        // From CPython 3.11: [r.random() for _ in range(3)]
        let cases: [(u64, [f64; 3]); 3] = [
            (
                0,
                [0.8444218515250481, 0.7579544029403025, 0.420571580830845],
            ),
            (
                42,
                [
                    0.6394267984578837,
                    0.025010755222666936,
                    0.27502931836911926,
                ],
            ),
            (
                (1 << 40) + 7,
                [0.6137037779936511, 0.8149162973309487, 0.9450115087592873],
            ),
        ];
        for (seed, expected) in cases {
            let mut r = PyRandom::new(seed);
            for e in expected {
                assert_eq!(r.random().to_bits(), e.to_bits(), "seed {seed}");
            }
        }
    }

    #[test]
    fn shuffle_matches_cpython() {
        // From CPython 3.11: x = list(range(10)); r.shuffle(x); print(x)
        let cases: [(u64, [u32; 10]); 5] = [
            (0, [7, 8, 1, 5, 3, 4, 2, 0, 9, 6]),
            (42, [7, 3, 2, 8, 5, 6, 9, 4, 0, 1]),
            ((1 << 40) + 7, [0, 5, 2, 3, 6, 1, 8, 4, 7, 9]),
            (u64::MAX, [2, 6, 7, 9, 8, 1, 4, 5, 3, 0]),
            (12345678901234567, [6, 3, 0, 7, 9, 2, 5, 4, 8, 1]),
        ];
        for (seed, expected) in cases {
            let mut r = PyRandom::new(seed);
            let mut x: Vec<u32> = (0..10).collect();
            r.shuffle(&mut x);
            assert_eq!(x, expected, "seed {seed}");
        }
    }

    #[test]
    fn getrandbits_widths_match_cpython() {
        // From CPython 3.11: [r.getrandbits(k) for k in (1, 7, 31, 32, 33, 53, 64, 0, 5)]
        // (k = 0 consumes nothing, so the last draw shows the stream continued correctly).
        let widths = [1, 7, 31, 32, 33, 53, 64, 0, 5];
        let cases: [(u64, [u64; 9]); 3] = [
            (
                0,
                [
                    1,
                    49,
                    1627694678,
                    3823568514,
                    1806341205,
                    8696133065399866,
                    8963783824838420066,
                    0,
                    12,
                ],
            ),
            (
                42,
                [
                    1,
                    14,
                    53710184,
                    3184935163,
                    1181241943,
                    1256845828445918,
                    1890702223848595625,
                    0,
                    21,
                ],
            ),
            (
                (1 << 40) + 7,
                [
                    1,
                    95,
                    1750019418,
                    4028389051,
                    8353760805,
                    6355433061425140,
                    4627263377227786602,
                    0,
                    30,
                ],
            ),
        ];
        for (seed, expected) in cases {
            let mut r = PyRandom::new(seed);
            let got: Vec<u64> = widths.iter().map(|&k| r.getrandbits(k)).collect();
            assert_eq!(got, expected, "seed {seed}");
        }
    }

    #[test]
    fn randbelow_matches_cpython() {
        // From CPython 3.11: [r._randbelow(n) for n in (1, 2, 3, 10, 1000, 2**32+1, 2**63+5)]
        let bounds = [1, 2, 3, 10, 1000, (1 << 32) + 1, (1 << 63) + 5];
        let cases: [(u64, [u64; 7]); 3] = [
            (0, [0, 1, 0, 4, 988, 2195908194, 6604845167042249220]),
            (42, [0, 0, 2, 4, 250, 958682846, 1890702223848595625]),
            (
                (1 << 40) + 7,
                [0, 1, 2, 2, 529, 3091373771, 8171530046627343073],
            ),
        ];
        for (seed, expected) in cases {
            let mut r = PyRandom::new(seed);
            let got: Vec<u64> = bounds.iter().map(|&n| r.randbelow(n)).collect();
            assert_eq!(got, expected, "seed {seed}");
        }
    }

    #[test]
    fn signed_seed_uses_absolute_value() {
        let mut a = PyRandom::new_signed(-42);
        let mut b = PyRandom::new(42);
        for _ in 0..10 {
            assert_eq!(a.next_u32(), b.next_u32());
        }
    }

    #[test]
    fn long_stream_crosses_several_twists() {
        // From CPython 3.11: r = random.Random(42); [r.getrandbits(32) for _ in range(2000)][-3:]
        let mut r = PyRandom::new(42);
        let got: Vec<u32> = (0..2000).map(|_| r.next_u32()).collect();
        assert_eq!(&got[1997..], &LONG_STREAM_TAIL_42);
    }

    const LONG_STREAM_TAIL_42: [u32; 3] = [1014096062, 3674130601, 1557724698];
}
