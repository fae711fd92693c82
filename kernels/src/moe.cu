// A mixture-of-experts layer's steps on the GPU, around the experts' GEMMs (linear.cu) and
// activations (swiglu.cu, relu2.cu): the router's scores and gates, the permutation of tokens
// into expert order and back, and their backwards. ops/model/src/moe.rs is the layer they
// follow (a sigmoid router with top-k on score + bias, gates from the raw scores); moe.rs holds
// their plain references. Which experts a token goes to is chosen on the host, from the scores
// this file computes, by the same function the CPU model calls.
//
//   scores      s = sigmoid(logits), logits = router · h                     [rows, E]
//   gates       g_j = scaling · s_{c_j} / (Σ_i s_{c_i} + 1e-20)  (k > 1)      [rows, k]
//               g_j = scaling · s_{c_j}                          (k = 1)
//               c_j: the token's j-th chosen expert (best s + bias first)
//   dispatch    xp[i] = w_i · x[route_i]; w_i = gates[slot_i], or 1          [rows·k, d]
//   combine     out[t] = base[t] + Σ_j w · yp[pos_{t,j}], j in expert order  [rows, d]
//   gate grads  dg[slot_i] = dout[route_i] · yp[i]                           [rows, k]
//   router      d(logits)_{c_j} = ds_j · s(1 − s), 0 for experts not chosen
//
// The permuted rows are expert-major: expert 0's tokens (ascending), then expert 1's, ...
// route_i is the token of permuted row i, slot_i = token·k + j its place in the gates, and
// pos_{t,·} the token's permuted rows, ascending, so combine adds the experts in the order the
// CPU's index_add does. Every output element is written by one thread (a token takes an expert
// at most once), so nothing races and no float atomic is used: the bytes never depend on
// timing. Element-wise kernels are grid-stride (any grid and block); moe_gate_grads_f32 gives a
// warp to a row (blockDim a multiple of 32) and adds its lanes in a fixed tree.

#include <cuda_bf16.h>

extern "C" __global__ void moe_scores_f32(float* logits, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        logits[i] = 1.0f / (expf(-logits[i]) + 1.0f);
    }
}

// One thread a token.
extern "C" __global__ void moe_gates_fwd_f32(const float* scores, const int* chosen, float* gates,
                                             int rows, int experts, int k, float scaling) {
    const int stride = gridDim.x * blockDim.x;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < rows; t += stride) {
        const float* s = scores + size_t(t) * experts;
        const int* c = chosen + size_t(t) * k;
        float total = 0.0f;
        for (int j = 0; j < k; ++j) total += s[c[j]];
        for (int j = 0; j < k; ++j) {
            const float g = k > 1 ? s[c[j]] / (total + 1e-20f) : s[c[j]];
            gates[size_t(t) * k + j] = g * scaling;
        }
    }
}

// d(logits) from d(gates), one thread a token: its whole row of E is written, zeros where the
// token chose no expert.
extern "C" __global__ void moe_gates_bwd_f32(const float* scores, const int* chosen,
                                             const float* dgates, float* dlogits, int rows,
                                             int experts, int k, float scaling) {
    const int stride = gridDim.x * blockDim.x;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < rows; t += stride) {
        const float* s = scores + size_t(t) * experts;
        const int* c = chosen + size_t(t) * k;
        const float* dg = dgates + size_t(t) * k;
        float* out = dlogits + size_t(t) * experts;
        for (int e = 0; e < experts; ++e) out[e] = 0.0f;
        float total = 0.0f, dot = 0.0f;
        for (int j = 0; j < k; ++j) {
            total += s[c[j]];
            dot += dg[j] * s[c[j]];
        }
        total += 1e-20f;
        for (int j = 0; j < k; ++j) {
            const float v = s[c[j]];
            const float ds = k > 1 ? scaling * (dg[j] / total - dot / (total * total))
                                   : scaling * dg[j];
            out[c[j]] = ds * v * (1.0f - v);
        }
    }
}

// xp[i] = w_i · x[route_i], w_i = gates[slot_i] (or 1 when gates is null).
extern "C" __global__ void moe_gather_f32(const float* x, const int* routes, const int* slots,
                                          const float* gates, float* out, int n, int d) {
    const size_t total = size_t(n) * d;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
        const size_t i = e / d, c = e % d;
        const float v = x[size_t(routes[i]) * d + c];
        out[e] = gates ? gates[slots[i]] * v : v;
    }
}

// out[t] = base[t] + Σ w · yp[p] over the token's permuted rows p (ascending), w =
// gates[slot_p] (or 1 when gates is null), base 0 when null and out itself to add in place;
// one addition at a time, as the CPU's index_add makes them: __fmul_rn and __fadd_rn, which
// NVRTC never contracts into one fused multiply-add, so the GPU rounds the product as the CPU.
extern "C" __global__ void moe_combine_f32(const float* yp, const int* pos, const int* slots,
                                           const float* gates, const float* base, float* out,
                                           int rows, int k, int d) {
    const size_t total = size_t(rows) * d;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
        const size_t t = e / d, c = e % d;
        float acc = base ? base[e] : 0.0f;
        for (int j = 0; j < k; ++j) {
            const int p = pos[t * k + j];
            const float v = yp[size_t(p) * d + c];
            acc = __fadd_rn(acc, gates ? __fmul_rn(gates[slots[p]], v) : v);
        }
        out[e] = acc;
    }
}

// dg[slot_i] = dout[route_i] · yp[i]: a warp a permuted row, each lane adding its columns in
// order, then the lanes in a fixed butterfly.
extern "C" __global__ void moe_gate_grads_f32(const float* dout, const float* yp,
                                              const int* routes, const int* slots,
                                              float* dgates, int n, int d) {
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    for (int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < n; i += warps) {
        const float* g = dout + size_t(routes[i]) * d;
        const float* y = yp + size_t(i) * d;
        float acc = 0.0f;
        for (int c = lane; c < d; c += 32) acc += g[c] * y[c];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        }
        if (lane == 0) dgates[slots[i]] = acc;
    }
}
