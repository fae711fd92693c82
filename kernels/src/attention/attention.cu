// Grouped-query causal attention on the GPU: the kernels of attention/mod.rs, from the `qkv`
// projection's output (B, T, (h + 2k)·d) (h query heads, then k key heads, then k value heads)
// to the heads' outputs y (B, T, h·d). Query head i attends with kv head i / (h/k). RoPE is
// applied to queries and keys as they are loaded (cos, sin (B, T, d), rotate_half; null: none).
//
// Masks come from the packed layout, as ops/model's Layout::attention_mask defines them: query
// r sees key c when c ≤ r (if `causal`) and segments[b][c] == segments[b][r] (if `segments` is
// not null). causal = 0 with no segments is the unmasked attention of attention_plain's None;
// causal = 0 with segments lets a query see every key of its segment.
//
// Forward (FlashAttention's online softmax): one block per (batch row, head, tile of query
// rows), grid-stride over them. The block loads its query rows once, then walks the key tiles
// it may see in order (32 keys a tile in shared memory, one lane a key): each warp owns
// ROWS_PER_WARP query rows and keeps, per row, the running max m, the running sum l and the
// unnormalised output (each lane up to 4 of the d dimensions). A tile's probabilities go
// through the warp's slice of shared memory to the lanes that weigh v by them. It writes
// y = o / l and the row's log-sum-exp lse = m + log l (in units of the scaled scores) for
// the backward.
//
// A row that sees no key gets y = 0 and lse = −inf, as the CPU version.
//
// Limits: blockDim.x a multiple of 32, at most 128 (__launch_bounds__ refuses more on a GPU);
// head_dim ≤ 128 and even with RoPE. A head_dim over 128 gives NaN outputs (a kernel cannot
// return an error; its launcher refuses such a head first).

#include <cuda_bf16.h>
#include <math_constants.h>

#define ATTN_MAX_THREADS 128
constexpr int MAX_WARPS = ATTN_MAX_THREADS / 32;
constexpr int MAX_D = 128;                       // the widest head
constexpr int DIMS_PER_LANE = MAX_D / 32;        // a lane's share of a row
constexpr int KV_STRIDE = MAX_D + 1;             // padded: lane c reads row c without conflicts
constexpr int ROWS_PER_WARP = 2;                 // query rows per warp
constexpr int MAX_QROWS = ROWS_PER_WARP * MAX_WARPS;
constexpr int KEY_TILE = 32;                     // keys per tile: one a lane
constexpr unsigned FULL = 0xffffffffu;

static __device__ __forceinline__ float attn_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(FULL, v, offset);
    }
    return v;
}

static __device__ __forceinline__ float attn_warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL, v, offset));
    }
    return v;
}

// The problem's sizes.
struct AttnDims {
    int batch, len, heads, kv_heads, d;
    __device__ int width() const { return (heads + 2 * kv_heads) * d; }
    __device__ int group() const { return heads / kv_heads; }
    __device__ int key_col(int kv) const { return (heads + kv) * d; }
    __device__ int value_col(int kv) const { return (heads + kv_heads + kv) * d; }
};

// Rows [r0, r0 + count) of the d-wide head at column `col` of a (B, T, width) tensor into
// tile[i * stride + j], turned by RoPE when cos is not null; rows past the end are zeros.
static __device__ void load_tile(float* tile, int stride, const float* x, const float* cos,
                                 const float* sin, int b, int r0, int count, int len, int width,
                                 int col, int d) {
    const int half = d / 2;
    for (int e = threadIdx.x; e < count * d; e += blockDim.x) {
        const int i = e / d;
        const int j = e % d;
        const int r = r0 + i;
        float v = 0.0f;
        if (r < len) {
            const size_t row = size_t(b) * len + r;
            const float* xr = x + row * width + col;
            v = xr[j];
            if (cos != nullptr) {
                const float* c = cos + row * d;
                const float* s = sin + row * d;
                v = j < half ? xr[j] * c[j] - xr[j + half] * s[j]
                             : xr[j] * c[j] + xr[j - half] * s[j];
            }
        }
        tile[i * stride + j] = v;
    }
}

// Whether query r may attend to key c (seg: the batch row's segment ids, or null).
static __device__ __forceinline__ bool visible(const int* seg, int causal, int r, int c,
                                               int len) {
    if (r >= len || c >= len || (causal && c > r)) {
        return false;
    }
    return seg == nullptr || seg[r] == seg[c];
}

static __device__ __forceinline__ float dot(const float* a, const float* b, int d) {
    float sum = 0.0f;
    for (int j = 0; j < d; ++j) {
        sum += a[j] * b[j];
    }
    return sum;
}

