//! Named, trainable parameters and their seeded initialisation.
//!
//! candle's own RNG cannot be seeded reproducibly across runs, so every parameter is drawn here
//! from one [`Rng`] (SplitMix64 → uniform → Box–Muller normal) in a fixed order: the same seed
//! gives the same model, bit for bit, on every machine. The [`ParamStore`] keeps parameters in
//! creation order under dotted names (`blocks.3.attn.qkv`), which are also their names in
//! checkpoints.

use candle_core::{DType, Device, Result, Tensor, Var};

pub use kernels::rng::Rng;

/// Every trainable tensor of a model, in creation order, under its dotted name.
#[derive(Default)]
pub struct ParamStore {
    vars: Vec<(String, Var)>,
}

impl ParamStore {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.vars.iter().map(|(n, v)| (n.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// Every parameter's values as f32, in creation order (for checks and comparisons).
    pub fn values(&self) -> Result<Vec<Vec<f32>>> {
        self.vars.iter().map(|(_, v)| to_f32_vec(v)).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Total number of scalars.
    pub fn count(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    fn add(&mut self, name: String, values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        let t = Tensor::from_vec(values, shape, &Device::Cpu)?;
        let var = Var::from_tensor(&t)?;
        let tensor = var.as_tensor().clone();
        self.vars.push((name, var));
        Ok(tensor)
    }
}

/// Creates parameters under a name prefix, drawing from one seeded generator.
pub struct Init<'a> {
    pub rng: &'a mut Rng,
    pub store: &'a mut ParamStore,
    pub prefix: String,
}

impl<'a> Init<'a> {
    pub fn new(rng: &'a mut Rng, store: &'a mut ParamStore) -> Init<'a> {
        Init {
            rng,
            store,
            prefix: String::new(),
        }
    }

    /// The same generator and store, under `prefix.name`.
    pub fn sub(&mut self, name: &str) -> Init<'_> {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        };
        Init {
            rng: self.rng,
            store: self.store,
            prefix,
        }
    }

    fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// A parameter whose values come from `f(rng)`, one call per element in row-major order.
    pub fn with(
        &mut self,
        name: &str,
        shape: &[usize],
        mut f: impl FnMut(&mut Rng) -> f64,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| f(self.rng) as f32).collect();
        let name = self.name(name);
        self.store.add(name, values, shape)
    }

    pub fn normal(&mut self, name: &str, shape: &[usize], std: f64) -> Result<Tensor> {
        self.with(name, shape, |r| r.normal() * std)
    }

    pub fn uniform(&mut self, name: &str, shape: &[usize], lo: f64, hi: f64) -> Result<Tensor> {
        self.with(name, shape, |r| lo + (hi - lo) * r.uniform())
    }

    pub fn constant(&mut self, name: &str, shape: &[usize], value: f64) -> Result<Tensor> {
        self.with(name, shape, |_| value)
    }
}

/// A tensor that is not trained (masks, rotary tables), on the CPU.
pub fn constant_f32(values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// All values of a tensor as f32, row-major (for checks and checkpoints).
pub fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_reproducible_and_roughly_normal() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        let xs: Vec<f64> = (0..20000).map(|_| a.normal()).collect();
        let ys: Vec<f64> = (0..20000).map(|_| b.normal()).collect();
        assert_eq!(xs, ys);
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        assert_ne!(Rng::new(8).next_u64(), Rng::new(7).next_u64());
    }

    #[test]
    fn parameters_keep_creation_order_and_dotted_names() {
        let mut rng = Rng::new(1);
        let mut store = ParamStore::default();
        let mut init = Init::new(&mut rng, &mut store);
        init.sub("blocks.0").normal("w", &[2, 3], 0.02).unwrap();
        init.constant("norm", &[3], 1.0).unwrap();
        let names: Vec<&str> = store.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["blocks.0.w", "norm"]);
        assert_eq!(store.count(), 9);
    }
}
