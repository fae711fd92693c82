// C entry points that run rope.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/rope.cu"

extern "C" int simt_rope_f32(unsigned grid, unsigned block, int reverse, int backward,
                             const float* x, const float* cos, const float* sin, float* y,
                             int batch, int heads, int len, int dim) {
    return simt::launch(grid, block, reverse != 0, [&] {
        if (backward != 0) {
            rope_bwd_f32(x, cos, sin, y, batch, heads, len, dim);
        } else {
            rope_fwd_f32(x, cos, sin, y, batch, heads, len, dim);
        }
    });
}