// NaN over n values, grid-stride: the answer to sizes the kernels cannot hold.
static __device__ void fill_nan(float* p, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        p[i] = CUDART_NAN_F;
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_fwd_f32(const float* qkv, const float* cos, const float* sin, const int* segments,
                      float* y, float* lse, int batch, int len, int heads, int kv_heads,
                      int head_dim, int causal) {
    __shared__ float q_s[MAX_QROWS * MAX_D];
    __shared__ float k_s[KEY_TILE * KV_STRIDE];
    __shared__ float v_s[KEY_TILE * KV_STRIDE];
    __shared__ float p_s[MAX_QROWS * KEY_TILE];
    const AttnDims n{batch, len, heads, kv_heads, head_dim};
    const int d = head_dim;
    if (d > MAX_D) {
        fill_nan(y, size_t(batch) * len * heads * d);
        fill_nan(lse, size_t(batch) * heads * len);
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    float* p_w = p_s + warp * ROWS_PER_WARP * KEY_TILE;  // this warp's rows' probabilities
    const int rows = ROWS_PER_WARP * (blockDim.x / 32);
    const int tiles = (len + rows - 1) / rows;
    const float scale = 1.0f / sqrtf(float(d));
    const long long items = (long long)batch * heads * tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const int tile = int(item % tiles);
        const int head = int(item / tiles % heads);
        const int b = int(item / tiles / heads);
        const int kv = head / n.group();
        const int r0 = tile * rows;
        const int* seg = segments == nullptr ? nullptr : segments + size_t(b) * len;
        load_tile(q_s, MAX_D, qkv, cos, sin, b, r0, rows, len, n.width(), head * d, d);
        float o[ROWS_PER_WARP][DIMS_PER_LANE] = {};
        float m[ROWS_PER_WARP];
        float l[ROWS_PER_WARP];
        #pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            m[i] = -CUDART_INF_F;
            l[i] = 0.0f;
        }
        const int key_end = causal ? min(len, r0 + rows) : len;
        for (int c0 = 0; c0 < key_end; c0 += KEY_TILE) {
            __syncthreads();  // the query rows are in; every warp is done with the last tile
            load_tile(k_s, KV_STRIDE, qkv, cos, sin, b, c0, KEY_TILE, len, n.width(),
                      n.key_col(kv), d);
            load_tile(v_s, KV_STRIDE, qkv, nullptr, nullptr, b, c0, KEY_TILE, len, n.width(),
                      n.value_col(kv), d);
            __syncthreads();
            // Each lane scores its key against the warp's rows; the probabilities go through
            // the warp's slice of p_s so every lane can weigh its dimensions of v by them.
            #pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) {
                const int qi = warp * ROWS_PER_WARP + i;
                float s = -CUDART_INF_F;
                if (visible(seg, causal, r0 + qi, c0 + lane, len)) {
                    s = dot(q_s + qi * MAX_D, k_s + lane * KV_STRIDE, d) * scale;
                }
                const float m_new = fmaxf(m[i], attn_warp_max(s));
                // A row that has seen no key yet (m_new = −inf in every lane) adds nothing.
                const bool none = m_new == -CUDART_INF_F;
                const float alpha = none ? 1.0f : expf(m[i] - m_new);
                const float p = none ? 0.0f : expf(s - m_new);
                l[i] = l[i] * alpha + attn_warp_sum(p);
                m[i] = m_new;
                #pragma unroll
                for (int u = 0; u < DIMS_PER_LANE; ++u) {
                    o[i][u] *= alpha;
                }
                p_w[i * KEY_TILE + lane] = p;
            }
            __syncwarp();
            for (int c = 0; c < KEY_TILE; ++c) {
                #pragma unroll
                for (int u = 0; u < DIMS_PER_LANE; ++u) {
                    const int j = lane + 32 * u;
                    if (j < d) {
                        const float v = v_s[c * KV_STRIDE + j];
                        #pragma unroll
                        for (int i = 0; i < ROWS_PER_WARP; ++i) {
                            o[i][u] += p_w[i * KEY_TILE + c] * v;
                        }
                    }
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int r = r0 + warp * ROWS_PER_WARP + i;
            if (r >= len) {
                continue;
            }
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            float* yr = y + (size_t(b) * len + r) * heads * d + head * d;
            #pragma unroll
            for (int u = 0; u < DIMS_PER_LANE; ++u) {
                const int j = lane + 32 * u;
                if (j < d) {
                    yr[j] = o[i][u] * inv;
                }
            }
            if (lane == 0) {
                lse[(size_t(b) * heads + head) * len + r] =
                    l[i] > 0.0f ? m[i] + logf(l[i]) : -CUDART_INF_F;
            }
        }
        __syncthreads();  // q_s is loaded again for the next item
    }
}
