// Squared ReLU on the GPU: the kernels of relu2.rs. y = max(h, 0)², dh = dy · 2·max(h, 0),
// the same arithmetic as relu2.rs (no sum to contract into an FMA), so the same bytes.
// Grid-stride, RELU2_ILP elements a thread an iteration: any grid and block work.

#include <cuda_bf16.h>

// A result as the kernel stores it: f32, or rounded to bf16 (to nearest, ties to even).
static __device__ __forceinline__ void relu2_store(float* at, float v) { *at = v; }
static __device__ __forceinline__ void relu2_store(__nv_bfloat16* at, float v) {
    *at = __float2bfloat16_rn(v);
}

// Elements a thread takes an iteration, their loads issued before any store: that many in
// flight a thread.
constexpr int RELU2_ILP = 4;

template <class T>
static __device__ void relu2_fwd(const float* h, T* y, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += RELU2_ILP * stride) {
        float r[RELU2_ILP];
        for (int u = 0; u < RELU2_ILP; ++u) {
            const size_t k = i + u * stride;
            r[u] = k < n ? fmaxf(h[k], 0.0f) : 0.0f;
        }
        for (int u = 0; u < RELU2_ILP; ++u) {
            const size_t k = i + u * stride;
            if (k < n) {
                relu2_store(y + k, r[u] * r[u]);
            }
        }
    }
}

template <class T>
static __device__ void relu2_bwd(const float* h, const float* dy, T* dh, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += RELU2_ILP * stride) {
        float hv[RELU2_ILP], g[RELU2_ILP];
        for (int u = 0; u < RELU2_ILP; ++u) {
            const size_t k = i + u * stride;
            hv[u] = k < n ? h[k] : 0.0f;
            g[u] = k < n ? dy[k] : 0.0f;
        }
        for (int u = 0; u < RELU2_ILP; ++u) {
            const size_t k = i + u * stride;
            if (k < n) {
                relu2_store(dh + k, g[u] * (2.0f * fmaxf(hv[u], 0.0f)));
            }
        }
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
