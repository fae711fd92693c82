//! The SIMT shim, from Rust: each `.cu` kernel's C entry point (cuda/launch/*.cpp, built by
//! build.rs), and the shim's own checks. Tests only: the shim executes the CUDA sources on
//! the CPU, one fiber per CUDA thread (cuda/simt/simt.h says what it models and refuses), so
//! a kernel is held to its Rust reference on a machine with no GPU.

use std::ffi::{CStr, c_char, c_int, c_uint};

unsafe extern "C" {
    fn simt_last_error() -> *const c_char;

    pub fn simt_rms_norm_fwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        rstd: *mut f32,
        rows: c_int,
        d: c_int,
        eps: f32,
    ) -> c_int;
    pub fn simt_rms_norm_fwd_bf16(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        x: *const u16,
        w: *const f32,
        y: *mut u16,
        rstd: *mut f32,
        rows: c_int,
        d: c_int,
        eps: f32,
    ) -> c_int;
    pub fn simt_rms_norm_bwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        x: *const f32,
        w: *const f32,
        rstd: *const f32,
        dy: *const f32,
        dx: *mut f32,
        dw_partial: *mut f32,
        rows: c_int,
        d: c_int,
    ) -> c_int;
    pub fn simt_rms_norm_dw_reduce(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        dw_partial: *const f32,
        dw: *mut f32,
        blocks: c_int,
        d: c_int,
    ) -> c_int;

    pub fn simt_swiglu_fwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        h: *const f32,
        y: *mut f32,
        rows: c_int,
        f: c_int,
    ) -> c_int;
    pub fn simt_swiglu_bwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        h: *const f32,
        dy: *const f32,
        dh: *mut f32,
        rows: c_int,
        f: c_int,
    ) -> c_int;

    pub fn simt_relu2_fwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        h: *const f32,
        y: *mut f32,
        n: usize,
    ) -> c_int;
    pub fn simt_relu2_bwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        h: *const f32,
        dy: *const f32,
        dh: *mut f32,
        n: usize,
    ) -> c_int;

    /// rope.cu's forward (`backward` 0: `x` to `y`) or backward (`dy` to `dx`).
    pub fn simt_rope_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        backward: c_int,
        x: *const f32,
        cos: *const f32,
        sin: *const f32,
        y: *mut f32,
        batch: c_int,
        heads: c_int,
        len: c_int,
        dim: c_int,
    ) -> c_int;

    pub fn simt_cross_entropy_fwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        logits: *const f32,
        labels: *const u32,
        loss: *mut f32,
        lse: *mut f32,
        rows: c_int,
        vocab: c_int,
    ) -> c_int;
    pub fn simt_cross_entropy_bwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        logits: *const f32,
        labels: *const u32,
        lse: *const f32,
        dloss: *const f32,
        dlogits: *mut f32,
        rows: c_int,
        vocab: c_int,
    ) -> c_int;

    pub fn simt_embedding_fwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        table: *const f32,
        ids: *const u32,
        out: *mut f32,
        tokens: c_int,
        vocab: c_int,
        dim: c_int,
    ) -> c_int;
    pub fn simt_embedding_bwd_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        dout: *const f32,
        ids: *const u32,
        dtable: *mut f32,
        tokens: c_int,
        vocab: c_int,
        dim: c_int,
    ) -> c_int;

    /// adamw.cu's step; `w_bf16` may be null.
    pub fn simt_adamw_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        w: *mut f32,
        g: *const f32,
        m: *mut f32,
        v: *mut f32,
        w_bf16: *mut u16,
        n: usize,
        lr: f32,
        b1: f32,
        b2: f32,
        bc1: f32,
        bc2: f32,
        eps: f32,
        wd: f32,
    ) -> c_int;

    pub fn simt_grad_norm_partials(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        g: *const f32,
        n: usize,
        partial: *mut f64,
    ) -> c_int;
    /// grad_norm.cu's second pass, on one block.
    pub fn simt_grad_norm_finish(
        block: c_uint,
        reverse: c_int,
        partial: *const f64,
        blocks: c_int,
        norm: *mut f64,
    ) -> c_int;
    pub fn simt_grad_clip_f32(
        grid: c_uint,
        block: c_uint,
        reverse: c_int,
        g: *mut f32,
        n: usize,
        norm: *const f64,
        max_norm: f64,
    ) -> c_int;

    fn simt_check_shuffles(
        block: c_uint,
        out: *mut c_int,
        kind: c_int,
        arg: c_int,
        width: c_int,
    ) -> c_int;
    fn simt_check_neighbour(
        block: c_uint,
        reverse: c_int,
        out: *mut c_int,
        with_barrier: c_int,
    ) -> c_int;
    fn simt_check_divergent_barrier(block: c_uint) -> c_int;
    fn simt_check_barrier_after_return(block: c_uint) -> c_int;
    fn simt_check_shuffle_after_return(block: c_uint, out: *mut c_int) -> c_int;
}

