// C entry points that run relu2.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/relu2.cu"

extern "C" int simt_relu2_fwd_f32(unsigned grid, unsigned block, int reverse, const float* h,
                                  float* y, size_t n) {
    return simt::launch(grid, block, reverse != 0, [&] { relu2_fwd_f32(h, y, n); });
}

extern "C" int simt_relu2_bwd_f32(unsigned grid, unsigned block, int reverse, const float* h,
                                  const float* dy, float* dh, size_t n) {
    return simt::launch(grid, block, reverse != 0, [&] { relu2_bwd_f32(h, dy, dh, n); });
}
