//! What every CPU kernel shares: a storage's values in place, and rows in parallel.

use candle_core::{CpuStorage, Layout, Result, Tensor, bail};
use rayon::prelude::*;

/// A contiguous f32 storage's values under `l`.
pub(crate) fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("fused op: input is not contiguous")
    };
    Ok(&s.as_slice::<f32>()?[start..end])
}

/// Rows are processed in parallel only when there is enough work to pay for it.
pub(crate) const PAR_MIN: usize = 1 << 15;

/// `f(index, row)` over `out` cut in rows of `width`, in parallel when `out` is large.
pub(crate) fn for_rows(
    out: &mut [f32],
    width: usize,
    f: impl Fn((usize, &mut [f32])) + Send + Sync,
) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(width).enumerate().for_each(f);
    } else {
        out.chunks_mut(width).enumerate().for_each(f);
    }
}

/// `f` over a tensor's values, read in place when it is a contiguous f32 CPU tensor (what a
/// forward or backward pass hands a fused op), else from a copy. The backward passes read their
/// saved inputs and incoming gradients this way instead of copying megabytes out with `to_vec1`.
pub fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
            && let Ok(values) = cpu.as_slice::<f32>()
        {
            return Ok(f(&values[start..end]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
}
