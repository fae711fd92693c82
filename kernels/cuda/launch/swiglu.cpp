// C entry points that run swiglu.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/swiglu.cu"

extern "C" int simt_swiglu_fwd_f32(unsigned grid, unsigned block, int reverse, const float* h,
                                   float* y, int rows, int f) {
    return simt::launch(grid, block, reverse != 0, [&] { swiglu_fwd_f32(h, y, rows, f); });
}

extern "C" int simt_swiglu_bwd_f32(unsigned grid, unsigned block, int reverse, const float* h,
                                   const float* dy, float* dh, int rows, int f) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { swiglu_bwd_f32(h, dy, dh, rows, f); });
}
