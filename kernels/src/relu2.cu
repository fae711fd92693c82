// Squared ReLU on the GPU: the kernels of relu2.rs. y = max(h, 0)², dh = dy · 2·max(h, 0),
// the same arithmetic as relu2.rs (no sum to contract into an FMA), so the same bytes. One
// thread an element, grid-stride: any grid and block work.

#include <cuda_bf16.h>

// A result as the kernel stores it: f32, or rounded to bf16 (to nearest, ties to even).
static __device__ __forceinline__ void relu2_store(float* at, float v) { *at = v; }
static __device__ __forceinline__ void relu2_store(__nv_bfloat16* at, float v) {
    *at = __float2bfloat16_rn(v);
}

template <class T>
static __device__ void relu2_fwd(const float* h, T* y, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float r = fmaxf(h[i], 0.0f);
        relu2_store(y + i, r * r);
    }
}

template <class T>
static __device__ void relu2_bwd(const float* h, const float* dy, T* dh, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        relu2_store(dh + i, dy[i] * (2.0f * fmaxf(h[i], 0.0f)));
    }
}

extern "C" __global__ void relu2_fwd_f32(const float* h, float* y, size_t n) {
    relu2_fwd(h, y, n);
}

extern "C" __global__ void relu2_bwd_f32(const float* h, const float* dy, float* dh, size_t n) {
    relu2_bwd(h, dy, dh, n);
}

// The same outputs rounded to bf16: the bytes cast_bf16 would make of the f32 ones, for the
// next product to read uncast.
extern "C" __global__ void relu2_fwd_to_bf16(const float* h, __nv_bfloat16* y, size_t n) {
    relu2_fwd(h, y, n);
}

extern "C" __global__ void relu2_bwd_to_bf16(const float* h, const float* dy, __nv_bfloat16* dh,
                                             size_t n) {
    relu2_bwd(h, dy, dh, n);
}
