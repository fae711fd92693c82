// Cached decoding on the GPU: one new token per batch row, against the keys and values (an
// attention block) or the convolution window and SSM state (a Mamba-2 block) kept from the
// tokens before it, as ops/model/src/decode.rs decodes on the CPU. decode.rs holds the plain
// references and the tests.
//
// Attention, for a block of h query heads and k key/value heads of d dimensions, at step t
// (the (t+1)-th token fed, real or not) of caches that hold up to max_len steps:
//   decode_kv_append_f32   q (B, h, d) = the row's query, turned by RoPE (cos, sin (B, d):
//                          each row's own position; null: none); key (turned) and value into
//                          kcache, vcache (B, k, max_len, d) at step t.
//   decode_attention_f32   y (B, h·d): query head i attends with kv head i / (h/k) to the
//                          steps j ≤ t where real[j, b] != 0 (int (max_len, B): a step's
//                          flags side by side), and always to step t itself (so a row that
//                          sits the step out still gets a finite, meaningless, output):
//                          p = softmax(q·k / √d), y = Σ_j p_j v_j. One block a (row, head):
//                          its threads score the steps into `scores` (B, h, max_len), reduce
//                          max and sum in a fixed tree, then each thread sums its dimensions'
//                          Σ_j p_j v_j in step order: the bytes never depend on timing.
//
// Mamba-2, for channels ch = [x (H·P), B (G·N), C (G·N)] and a window of K taps:
//   decode_conv_step_f32   window (B, K, ch), newest last: rows with active[b] != 0 shift it
//                          left and append the token's xBC (columns [offset, offset + ch) of
//                          proj (B, cols)); every row's out = SiLU(bias + Σ_j w[c, j]·window_j)
//                          over the window with the token in it (taps in order j = 0..K).
//   decode_ssm_step_f32    per (row, head, p): S ← exp(Δ·A)·S + Δ·x·B, y = S·C + D·x, with
//                          head h reading group h / (H/G) of B and C; the state is written back
//                          only where active[b] != 0.
// One thread an element, grid-stride, for the three element-wise kernels: any grid and block.

#include <cuda_bf16.h>

// The most threads decode_attention_f32's block reductions hold.
#define DECODE_MAX_THREADS 256
constexpr unsigned DECODE_FULL = 0xffffffffu;
// Below any score a finite input gives (not -INFINITY, which NVRTC does not define).
constexpr float DECODE_LOWEST = -3.402823466e+38f;

extern "C" __global__ void decode_kv_append_f32(const float* qkv, const float* cos,
                                                const float* sin, float* q, float* kcache,
                                                float* vcache, int batch, int step, int max_len,
                                                int heads, int kv_heads, int d) {
    const int width = (heads + 2 * kv_heads) * d;
    const int half = d / 2;
    const size_t n = size_t(batch) * width;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const int b = int(e / width);
        const int col = int(e % width);
        const int head = col / d;  // 0..h: queries, h..h+k: keys, then values
        const int j = col % d;
        const float* x = qkv + size_t(b) * width + size_t(head) * d;
        float v = x[j];
        if (cos != nullptr && head < heads + kv_heads) {
            const float c = cos[size_t(b) * d + j];
            const float s = sin[size_t(b) * d + j];
            v = j < half ? x[j] * c - x[j + half] * s : x[j] * c + x[j - half] * s;
        }
        if (head < heads) {
            q[(size_t(b) * heads + head) * d + j] = v;
        } else {
            const bool key = head < heads + kv_heads;
            const int kv = key ? head - heads : head - heads - kv_heads;
            float* cache = key ? kcache : vcache;
            cache[((size_t(b) * kv_heads + kv) * max_len + step) * d + j] = v;
        }
    }
}

// The block's maximum or sum of `v` (every thread gets the result): warps by shuffles, then
// warp 0 over the warps' results, always the same tree. Two barriers suffice, also between
// one call and the next: a thread writes shared[warp] of a call only after passing the last
// barrier of the call before, where warp 0 had finished reading those slots, and shared[32]
// is written after the first barrier of a call, which no thread passes before it has read the
// previous call's shared[32].
static __device__ float decode_block_reduce(float v, float* shared, bool is_max) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float o = __shfl_xor_sync(DECODE_FULL, v, offset);
        v = is_max ? fmaxf(v, o) : v + o;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warps = (blockDim.x + 31) / 32;
    if (lane == 0) {
        shared[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? shared[lane] : (is_max ? DECODE_LOWEST : 0.0f);
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float o = __shfl_xor_sync(DECODE_FULL, v, offset);
            v = is_max ? fmaxf(v, o) : v + o;
        }
        if (lane == 0) {
            shared[32] = v;
        }
    }
    __syncthreads();
    return shared[32];
}

