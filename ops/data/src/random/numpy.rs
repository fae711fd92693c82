//! numpy's legacy `numpy.random.RandomState(seed)` (`numpy/random/mtrand.pyx`,
//! `numpy/random/src/legacy/`), the parts Megatron's `GPTDataset` draws from.

use super::Mt19937;

/// numpy's legacy `numpy.random.RandomState(seed)` for an integer seed in `[0, 2^32)`:
/// only the parts Megatron uses (`shuffle`, hence `permutation`).
#[derive(Clone, Debug)]
pub struct NumpyRandomState {
    mt: Mt19937,
}

impl NumpyRandomState {
    /// `RandomState(seed)`: numpy's `mt19937_seed`, which is the reference `init_genrand`.
    pub fn new(seed: u32) -> Self {
        NumpyRandomState {
            mt: Mt19937::from_seed(seed),
        }
    }

    /// One tempered MT19937 output.
    pub fn next_u32(&mut self) -> u32 {
        self.mt.next_u32()
    }

    /// numpy's `next_uint64` for MT19937: two outputs, the first one high.
    fn next_u64(&mut self) -> u64 {
        let high = u64::from(self.next_u32());
        (high << 32) | u64::from(self.next_u32())
    }

    /// numpy's `random_interval(max)`: uniform in `[0, max]` by masked rejection.
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        mask |= mask >> 1;
        mask |= mask >> 2;
        mask |= mask >> 4;
        mask |= mask >> 8;
        mask |= mask >> 16;
        mask |= mask >> 32;
        if max <= u64::from(u32::MAX) {
            loop {
                let value = u64::from(self.next_u32()) & mask;
                if value <= max {
                    return value;
                }
            }
        } else {
            loop {
                let value = self.next_u64() & mask;
                if value <= max {
                    return value;
                }
            }
        }
    }

    /// `RandomState.shuffle(x)` for a 1-D array: for `i` from `len−1` down to 1,
    /// swap `x[i]` with `x[random_interval(i)]`.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            x.swap(i, j);
        }
    }

    /// `RandomState.permutation(n)`: `arange(n)` shuffled.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut x: Vec<usize> = (0..n).collect();
        self.shuffle(&mut x);
        x
    }
}
