// C entry points that run grad_norm.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/grad_norm.cu"

extern "C" int simt_grad_norm_partials(unsigned grid, unsigned block, int reverse,
                                       const float* g, size_t n, double* partial) {
    return simt::launch(grid, block, reverse != 0, [&] { grad_norm_partials(g, n, partial); });
}

extern "C" int simt_grad_norm_finish(unsigned block, int reverse, const double* partial,
                                     int blocks, double* norm) {
    return simt::launch(1, block, reverse != 0, [&] { grad_norm_finish(partial, blocks, norm); });
}

extern "C" int simt_grad_clip_f32(unsigned grid, unsigned block, int reverse, float* g, size_t n,
                                  const double* norm, double max_norm) {
    return simt::launch(grid, block, reverse != 0, [&] { grad_clip_f32(g, n, norm, max_norm); });
}
