// C entry points that run rms_norm.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/rms_norm.cu"

extern "C" int simt_rms_norm_fwd_f32(unsigned grid, unsigned block, int reverse, const float* x,
                                     const float* w, float* y, float* rstd, int rows, int d,
                                     float eps) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { rms_norm_fwd_f32(x, w, y, rstd, rows, d, eps); });
}

extern "C" int simt_rms_norm_fwd_bf16(unsigned grid, unsigned block, int reverse,
                                      const __nv_bfloat16* x, const float* w, __nv_bfloat16* y,
                                      float* rstd, int rows, int d, float eps) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { rms_norm_fwd_bf16(x, w, y, rstd, rows, d, eps); });
}

extern "C" int simt_rms_norm_bwd_f32(unsigned grid, unsigned block, int reverse, const float* x,
                                     const float* w, const float* rstd, const float* dy,
                                     float* dx, float* dw_partial, int rows, int d) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { rms_norm_bwd_f32(x, w, rstd, dy, dx, dw_partial, rows, d); });
}

extern "C" int simt_rms_norm_dw_reduce(unsigned grid, unsigned block, int reverse,
                                       const float* dw_partial, float* dw, int blocks, int d) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { rms_norm_dw_reduce(dw_partial, dw, blocks, d); });
}
