// The global gradient norm and its clip on the GPU, deterministic, as ops/train's optim.rs
// (grad_norm, clip): the norm sums squares in f64, and gradients above max_norm are scaled by
// max_norm / (norm + 1e-6), rounded to f32.
//
// Two passes, no atomics: grad_norm_partials gives each block's sum of squares (its
// grid-stride share, summed by a fixed tree) to partial[blockIdx.x]; grad_norm_finish, one
// block, sums the partials in a fixed tree and writes the norm. grad_clip_f32 reads that norm
// on the device, so the step never waits for the host. blockDim.x is a multiple of 32, at
// most 1024.

#include <cuda_bf16.h>

static __device__ __forceinline__ double norm_warp_sum(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The sum of `v` over the block, in every thread.
static __device__ double norm_block_sum(double v) {
    __shared__ double partial[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    v = norm_warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = blockDim.x / 32;
    v = lane < warps ? partial[lane] : 0.0;
    v = norm_warp_sum(v);
    __syncthreads();  // `partial` is written again by the next call
    return v;
}

// Elements a thread loads at once (its grid-stride elements i, i + stride, …, summed in that
// order as one at a time would): that many loads in flight a thread.
constexpr int NORM_ILP = 4;

extern "C" __global__ void grad_norm_partials(const float* g, size_t n, double* partial) {
    double squares = 0.0;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += NORM_ILP * stride) {
        float x[NORM_ILP];
        for (int u = 0; u < NORM_ILP; ++u) {
            x[u] = i + u * stride < n ? g[i + u * stride] : 0.0f;
        }
        for (int u = 0; u < NORM_ILP && i + u * stride < n; ++u) {
            const double v = x[u];
            squares += v * v;
        }
    }
    squares = norm_block_sum(squares);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = squares;
    }
}

// Launched with one block: norm[0] = sqrt(Σ partial).
extern "C" __global__ void grad_norm_finish(const double* partial, int blocks, double* norm) {
    double sum = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        sum += partial[b];
    }
    sum = norm_block_sum(sum);
    if (threadIdx.x == 0) {
        norm[0] = sqrt(sum);
    }
}

// g ← g · max_norm / (norm + 1e-6) when the norm is above max_norm (max_norm 0: no clip).
extern "C" __global__ void grad_clip_f32(float* g, size_t n, const double* norm,
                                         double max_norm) {
    const double total = norm[0];
    if (!(max_norm > 0.0 && total > max_norm)) {
        return;
    }
    const float scale = float(max_norm / (total + 1e-6));
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += NORM_ILP * stride) {
        float x[NORM_ILP];
        for (int u = 0; u < NORM_ILP; ++u) {
            x[u] = i + u * stride < n ? g[i + u * stride] : 0.0f;
        }
        for (int u = 0; u < NORM_ILP && i + u * stride < n; ++u) {
            g[i + u * stride] = x[u] * scale;
        }
    }
}
