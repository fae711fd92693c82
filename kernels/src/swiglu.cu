// SwiGLU on the GPU: the kernels of swiglu.rs. `h` is [rows, 2F] with the gate half first,
// `y` is [rows, F]: y = silu(g) ⊙ u. Backward writes dh = [dg, du] with
// dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g))) and du = dy ⊙ g·σ(g), the products in swiglu.rs's
// order. One thread an output element, grid-stride over rows·F: any grid and block work.

#include <cuda_bf16.h>

static __device__ __forceinline__ float swiglu_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// A result as the kernel stores it: f32, or rounded to bf16 (to nearest, ties to even).
static __device__ __forceinline__ void swiglu_store(float* at, float v) { *at = v; }
static __device__ __forceinline__ void swiglu_store(__nv_bfloat16* at, float v) {
    *at = __float2bfloat16_rn(v);
}

template <class T>
static __device__ void swiglu_fwd(const float* h, T* y, int rows, int f) {
    const size_t n = size_t(rows) * f;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t gate = (i / f) * 2 * f + i % f;
        const float g = h[gate];
        swiglu_store(y + i, g * swiglu_sigmoid(g) * h[gate + f]);
    }
}

template <class T>
static __device__ void swiglu_bwd(const float* h, const float* dy, T* dh, int rows, int f) {
    const size_t n = size_t(rows) * f;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t gate = (i / f) * 2 * f + i % f;
        const float g = h[gate];
        const float u = h[gate + f];
        const float s = swiglu_sigmoid(g);
        swiglu_store(dh + gate, dy[i] * u * s * (1.0f + g * (1.0f - s)));
        swiglu_store(dh + gate + f, dy[i] * g * s);
    }
}

extern "C" __global__ void swiglu_fwd_f32(const float* h, float* y, int rows, int f) {
    swiglu_fwd(h, y, rows, f);
}

extern "C" __global__ void swiglu_bwd_f32(const float* h, const float* dy, float* dh, int rows,
                                          int f) {
    swiglu_bwd(h, dy, dh, rows, f);
}

// The same outputs rounded to bf16: the bytes cast_bf16 would make of the f32 ones, for the
// next product to read uncast.
extern "C" __global__ void swiglu_fwd_to_bf16(const float* h, __nv_bfloat16* y, int rows,
                                              int f) {
    swiglu_fwd(h, y, rows, f);
}

extern "C" __global__ void swiglu_bwd_to_bf16(const float* h, const float* dy,
                                              __nv_bfloat16* dh, int rows, int f) {
    swiglu_bwd(h, dy, dh, rows, f);
}
