// Mamba-2's gated, grouped RMSNorm on the GPU: the kernels of gated_rms_norm.rs. `y` and `z`
// are [rows, D], `w` is [D], and each row is cut into `groups` contiguous groups of
// gs = D/groups channels. One block per (row, group), items r·groups + g (items beyond the
// grid loop). Forward: v = y ⊙ silu(z), out = v · r · w with r = rsqrt(mean_group(v²) + eps),
// r kept per item for the backward. Backward, with s = σ(z):
// dv = r·(g ⊙ w) − v · r³/gs · Σ_group(g ⊙ w ⊙ v), dy = dv ⊙ z·s,
// dz = dv ⊙ y ⊙ s·(1 + z·(1 − s)), and dw = Σ_rows g ⊙ v · r summed without atomics: each
// block adds its items' share to its own partial row, and gated_rms_norm_dw_reduce adds the
// partials in block order, so the bytes never depend on timing.
//
// Reductions: each warp sums by shuffles, then every warp sums the warps' partials, so every
// thread holds the total. blockDim.x is a multiple of 32, at most 1024.

#include <cuda_bf16.h>

static __device__ __forceinline__ float gated_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The sum of `v` over the block, in every thread.
static __device__ float gated_block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    v = gated_warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = blockDim.x / 32;
    v = lane < warps ? partial[lane] : 0.0f;
    v = gated_warp_sum(v);
    __syncthreads();  // `partial` is written again by the next call
    return v;
}

static __device__ __forceinline__ float gated_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// v = y ⊙ silu(z), with the product in gated_rms_norm.rs's order: y · (z · σ(z)).
static __device__ __forceinline__ float gated_value(float y, float z) {
    return y * (z * gated_sigmoid(z));
}

extern "C" __global__ void gated_rms_norm_fwd_f32(const float* y, const float* z, const float* w,
                                                  float* out, float* rstd, int rows, int d,
                                                  int groups, float eps) {
    const int gs = d / groups;
    const int items = rows * groups;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const size_t first = size_t(item) * gs;  // rows are D = groups · gs apart
        const int channel = (item % groups) * gs;
        float squares = 0.0f;
        for (int j = threadIdx.x; j < gs; j += blockDim.x) {
            const float v = gated_value(y[first + j], z[first + j]);
            squares += v * v;
        }
        const float r = rsqrtf(gated_block_sum(squares) / gs + eps);
        if (threadIdx.x == 0) {
            rstd[item] = r;
        }
        for (int j = threadIdx.x; j < gs; j += blockDim.x) {
            out[first + j] = gated_value(y[first + j], z[first + j]) * r * w[channel + j];
        }
    }
}

// dy and dz for every item; dw's share of this block's items into dw_partial[blockIdx.x][:].
extern "C" __global__ void gated_rms_norm_bwd_f32(const float* y, const float* z, const float* w,
                                                  const float* rstd, const float* g, float* dy,
                                                  float* dz, float* dw_partial, int rows, int d,
                                                  int groups) {
    const int gs = d / groups;
    const int items = rows * groups;
    float* dw_block = dw_partial + size_t(blockIdx.x) * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        dw_block[j] = 0.0f;
    }
    // A thread adds to other columns than it zeroed. gated_block_sum's barriers would order
    // them too; this one does not lean on that.
    __syncthreads();
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const size_t first = size_t(item) * gs;
        const int channel = (item % groups) * gs;
        const float r = rstd[item];
        float dot = 0.0f;
        for (int j = threadIdx.x; j < gs; j += blockDim.x) {
            const size_t i = first + j;
            dot += g[i] * w[channel + j] * gated_value(y[i], z[i]);
        }
        const float k = r * r * r * gated_block_sum(dot) / gs;
        for (int j = threadIdx.x; j < gs; j += blockDim.x) {
            const size_t i = first + j;
            const float s = gated_sigmoid(z[i]);
            const float v = y[i] * (z[i] * s);
            const float dv = r * (g[i] * w[channel + j]) - k * v;
            dy[i] = dv * (z[i] * s);
            dz[i] = dv * y[i] * (s * (1.0f + z[i] * (1.0f - s)));
            dw_block[channel + j] += g[i] * v * r;
        }
    }
}

// dw[j] = Σ_b dw_partial[b][j], b in order: one thread a column.
extern "C" __global__ void gated_rms_norm_dw_reduce(const float* dw_partial, float* dw, int blocks,
                                                    int d) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) {
        return;
    }
    float sum = 0.0f;
    for (int b = 0; b < blocks; ++b) {
        sum += dw_partial[size_t(b) * d + j];
    }
    dw[j] = sum;
}
