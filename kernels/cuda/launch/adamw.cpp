// C entry point that runs adamw.cu's kernel through the SIMT shim, for the Rust tests.
#include "../../src/adamw.cu"

extern "C" int simt_adamw_f32(unsigned grid, unsigned block, int reverse, float* w,
                              const float* g, float* m, float* v, __nv_bfloat16* w_bf16,
                              size_t n, float lr, float b1, float b2, float bc1, float bc2,
                              float eps, float wd) {
    return simt::launch(grid, block, reverse != 0, [&] {
        adamw_f32(w, g, m, v, w_bf16, n, lr, b1, b2, bc1, bc2, eps, wd);
    });
}
