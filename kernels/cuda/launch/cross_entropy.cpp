// C entry points that run cross_entropy.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/cross_entropy.cu"

extern "C" int simt_cross_entropy_fwd_f32(unsigned grid, unsigned block, int reverse,
                                          const float* logits, const unsigned* labels,
                                          float* loss, float* lse, int rows, int vocab) {
    return simt::launch(grid, block, reverse != 0, [&] {
        cross_entropy_fwd_f32(logits, labels, loss, lse, rows, vocab);
    });
}

extern "C" int simt_cross_entropy_bwd_f32(unsigned grid, unsigned block, int reverse,
                                          const float* logits, const unsigned* labels,
                                          const float* lse, const float* dloss, float* dlogits,
                                          int rows, int vocab) {
    return simt::launch(grid, block, reverse != 0, [&] {
        cross_entropy_bwd_f32(logits, labels, lse, dloss, dlogits, rows, vocab);
    });
}
