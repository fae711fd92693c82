//! The Mersenne Twister MT19937, once, with the two seeded front ends Nemotron's data
//! preparation draws from: CPython's `random.Random` ([`PyRandom`], for SFT packing and
//! splits) and numpy's legacy `RandomState` ([`NumpyRandomState`], for Megatron's dataset
//! indices). Both are bit-for-bit reproductions, tested against values the originals printed.
//!
//! The generator is the reference implementation by Matsumoto and Nishimura
//! (`mt19937ar.c`: `init_genrand`, `init_by_array`, `genrand_int32`), which CPython's
//! `Modules/_randommodule.c` and numpy's `numpy/random/src/mt19937/` both carry.

mod numpy;
mod python;

pub use numpy::NumpyRandomState;
pub use python::PyRandom;

/// Degree of recurrence (state size in 32-bit words).
const N: usize = 624;
/// Middle word offset.
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// MT19937's state and its 32-bit output.
#[derive(Clone)]
pub struct Mt19937 {
    state: [u32; N],
    /// Index of the next word to temper; `N` means the state must be regenerated first.
    index: usize,
}

impl std::fmt::Debug for Mt19937 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mt19937")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl Mt19937 {
    /// `init_genrand(s)`: the state filled from one 32-bit value (numpy's `RandomState(seed)`).
    pub fn from_seed(s: u32) -> Self {
        let mut state = [0u32; N];
        state[0] = s;
        for i in 1..N {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { state, index: N }
    }

    /// `init_by_array(key)`: the state mixed from a key of 32-bit words (CPython's integer
    /// seeds). An empty key is treated as `[0]`.
    pub fn from_key(key: &[u32]) -> Self {
        let key: &[u32] = if key.is_empty() { &[0] } else { key };
        let mut rng = Mt19937::from_seed(19_650_218);
        let mt = &mut rng.state;
        let mut i = 1usize;
        let mut j = 0usize;
        for _ in 0..N.max(key.len()) {
            let prev = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ prev.wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ prev.wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000; // MSB is 1, assuring a non-zero initial array
        rng
    }

    /// Regenerate all `N` words of the state (the reference "twist").
    fn twist(&mut self) {
        let mt = &mut self.state;
        for k in 0..N {
            let y = (mt[k] & UPPER_MASK) | (mt[(k + 1) % N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            mt[k] = mt[(k + M) % N] ^ (y >> 1) ^ mag;
        }
        self.index = 0;
    }

    /// The next tempered 32-bit output (`genrand_int32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_outputs_of_mt19937ar() {
        // mt19937ar.c's own test: init_by_array({0x123, 0x234, 0x345, 0x456}), first outputs
        // as printed by its main() (mt19937ar.out).
        let mut mt = Mt19937::from_key(&[0x123, 0x234, 0x345, 0x456]);
        let first: Vec<u32> = (0..5).map(|_| mt.next_u32()).collect();
        assert_eq!(
            first,
            [
                1_067_595_299,
                955_945_823,
                477_289_528,
                4_107_218_783,
                4_228_976_476
            ]
        );
    }
}
