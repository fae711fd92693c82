// Rotary embedding on the GPU: the kernels of rope.rs, in Llama's rotate_half convention.
// x is (B, H, T, D) and the tables cos, sin (B, T, D), shared by the heads; dimensions j and
// j + D/2 turn together. Forward: y = x·cos + R(x)·sin with R([a, b]) = [−b, a]; backward, the
// transpose: dx = g·cos + Rᵀ(g·sin) with Rᵀ([a, b]) = [b, −a]. One thread a pair (j, j + D/2),
// grid-stride over B·H·T·D/2: any grid and block work.

#include <cuda_bf16.h>

static __device__ __forceinline__ void rope_pairs(const float* x, const float* cos,
                                                  const float* sin, float* y, int batch,
                                                  int heads, int len, int dim, bool transpose) {
    const size_t half = dim / 2;
    const size_t pairs = size_t(batch) * heads * len * half;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t p = size_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += stride) {
        const size_t row = p / half;  // (b, h, t) flattened
        const size_t j = p % half;
        const size_t b = row / (size_t(heads) * len);
        const size_t t = row % len;
        const float* c = cos + (b * len + t) * dim;
        const float* s = sin + (b * len + t) * dim;
        const size_t at = row * dim + j;
        const float lo = x[at];
        const float hi = x[at + half];
        if (transpose) {
            y[at] = lo * c[j] + hi * s[j + half];
            y[at + half] = hi * c[j + half] - lo * s[j];
        } else {
            y[at] = lo * c[j] - hi * s[j];
            y[at + half] = hi * c[j + half] + lo * s[j + half];
        }
    }
}

extern "C" __global__ void rope_fwd_f32(const float* x, const float* cos, const float* sin,
                                        float* y, int batch, int heads, int len, int dim) {
    rope_pairs(x, cos, sin, y, batch, heads, len, dim, false);
}

// dx from dy: the transpose of the forward map.
extern "C" __global__ void rope_bwd_f32(const float* dy, const float* cos, const float* sin,
                                        float* dx, int batch, int heads, int len, int dim) {
    rope_pairs(dy, cos, sin, dx, batch, heads, len, dim, true);
}
