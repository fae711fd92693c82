//! The order training rows are visited in: a seeded permutation per epoch, as Megatron-Bridge's
//! samplers draw it (numpy's `RandomState(seed + epoch).permutation(n)`).

use nemo_dag_data::random::NumpyRandomState;

/// A seeded order over `n` rows, reshuffled every epoch: global sample `i` is row
/// `perm(epoch)[i mod n]`, with `perm(e)` a numpy `RandomState(seed + e)` permutation — a pure
/// function of `i`, so a resumed run reads the rows an uninterrupted one would. Shared by the
/// ops that visit rows epoch after epoch.
pub struct RowOrder {
    n: usize,
    seed: u32,
    cached: Option<(u64, Vec<usize>)>,
}

impl RowOrder {
    pub fn new(n: usize, seed: u32) -> RowOrder {
        RowOrder {
            n,
            seed,
            cached: None,
        }
    }

    pub fn row(&mut self, i: u64) -> usize {
        let epoch = i / self.n as u64;
        if self.cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut rng = NumpyRandomState::new(self.seed.wrapping_add(epoch as u32));
            self.cached = Some((epoch, rng.permutation(self.n)));
        }
        match &self.cached {
            Some((_, perm)) => perm[(i % self.n as u64) as usize],
            None => 0,
        }
    }
}
