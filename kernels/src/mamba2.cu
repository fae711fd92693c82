// Mamba-2's small steps on the GPU, around the convolution (causal_conv_silu.cu), the scan
// (ssd.cu) and the gated norm (gated_rms_norm.cu): the step size, the decay rate and the D·x
// skip of ops/model/src/mamba2.rs (steps 3 and 4 of its notation), forward and backward.
// mamba2.rs holds their plain references.
//
//   step size   Δ = softplus(dt + dt_bias), dt read from a column range of in_proj's output;
//               d(dt) = dΔ · σ(dt + dt_bias), d(dt_bias) = Σ_rows d(dt)
//   decay rate  A = −exp(A_log);  d(A_log) = dA · A
//   skip        y += D_h · x;     dx += D_h · dy,  dD_h = Σ_{rows, p} dy · x
//
// softplus(v) = max(v, 0) + log(1 + e^{−|v|}), the CPU's form, which cannot overflow.
//
// The sums over rows (mamba_head_sums_f32) are one block a head: each thread adds its strided
// share in order, then the block adds the threads' partials in a fixed tree, so the bytes never
// depend on timing. Everything else is one thread an element, grid-stride: any grid and block
// work. Layouts: proj [rows, cols]; Δ and its gradients [rows, H]; x, y [rows, H, P].

#include <cuda_bf16.h>

static __device__ __forceinline__ float mamba_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static __device__ __forceinline__ float mamba_softplus(float v) {
    return fmaxf(v, 0.0f) + logf(expf(-fabsf(v)) + 1.0f);
}

extern "C" __global__ void mamba_dt_fwd_f32(const float* proj, int cols, int offset,
                                            const float* bias, float* dt, int rows, int heads) {
    const size_t n = size_t(rows) * heads;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const int h = int(e % heads);
        const float v = proj[(e / heads) * cols + offset + h] + bias[h];
        dt[e] = mamba_softplus(v);
    }
}

// d(dt) = dΔ · σ(dt + dt_bias), written contiguous [rows, H].
extern "C" __global__ void mamba_dt_bwd_f32(const float* proj, int cols, int offset,
                                            const float* bias, const float* ddelta,
                                            float* draw, int rows, int heads) {
    const size_t n = size_t(rows) * heads;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const int h = int(e % heads);
        const float v = proj[(e / heads) * cols + offset + h] + bias[h];
        draw[e] = ddelta[e] * mamba_sigmoid(v);
    }
}

extern "C" __global__ void mamba_a_fwd_f32(const float* a_log, float* a, int heads) {
    const int stride = gridDim.x * blockDim.x;
    for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < heads; h += stride) {
        a[h] = -expf(a_log[h]);
    }
}

extern "C" __global__ void mamba_a_bwd_f32(const float* a, const float* da, float* da_log,
                                           int heads) {
    const int stride = gridDim.x * blockDim.x;
    for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < heads; h += stride) {
        da_log[h] = da[h] * a[h];
    }
}

// y += D_h · x, in place.
extern "C" __global__ void mamba_skip_fwd_f32(float* y, const float* x, const float* d_skip,
                                              int rows, int heads, int p) {
    const size_t n = size_t(rows) * heads * p;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        y[e] = y[e] + x[e] * d_skip[(e / p) % heads];
    }
}

// dx += D_h · dy, onto the scan's dx.
extern "C" __global__ void mamba_skip_bwd_f32(const float* dy, const float* d_skip, float* dx,
                                              int rows, int heads, int p) {
    const size_t n = size_t(rows) * heads * p;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        dx[e] = dx[e] + dy[e] * d_skip[(e / p) % heads];
    }
}

// out[h] = Σ_{r, i} u[r, h, i] · v[r, h, i] (v null: · 1), over [rows, H, P]. One block a head
// (heads beyond the grid loop); blockDim.x a power of two, at most 1024.
extern "C" __global__ void mamba_head_sums_f32(const float* u, const float* v, float* out,
                                               int rows, int heads, int p) {
    __shared__ float partial[1024];
    const size_t n = size_t(rows) * p;
    for (int h = blockIdx.x; h < heads; h += gridDim.x) {
        float sum = 0.0f;
        for (size_t e = threadIdx.x; e < n; e += blockDim.x) {
            const size_t at = ((e / p) * heads + h) * p + e % p;
            sum += v ? u[at] * v[at] : u[at];
        }
        partial[threadIdx.x] = sum;
        __syncthreads();
        for (int half = blockDim.x / 2; half > 0; half /= 2) {
            if (int(threadIdx.x) < half) {
                partial[threadIdx.x] += partial[threadIdx.x + half];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            out[h] = partial[0];
        }
        __syncthreads();  // `partial` is written again for the next head
    }
}
