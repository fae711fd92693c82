// Squared ReLU on the GPU: the kernels of relu2.rs. y = max(h, 0)², dh = dy · 2·max(h, 0),
// the same arithmetic as relu2.rs (no sum to contract into an FMA), so the same bytes. One
// thread an element, grid-stride: any grid and block work.

#include <cuda_bf16.h>

extern "C" __global__ void relu2_fwd_f32(const float* h, float* y, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float r = fmaxf(h[i], 0.0f);
        y[i] = r * r;
    }
}

extern "C" __global__ void relu2_bwd_f32(const float* h, const float* dy, float* dh, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        dh[i] = dy[i] * (2.0f * fmaxf(h[i], 0.0f));
    }
}
