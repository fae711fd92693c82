// SwiGLU on the GPU: the kernels of swiglu.rs. `h` is [rows, 2F] with the gate half first,
// `y` is [rows, F]: y = silu(g) ⊙ u. Backward writes dh = [dg, du] with
// dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g))) and du = dy ⊙ g·σ(g), the products in swiglu.rs's
// order. One thread an output element, grid-stride over rows·F: any grid and block work.

#include <cuda_bf16.h>

static __device__ __forceinline__ float swiglu_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

extern "C" __global__ void swiglu_fwd_f32(const float* h, float* y, int rows, int f) {
    const size_t n = size_t(rows) * f;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t gate = (i / f) * 2 * f + i % f;
        const float g = h[gate];
        y[i] = g * swiglu_sigmoid(g) * h[gate + f];
    }
}

extern "C" __global__ void swiglu_bwd_f32(const float* h, const float* dy, float* dh, int rows,
                                          int f) {
    const size_t n = size_t(rows) * f;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t gate = (i / f) * 2 * f + i % f;
        const float g = h[gate];
        const float u = h[gate + f];
        const float s = swiglu_sigmoid(g);
        dh[gate] = dy[i] * u * s * (1.0f + g * (1.0f - s));
        dh[gate + f] = dy[i] * g * s;
    }
}