// blockDim.x a multiple of 32, at most DECODE_MAX_THREADS; any grid (grid-stride over the
// (row, head) pairs).
extern "C" __global__ void __launch_bounds__(DECODE_MAX_THREADS)
    decode_attention_f32(const float* q, const float* kcache, const float* vcache,
                         const int* real, float* scores, float* y, int batch, int step,
                         int max_len, int heads, int kv_heads, int d) {
    __shared__ float shared[33];
    const float scale = rsqrtf(float(d));
    const int group = heads / kv_heads;
    for (int item = blockIdx.x; item < batch * heads; item += gridDim.x) {
        const int b = item / heads, head = item % heads, kv = head / group;
        const float* qr = q + size_t(item) * d;
        const float* keys = kcache + (size_t(b) * kv_heads + kv) * max_len * d;
        const float* values = vcache + (size_t(b) * kv_heads + kv) * max_len * d;
        float* s = scores + size_t(item) * max_len;
        float m = DECODE_LOWEST;
        for (int j = threadIdx.x; j <= step; j += blockDim.x) {
            float v = DECODE_LOWEST;
            if (j == step || real[size_t(j) * batch + b] != 0) {
                float dot = 0.0f;
                for (int i = 0; i < d; ++i) {
                    dot += qr[i] * keys[size_t(j) * d + i];
                }
                v = dot * scale;
            }
            s[j] = v;
            m = fmaxf(m, v);
        }
        m = decode_block_reduce(m, shared, true);
        float l = 0.0f;
        for (int j = threadIdx.x; j <= step; j += blockDim.x) {
            const float p = s[j] == DECODE_LOWEST ? 0.0f : expf(s[j] - m);
            s[j] = p;
            l += p;
        }
        l = decode_block_reduce(l, shared, false);  // its barriers publish every s[j]
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j <= step; ++j) {
                acc += s[j] * values[size_t(j) * d + i];
            }
            y[(size_t(b) * heads + head) * d + i] = acc / l;
        }
    }
}

extern "C" __global__ void decode_conv_step_f32(const float* proj, int cols, int offset,
                                                const float* w, const float* bias,
                                                float* window, const int* active, float* out,
                                                int batch, int ch, int k) {
    const size_t n = size_t(batch) * ch;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        const int b = int(e / ch), c = int(e % ch);
        float* win = window + size_t(b) * k * ch + c;
        const float x = proj[size_t(b) * cols + offset + c];
        // pre = bias + Σ_j w_j · window'_j, window' = [window_1 .. window_{K-1}, x].
        float pre = bias[c];
        for (int j = 0; j < k; ++j) {
            const float v = j + 1 < k ? win[size_t(j + 1) * ch] : x;
            pre += v * w[size_t(c) * k + j];
        }
        if (active[b] != 0) {
            for (int j = 0; j + 1 < k; ++j) {
                win[size_t(j) * ch] = win[size_t(j + 1) * ch];
            }
            win[size_t(k - 1) * ch] = x;
        }
        out[e] = pre / (1.0f + expf(-pre));
    }
}

extern "C" __global__ void decode_ssm_step_f32(const float* xbc, const float* dt, const float* a,
                                               const float* d_skip, float* state,
                                               const int* active, float* y, int batch,
                                               int heads, int p, int groups, int n) {
    const int inner = heads * p, ch = inner + 2 * groups * n;
    const size_t total = size_t(batch) * inner;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
        const int b = int(e / inner), col = int(e % inner), h = col / p;
        const int g = h / (heads / groups);
        const float* row = xbc + size_t(b) * ch;
        const float x = row[col];
        const float* bm = row + inner + g * n;
        const float* cm = row + inner + groups * n + g * n;
        const float delta = dt[size_t(b) * heads + h];
        const float decay = expf(delta * a[h]);
        float* s = state + e * n;
        const bool keep = active[b] != 0;
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float next = s[i] * decay + delta * x * bm[i];
            acc += next * cm[i];
            if (keep) {
                s[i] = next;
            }
        }
        y[e] = acc + d_skip[h] * x;
    }
}