/// A launch's status as a Result: the shim's reason when it refused the kernel.
pub fn check(status: c_int) -> Result<(), String> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a NUL-terminated string that lives until the next launch on
    // this thread.
    let reason = unsafe { CStr::from_ptr(simt_last_error()) };
    Err(reason.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each shuffle gives every lane of a 64-thread block, lanes holding 100 + lane.
    fn shuffled(kind: c_int, arg: c_int, width: c_int) -> Vec<c_int> {
        let mut out = vec![0; 64];
        // SAFETY: `out` holds one value per thread of the block.
        check(unsafe { simt_check_shuffles(64, out.as_mut_ptr(), kind, arg, width) }).unwrap();
        out
    }

    /// CUDA's rule: a source lane outside the lane's segment of `width` gives its own value.
    fn expected(kind: c_int, arg: i32, width: i32) -> Vec<c_int> {
        (0..64)
            .map(|t: i32| {
                let lane = t % 32;
                let segment = lane / width;
                let src = match kind {
                    0 => lane ^ arg,
                    1 => lane + arg,
                    2 => lane - arg,
                    _ => segment * width + arg % width,
                };
                let src = if src >= 0 && src / width == segment {
                    src
                } else {
                    lane
                };
                100 + src
            })
            .collect()
    }

    #[test]
    fn shuffles_give_cudas_lanes() {
        for kind in 0..4 {
            for (arg, width) in [
                (1, 32),
                (16, 32),
                (3, 32),
                (5, 8),
                (2, 4),
                (31, 32),
                (0, 32),
            ] {
                assert_eq!(
                    shuffled(kind, arg, width),
                    expected(kind, arg, width),
                    "kind {kind}, arg {arg}, width {width}"
                );
            }
        }
    }

    #[test]
    fn a_missing_barrier_shows_as_schedules_that_disagree() {
        let run = |reverse, with_barrier| {
            let mut out = vec![0; 96];
            // SAFETY: one value per thread.
            check(unsafe { simt_check_neighbour(96, reverse, out.as_mut_ptr(), with_barrier) })
                .unwrap();
            out
        };
        let want: Vec<c_int> = (0..96).map(|t| ((t + 1) % 96) * 7 + 1).collect();
        assert_eq!(run(0, 1), want);
        assert_eq!(run(1, 1), want);
        assert_ne!(run(0, 0), run(1, 0), "without the barrier the order shows");
    }

    #[test]
    fn wrong_barriers_are_refused_with_a_reason() {
        // SAFETY: these kernels take no memory.
        let divergent = check(unsafe { simt_check_divergent_barrier(64) }).unwrap_err();
        assert!(divergent.contains("different barriers"), "{divergent}");
        let returned = check(unsafe { simt_check_barrier_after_return(64) }).unwrap_err();
        assert!(returned.contains("returned"), "{returned}");
        let mut out = vec![0; 32];
        // SAFETY: one value per thread.
        let lanes =
            check(unsafe { simt_check_shuffle_after_return(32, out.as_mut_ptr()) }).unwrap_err();
        assert!(
            lanes.contains("after lanes of the warp returned"),
            "{lanes}"
        );
        // The shim still launches after a refused kernel.
        assert_eq!(shuffled(0, 1, 32), expected(0, 1, 32));
    }
}
