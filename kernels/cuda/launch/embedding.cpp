// C entry points that run embedding.cu's kernels through the SIMT shim, for the Rust tests.
#include "../../src/embedding.cu"

extern "C" int simt_embedding_fwd_f32(unsigned grid, unsigned block, int reverse,
                                      const float* table, const unsigned* ids, float* out,
                                      int tokens, int vocab, int dim) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { embedding_fwd_f32(table, ids, out, tokens, vocab, dim); });
}

extern "C" int simt_embedding_bwd_f32(unsigned grid, unsigned block, int reverse,
                                      const float* dout, const unsigned* ids, float* dtable,
                                      int tokens, int vocab, int dim) {
    return simt::launch(grid, block, reverse != 0,
                        [&] { embedding_bwd_f32(dout, ids, dtable, tokens, vocab, dim); });
}
