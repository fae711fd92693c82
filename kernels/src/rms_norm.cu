// RMSNorm on the GPU: the kernels of rms_norm.rs, one block per row (rows beyond the grid
// loop). Forward: y = x · r · w with r = rsqrt(mean(x²) + eps), kept per row for the
// backward. Backward: dx = r · (g ⊙ w) − x · r³/D · Σ_j g_j w_j x_j, and dw = Σ_rows g ⊙ x · r
// summed without atomics: each block writes its rows' sum to its own partial row, and
// rms_norm_dw_reduce adds the partials in block order, so the bytes never depend on timing.
//
// Reductions: each warp sums by shuffles, then every warp sums the warps' partials, so every
// thread holds the total without another barrier. blockDim.x is a multiple of 32, at most 1024.

#include <cuda_bf16.h>

static __device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The sum of `v` over the block, in every thread.
static __device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    v = warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = blockDim.x / 32;
    v = lane < warps ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();  // `partial` is written again by the next call
    return v;
}

static __device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
static __device__ __forceinline__ float load(const __nv_bfloat16* p, size_t i) {
    return __bfloat162float(p[i]);
}
static __device__ __forceinline__ void store(float* p, size_t i, float v) { p[i] = v; }
static __device__ __forceinline__ void store(__nv_bfloat16* p, size_t i, float v) {
    p[i] = __float2bfloat16(v);
}

template <typename TX, typename TY>
static __device__ void rms_norm_fwd(const TX* x, const float* w, TY* y, float* rstd, int rows,
                                    int d, float eps) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const size_t row = size_t(r) * d;
        float squares = 0.0f;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            const float v = load(x, row + j);
            squares += v * v;
        }
        const float inv = rsqrtf(block_sum(squares) / d + eps);
        if (threadIdx.x == 0) {
            rstd[r] = inv;
        }
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            store(y, row + j, load(x, row + j) * inv * w[j]);
        }
    }
}

extern "C" __global__ void rms_norm_fwd_f32(const float* x, const float* w, float* y,
                                            float* rstd, int rows, int d, float eps) {
    rms_norm_fwd(x, w, y, rstd, rows, d, eps);
}

extern "C" __global__ void rms_norm_fwd_bf16(const __nv_bfloat16* x, const float* w,
                                             __nv_bfloat16* y, float* rstd, int rows, int d,
                                             float eps) {
    rms_norm_fwd(x, w, y, rstd, rows, d, eps);
}

// From f32 x, y in bf16: the bytes cast_bf16 would make of rms_norm_fwd_f32's, for the
// products that read the normed rows (and nothing else does) to read them uncast.
extern "C" __global__ void rms_norm_fwd_to_bf16(const float* x, const float* w,
                                                __nv_bfloat16* y, float* rstd, int rows, int d,
                                                float eps) {
    rms_norm_fwd(x, w, y, rstd, rows, d, eps);
}

// dx for every row; dw's share of this block's rows into dw_partial[blockIdx.x][:].
extern "C" __global__ void rms_norm_bwd_f32(const float* x, const float* w, const float* rstd,
                                            const float* dy, float* dx, float* dw_partial,
                                            int rows, int d) {
    float* dw_block = dw_partial + size_t(blockIdx.x) * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        dw_block[j] = 0.0f;
    }
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const size_t row = size_t(r) * d;
        const float inv = rstd[r];
        float dot = 0.0f;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            dot += dy[row + j] * w[j] * x[row + j];
        }
        const float c = inv * inv * inv * block_sum(dot) / d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            dx[row + j] = inv * dy[row + j] * w[j] - x[row + j] * c;
            dw_block[j] += dy[row + j] * x[row + j] * inv;
        }
    }
}

// dw[j] = Σ_b dw_partial[b][j], b in order: one thread a column.
extern "C" __global__ void rms_norm_dw_reduce(const float* dw_partial, float* dw, int blocks,
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
