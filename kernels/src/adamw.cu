// One fused AdamW step on the GPU (decoupled weight decay, Loshchilov & Hutter 2019), with
// f32 master weights and moments, the formula of ops/train's optim.rs (AdamW::step, through
// kernels::simd::adamw), term for term:
//
//   m = b1·m + (1 − b1)·g        v = b2·v + (1 − b2)·g·g
//   w = w − lr·( (m / bc1) / (sqrt(v / bc2) + eps)  +  wd·w )
//
// where bc1 = 1 − b1ᵗ and bc2 = 1 − b2ᵗ are computed by the caller in f64 and rounded to f32
// (as AdamW::step does). When w_bf16 is not null, the updated weight is also written there
// rounded to bf16: the copy the next step's matmuls read. Grid-stride, ADAMW_ILP elements a
// thread an iteration, their loads issued before any store (that many in flight a thread).

#include <cuda_bf16.h>

constexpr int ADAMW_ILP = 4;

extern "C" __global__ void adamw_f32(float* w, const float* g, float* m, float* v,
                                     __nv_bfloat16* w_bf16, size_t n, float lr, float b1,
                                     float b2, float bc1, float bc2, float eps, float wd) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += ADAMW_ILP * stride) {
        // The elements' four loads each, all issued before any store.
        float wo[ADAMW_ILP], gi[ADAMW_ILP], mo[ADAMW_ILP], vo[ADAMW_ILP];
        for (int u = 0; u < ADAMW_ILP; ++u) {
            const size_t k = i + u * stride;
            const bool in = k < n;
            wo[u] = in ? w[k] : 0.0f;
            gi[u] = in ? g[k] : 0.0f;
            mo[u] = in ? m[k] : 0.0f;
            vo[u] = in ? v[k] : 0.0f;
        }
        for (int u = 0; u < ADAMW_ILP; ++u) {
            const size_t k = i + u * stride;
            if (k >= n) {
                break;
            }
            // Each product and sum rounded on its own (the _rn intrinsics), as the CPU
            // computes them: the compiler would otherwise fuse `b1 * m + …` into an FMA, which
            // rounds once and moves the weights a last bit away from the CPU trainer's.
            const float mi = __fadd_rn(__fmul_rn(b1, mo[u]), __fmul_rn(1.0f - b1, gi[u]));
            const float vi =
                __fadd_rn(__fmul_rn(b2, vo[u]), __fmul_rn(__fmul_rn(1.0f - b2, gi[u]), gi[u]));
            const float update = (mi / bc1) / (sqrtf(vi / bc2) + eps);
            const float wi =
                __fsub_rn(wo[u], __fmul_rn(lr, __fadd_rn(update, __fmul_rn(wd, wo[u]))));
            m[k] = mi;
            v[k] = vi;
            w[k] = wi;
            if (w_bf16 != nullptr) {
                w_bf16[k] = __float2bfloat16(wi);
            }
        }
    }
}
