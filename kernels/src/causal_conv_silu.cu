// Mamba-2's depthwise causal convolution + SiLU on the GPU: the kernels of causal_conv_silu.rs.
// `x` and `y` are [tokens, C] with tokens = B·T (rows of `len` tokens), `w` is [C, K] (tap K−1
// multiplies the current token), `bias` is [C], and `starts[i]` is the index inside its row of
// the first token of token i's run: a tap reaching before it reads zero.
//
// Forward: y_t = silu(pre_t), pre_t = bias + Σ_j w_j ⊙ x_{t−(K−1−j)}, taps in order j = 0..K.
// Backward, in three launches with no atomics:
//   causal_conv_silu_dpre_f32:       dpre = dy ⊙ σ(pre)·(1 + pre·(1 − σ(pre)))
//   causal_conv_silu_dx_f32:         dx_s = Σ_taps reaching s dpre_{s+shift} ⊙ w_j, gathered by
//                                    the thread of s, nearest token first (the CPU's order)
//   causal_conv_silu_dw_partials_f32 and causal_conv_silu_dw_reduce:
//                                    dw_j = Σ_t dpre_t ⊙ x_{t−shift}, dbias = Σ_t dpre_t; each
//                                    block sums its own contiguous range of tokens into its
//                                    partial rows, and the reduce adds the partials in block
//                                    order, so the bytes never depend on timing.
// The element-wise kernels are one thread an element, grid-stride: any grid and block work.

#include <cuda_bf16.h>

static __device__ __forceinline__ float conv_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Whether tap `shift` of token `i` (at `t` in its row) reads a token of its own run.
static __device__ __forceinline__ bool conv_tap_reaches(const int* starts, size_t i, int t,
                                                        int shift) {
    return t >= shift && t - shift >= starts[i];
}

// pre for element (token i, channel c), taps in order.
static __device__ float conv_pre(const float* x, const float* w, const float* bias,
                                 const int* starts, size_t i, int c, int len, int ch, int k) {
    const int t = int(i % len);
    float pre = bias[c];
    for (int j = 0; j < k; ++j) {
        const int shift = k - 1 - j;
        if (conv_tap_reaches(starts, i, t, shift)) {
            pre += x[(i - shift) * ch + c] * w[size_t(c) * k + j];
        }
    }
    return pre;
}

extern "C" __global__ void causal_conv_silu_fwd_f32(const float* x, const float* w,
                                                    const float* bias, const int* starts,
                                                    float* y, int tokens, int len, int ch, int k) {
    const size_t n = size_t(tokens) * ch;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const float pre = conv_pre(x, w, bias, starts, e / ch, int(e % ch), len, ch, k);
        y[e] = pre * conv_sigmoid(pre);
    }
}

extern "C" __global__ void causal_conv_silu_dpre_f32(const float* x, const float* w,
                                                     const float* bias, const int* starts,
                                                     const float* dy, float* dpre, int tokens,
                                                     int len, int ch, int k) {
    const size_t n = size_t(tokens) * ch;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const float pre = conv_pre(x, w, bias, starts, e / ch, int(e % ch), len, ch, k);
        const float s = conv_sigmoid(pre);
        dpre[e] = dy[e] * (s * (1.0f + pre * (1.0f - s)));
    }
}

// dx_s: token t = s + shift feeds back through tap j = K−1−shift when that tap of t reaches s,
// i.e. t is in s's row and s is in t's run.
extern "C" __global__ void causal_conv_silu_dx_f32(const float* w, const int* starts,
                                                   const float* dpre, float* dx, int tokens,
                                                   int len, int ch, int k) {
    const size_t n = size_t(tokens) * ch;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const size_t s = e / ch;
        const int c = int(e % ch);
        const int at = int(s % len);
        float sum = 0.0f;
        for (int shift = 0; shift < k && at + shift < len; ++shift) {
            const size_t t = s + shift;
            if (conv_tap_reaches(starts, t, at + shift, shift)) {
                sum += dpre[t * ch + c] * w[size_t(c) * k + (k - 1 - shift)];
            }
        }
        dx[e] = sum;
    }
}

// Block b sums tokens [b·per, (b+1)·per), per = ⌈tokens / gridDim.x⌉, into its partial rows
// partial[b][j][c] (j < K: dw's tap j; j = K: dbias), one thread a channel, each sum over the
// tokens in order.
extern "C" __global__ void causal_conv_silu_dw_partials_f32(const float* x, const int* starts,
                                                            const float* dpre, float* partial,
                                                            int tokens, int len, int ch, int k) {
    const int per = (tokens + gridDim.x - 1) / gridDim.x;
    const int first = blockIdx.x * per;
    const int last = min(tokens, first + per);
    float* block = partial + size_t(blockIdx.x) * (k + 1) * ch;
    for (int c = threadIdx.x; c < ch; c += blockDim.x) {
        for (int j = 0; j < k; ++j) {
            const int shift = k - 1 - j;
            float sum = 0.0f;
            for (int i = first; i < last; ++i) {
                if (conv_tap_reaches(starts, i, i % len, shift)) {
                    sum += dpre[size_t(i) * ch + c] * x[size_t(i - shift) * ch + c];
                }
            }
            block[size_t(j) * ch + c] = sum;
        }
        float sum = 0.0f;
        for (int i = first; i < last; ++i) {
            sum += dpre[size_t(i) * ch + c];
        }
        block[size_t(k) * ch + c] = sum;
    }
}

// dw[c][j] = Σ_b partial[b][j][c] and dbias[c] = Σ_b partial[b][K][c], b in order: one thread
// a (tap, channel) pair.
extern "C" __global__ void causal_conv_silu_dw_reduce(const float* partial, float* dw,
                                                      float* dbias, int blocks, int ch, int k) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (k + 1) * ch) {
        return;
    }
    const int j = e / ch;
    const int c = e % ch;
    float sum = 0.0f;
    for (int b = 0; b < blocks; ++b) {
        sum += partial[size_t(b) * (k + 1) * ch + e];
    }
    if (j < k) {
        dw[size_t(c) * k + j] = sum;
    } else {
        dbias[c] = sum;
    }
}
