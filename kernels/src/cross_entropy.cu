// Cross-entropy fused with the softmax over the vocabulary: the kernels of cross_entropy.rs.
// logits is (N, V), labels N u32. One block a row (rows beyond the grid loop).
//
// Forward: each thread runs an online max/sum over its strided columns (m, s with
// s = Σ exp(x − m)), the block combines the pairs in a fixed tree (warp shuffles, then the
// warps' pairs through shared memory), and the row's lse = m + log s gives
// loss = lse − x[label]; lse is kept for the backward. Backward: dlogits = g · (exp(x − lse)
// − onehot(label)), as cross_entropy.rs's CPU op writes it.
//
// Where the vocabulary is a multiple of four and the rows' starts 16-byte aligned, a thread
// reads (and the backward writes) four values at a time, each handled as the one-at-a-time
// loop handles it: a thread then has four times the bytes in flight.
//
// cross_entropy.rs refuses a label outside the vocabulary; a kernel cannot, so such a row's
// loss and dlogits are NaN (never an out-of-bounds read), and the step's gradient-norm check
// stops the run. blockDim.x is a multiple of 32, at most 1024.

#include <cuda_bf16.h>
#include <math_constants.h>

struct MaxSum {
    float m;  // the largest value seen
    float s;  // Σ exp(x − m) over the values seen
};

// The pair of the union of two sets of values: the same bits whichever comes first.
static __device__ __forceinline__ MaxSum ce_combine(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -CUDART_INF_F) {
        return {m, 0.0f};
    }
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

static __device__ __forceinline__ MaxSum ce_warp_combine(MaxSum v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const MaxSum other = {__shfl_xor_sync(0xffffffffu, v.m, offset),
                              __shfl_xor_sync(0xffffffffu, v.s, offset)};
        v = ce_combine(v, other);
    }
    return v;
}

// The pair of the whole block, in every thread.
static __device__ MaxSum ce_block_combine(MaxSum v) {
    __shared__ float partial_m[32];
    __shared__ float partial_s[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    v = ce_warp_combine(v);
    if (lane == 0) {
        partial_m[warp] = v.m;
        partial_s[warp] = v.s;
    }
    __syncthreads();
    const int warps = blockDim.x / 32;
    v = lane < warps ? MaxSum{partial_m[lane], partial_s[lane]} : MaxSum{-CUDART_INF_F, 0.0f};
    v = ce_warp_combine(v);
    __syncthreads();  // the partials are written again for the next row
    return v;
}

// Whether rows of `vocab` values from `p` can be read four at a time: every row start 16-byte
// aligned. Then a thread has four values in flight a load, not one.
static __device__ __forceinline__ bool ce_quads(const void* p, int vocab) {
    return vocab % 4 == 0 && reinterpret_cast<size_t>(p) % 16 == 0;
}

// Four values at x (16-byte aligned).
static __device__ __forceinline__ void ce_load4(const float* x, float v[4]) {
#ifdef __CUDA_ARCH__
    const float4 f = *reinterpret_cast<const float4*>(x);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
#else
    simt::require_aligned(x, 16, "cross-entropy's load");
    std::memcpy(v, x, 16);
#endif
}

// One more value into a thread's running max and sum.
static __device__ __forceinline__ void ce_add(MaxSum& own, float v) {
    if (v > own.m) {
        own.s = own.s * expf(own.m - v) + 1.0f;
        own.m = v;
    } else {
        own.s += expf(v - own.m);
    }
}

extern "C" __global__ void cross_entropy_fwd_f32(const float* logits, const unsigned* labels,
                                                 float* loss, float* lse, int rows, int vocab) {
    const bool quads = ce_quads(logits, vocab);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* x = logits + size_t(r) * vocab;
        MaxSum own = {-CUDART_INF_F, 0.0f};
        if (quads) {
            for (int q = threadIdx.x; q < vocab / 4; q += blockDim.x) {
                float v[4];
                ce_load4(x + 4 * q, v);
                for (int i = 0; i < 4; ++i) {
                    ce_add(own, v[i]);
                }
            }
        } else {
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
                ce_add(own, x[j]);
            }
        }
        const MaxSum row = ce_block_combine(own);
        if (threadIdx.x == 0) {
            const float l = row.m + logf(row.s);
            const unsigned label = labels[r];
            lse[r] = l;
            loss[r] = label < unsigned(vocab) ? l - x[label] : CUDART_NAN_F;
        }
    }
}

static __device__ __forceinline__ void ce_store(float* at, float v) { *at = v; }
static __device__ __forceinline__ void ce_store(__nv_bfloat16* at, float v) {
    *at = __float2bfloat16_rn(v);
}

// Four results at `at` (aligned to four of them) in one store.
static __device__ __forceinline__ void ce_store4(float* at, const float v[4]) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<float4*>(at) = make_float4(v[0], v[1], v[2], v[3]);
#else
    simt::require_aligned(at, 16, "cross-entropy's store");
    std::memcpy(at, v, 16);
#endif
}
static __device__ __forceinline__ void ce_store4(__nv_bfloat16* at, const float v[4]) {
    unsigned short b[4];
    for (int i = 0; i < 4; ++i) {
        b[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v[i]));
    }
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint2*>(at) =
        make_uint2(b[0] | unsigned(b[1]) << 16, b[2] | unsigned(b[3]) << 16);
#else
    simt::require_aligned(at, 8, "cross-entropy's store");
    std::memcpy(at, b, 8);
#endif
}

// dlogits from the upstream gradient of each row's loss, dloss (N), as T.
template <class T>
static __device__ void cross_entropy_bwd(const float* logits, const unsigned* labels,
                                         const float* lse, const float* dloss, T* dlogits,
                                         int rows, int vocab) {
    // Four at a time where logits and dlogits rows are aligned for it (dlogits is where the
    // caller allocated it).
    const bool quads = ce_quads(logits, vocab) && ce_quads(dlogits, vocab);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const size_t row = size_t(r) * vocab;
        const unsigned label = labels[r];
        const float g = label < unsigned(vocab) ? dloss[r] : CUDART_NAN_F;
        const float l = lse[r];
        if (quads) {
            for (int q = threadIdx.x; q < vocab / 4; q += blockDim.x) {
                float v[4];
                ce_load4(logits + row + 4 * q, v);
                for (int i = 0; i < 4; ++i) {
                    const float p = g * expf(v[i] - l);
                    v[i] = unsigned(4 * q + i) == label ? p - g : p;
                }
                ce_store4(dlogits + row + 4 * q, v);
            }
            continue;
        }
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float p = g * expf(logits[row + j] - l);
            ce_store(dlogits + row + j, unsigned(j) == label ? p - g : p);
        }
    }
}

extern "C" __global__ void cross_entropy_bwd_f32(const float* logits, const unsigned* labels,
                                                 const float* lse, const float* dloss,
                                                 float* dlogits, int rows, int vocab) {
    cross_entropy_bwd(logits, labels, lse, dloss, dlogits, rows, vocab);
}

// The same dlogits rounded to bf16 (to nearest, ties to even): the bytes cast_bf16 would make
// of cross_entropy_bwd_f32's, written at half the bytes for the head's bf16 products, which
// read them uncast.
extern "C" __global__ void cross_entropy_bwd_to_bf16(const float* logits, const unsigned* labels,
                                                  const float* lse, const float* dloss,
                                                  __nv_bfloat16* dlogits, int rows, int vocab) {
    cross_entropy_bwd(logits, labels, lse, dloss, dlogits, rows, vocab);
}
