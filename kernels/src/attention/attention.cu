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
// Backward, no atomics, every sum in a fixed order:
//   attention_bwd_delta_f32: delta = Σ_j dy·y per (row, head).
//   attention_bwd_dq_f32:    like the forward, one block per query tile: p = exp(s − lse),
//                            ds = scale · p (dy·vᵀ − delta), dq = Σ_keys ds·k in key order.
//   attention_bwd_dkv_f32:   one block per (batch row, kv head, tile of keys): it walks the
//                            group's query heads in order and each head's query tiles in
//                            order, dv = Σ pᵀ·dy and dk = Σ dsᵀ·q, so the group's sum never
//                            depends on timing.
// dq and dk are turned back by RoPE's transpose before they are written into dqkv, which has
// qkv's layout. A row that sees no key gets y = 0 and lse = −inf, as the CPU version.
//
// Limits: blockDim.x a multiple of 32, at most 128 (__launch_bounds__ refuses more on a GPU);
// head_dim ≤ 128 and even with RoPE. A head_dim over 128 gives NaN outputs (a kernel cannot
// return an error; its launcher refuses such a head first, and a training step stops on a
// non-finite gradient norm).

#include <cuda_bf16.h>
#include <math_constants.h>

#define ATTN_MAX_THREADS 128
constexpr int MAX_WARPS = ATTN_MAX_THREADS / 32;
constexpr int MAX_D = 128;                       // the widest head
constexpr int DIMS_PER_LANE = MAX_D / 32;        // a lane's share of a row
constexpr int KV_STRIDE = MAX_D + 1;             // padded: lane c reads row c without conflicts
constexpr int ROWS_PER_WARP = 2;                 // query rows per warp (forward, dq)
constexpr int MAX_QROWS = ROWS_PER_WARP * MAX_WARPS;
constexpr int KEY_TILE = 32;                     // keys per tile (forward, dq): one a lane
constexpr int KEYS_PER_WARP = 4;                 // keys per warp (dkv)
constexpr int MAX_KEYS = KEYS_PER_WARP * MAX_WARPS;
constexpr int DKV_QROWS = 16;                    // query rows per tile (dkv)
constexpr int P_STRIDE = MAX_KEYS + 1;
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

// The problem's sizes, shared by every kernel.
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

// Element j of RoPE's transpose of the row g (d wide) at token `row`; g itself without tables.
static __device__ __forceinline__ float unrotate(const float* g, const float* cos,
                                                 const float* sin, size_t row, int j, int d) {
    if (cos == nullptr) {
        return g[j];
    }
    const int half = d / 2;
    const float* c = cos + row * d;
    const float* s = sin + row * d;
    return j < half ? g[j] * c[j] + g[j + half] * s[j + half]
                    : g[j] * c[j] - g[j - half] * s[j - half];
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

// The same for n bf16 values (as their bits).
static __device__ void fill_nan(unsigned short* p, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        p[i] = 0x7fc0;  // a quiet NaN
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

// delta[b][head][r] = Σ_j dy·y over the head's d values: one warp a row, grid-stride.
extern "C" __global__ void attention_bwd_delta_f32(const float* y, const float* dy, float* delta,
                                                   int batch, int len, int heads,
                                                   int head_dim) {
    const int lane = threadIdx.x % 32;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    const long long rows = (long long)batch * heads * len;
    for (long long w = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; w < rows;
         w += warps) {
        const long long r = w % len;
        const long long head = w / len % heads;
        const long long b = w / len / heads;
        const size_t at = size_t((b * len + r) * heads + head) * head_dim;
        float sum = 0.0f;
        for (int j = lane; j < head_dim; j += 32) {
            sum += dy[at + j] * y[at + j];
        }
        sum = attn_warp_sum(sum);
        if (lane == 0) {
            delta[w] = sum;
        }
    }
}

// dq into the query heads' columns of dqkv: one block per (batch row, head, query tile).
extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dq_f32(const float* qkv, const float* cos, const float* sin,
                         const int* segments, const float* dy, const float* lse,
                         const float* delta, float* dqkv, int batch, int len, int heads,
                         int kv_heads, int head_dim, int causal) {
    __shared__ float q_s[MAX_QROWS * MAX_D];
    __shared__ float dy_s[MAX_QROWS * MAX_D];
    __shared__ float k_s[KEY_TILE * KV_STRIDE];
    __shared__ float v_s[KEY_TILE * KV_STRIDE];
    __shared__ float ds_s[MAX_QROWS * KEY_TILE];
    const AttnDims n{batch, len, heads, kv_heads, head_dim};
    const int d = head_dim;
    if (d > MAX_D) {
        fill_nan(dqkv, size_t(batch) * len * n.width());
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    float* ds_w = ds_s + warp * ROWS_PER_WARP * KEY_TILE;  // this warp's rows' ds
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
        load_tile(dy_s, MAX_D, dy, nullptr, nullptr, b, r0, rows, len, heads * d, head * d, d);
        float row_lse[ROWS_PER_WARP];
        float row_delta[ROWS_PER_WARP];
        float dq[ROWS_PER_WARP][DIMS_PER_LANE] = {};
        #pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int r = r0 + warp * ROWS_PER_WARP + i;
            const size_t at = (size_t(b) * heads + head) * len + r;
            row_lse[i] = r < len ? lse[at] : 0.0f;
            row_delta[i] = r < len ? delta[at] : 0.0f;
        }
        const int key_end = causal ? min(len, r0 + rows) : len;
        for (int c0 = 0; c0 < key_end; c0 += KEY_TILE) {
            __syncthreads();  // the query rows are in; every warp is done with the last tile
            load_tile(k_s, KV_STRIDE, qkv, cos, sin, b, c0, KEY_TILE, len, n.width(),
                      n.key_col(kv), d);
            load_tile(v_s, KV_STRIDE, qkv, nullptr, nullptr, b, c0, KEY_TILE, len, n.width(),
                      n.value_col(kv), d);
            __syncthreads();
            #pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) {
                const int qi = warp * ROWS_PER_WARP + i;
                float ds = 0.0f;
                if (visible(seg, causal, r0 + qi, c0 + lane, len)) {
                    const float s = dot(q_s + qi * MAX_D, k_s + lane * KV_STRIDE, d) * scale;
                    const float p = expf(s - row_lse[i]);
                    const float dp = dot(dy_s + qi * MAX_D, v_s + lane * KV_STRIDE, d);
                    ds = scale * p * (dp - row_delta[i]);
                }
                ds_w[i * KEY_TILE + lane] = ds;
            }
            __syncwarp();
            for (int c = 0; c < KEY_TILE; ++c) {
                #pragma unroll
                for (int u = 0; u < DIMS_PER_LANE; ++u) {
                    const int j = lane + 32 * u;
                    if (j < d) {
                        const float k = k_s[c * KV_STRIDE + j];
                        #pragma unroll
                        for (int i = 0; i < ROWS_PER_WARP; ++i) {
                            dq[i][u] += ds_w[i * KEY_TILE + c] * k;
                        }
                    }
                }
            }
        }
        // Each warp turns its own rows back through q_s: RoPE's transpose mixes dimensions
        // half a head apart, which other lanes hold.
        #pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int qi = warp * ROWS_PER_WARP + i;
            #pragma unroll
            for (int u = 0; u < DIMS_PER_LANE; ++u) {
                const int j = lane + 32 * u;
                if (j < d) {
                    q_s[qi * MAX_D + j] = dq[i][u];
                }
            }
        }
        __syncwarp();
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int qi = warp * ROWS_PER_WARP + i;
            const int r = r0 + qi;
            if (r >= len) {
                continue;
            }
            const size_t row = size_t(b) * len + r;
            for (int j = lane; j < d; j += 32) {
                dqkv[row * n.width() + head * d + j] = unrotate(q_s + qi * MAX_D, cos, sin, row, j, d);
            }
        }
        __syncthreads();  // q_s and dy_s are loaded again for the next item
    }
}

// dk and dv into the kv heads' columns of dqkv: one block per (batch row, kv head, key tile of
// KEYS_PER_WARP keys a warp), summing over the group's query heads and their query tiles in
// order. Per query tile: every thread computes some (row, key) pairs' p and ds into shared
// memory, then each warp adds its keys' dv += p·dy and dk += ds·q, a lane per dimension.
extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dkv_f32(const float* qkv, const float* cos, const float* sin,
                          const int* segments, const float* dy, const float* lse,
                          const float* delta, float* dqkv, int batch, int len, int heads,
                          int kv_heads, int head_dim, int causal) {
    __shared__ float k_s[MAX_KEYS * KV_STRIDE];
    __shared__ float v_s[MAX_KEYS * KV_STRIDE];
    __shared__ float q_s[DKV_QROWS * MAX_D];
    __shared__ float dy_s[DKV_QROWS * MAX_D];
    __shared__ float p_s[DKV_QROWS * P_STRIDE];
    __shared__ float ds_s[DKV_QROWS * P_STRIDE];
    __shared__ float lse_s[DKV_QROWS];
    __shared__ float delta_s[DKV_QROWS];
    const AttnDims n{batch, len, heads, kv_heads, head_dim};
    const int d = head_dim;
    if (d > MAX_D) {
        fill_nan(dqkv, size_t(batch) * len * n.width());
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int keys = KEYS_PER_WARP * (blockDim.x / 32);
    const int tiles = (len + keys - 1) / keys;
    const float scale = 1.0f / sqrtf(float(d));
    const long long items = (long long)batch * kv_heads * tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const int tile = int(item % tiles);
        const int kv = int(item / tiles % kv_heads);
        const int b = int(item / tiles / kv_heads);
        const int c0 = tile * keys;
        const int* seg = segments == nullptr ? nullptr : segments + size_t(b) * len;
        load_tile(k_s, KV_STRIDE, qkv, cos, sin, b, c0, keys, len, n.width(), n.key_col(kv), d);
        load_tile(v_s, KV_STRIDE, qkv, nullptr, nullptr, b, c0, keys, len, n.width(),
                  n.value_col(kv), d);
        float dk[KEYS_PER_WARP][DIMS_PER_LANE] = {};
        float dv[KEYS_PER_WARP][DIMS_PER_LANE] = {};
        // Causal: no query row before the tile's first key sees it.
        const int first_row = causal ? c0 / DKV_QROWS * DKV_QROWS : 0;
        for (int g = 0; g < n.group(); ++g) {
            const int head = kv * n.group() + g;
            for (int r0 = first_row; r0 < len; r0 += DKV_QROWS) {
                __syncthreads();  // the key tile is in; every warp is done with the last rows
                load_tile(q_s, MAX_D, qkv, cos, sin, b, r0, DKV_QROWS, len, n.width(), head * d,
                          d);
                load_tile(dy_s, MAX_D, dy, nullptr, nullptr, b, r0, DKV_QROWS, len, heads * d,
                          head * d, d);
                for (int i = threadIdx.x; i < DKV_QROWS; i += blockDim.x) {
                    const int r = r0 + i;
                    const size_t at = (size_t(b) * heads + head) * len + r;
                    lse_s[i] = r < len ? lse[at] : 0.0f;
                    delta_s[i] = r < len ? delta[at] : 0.0f;
                }
                __syncthreads();
                for (int e = threadIdx.x; e < DKV_QROWS * keys; e += blockDim.x) {
                    const int i = e / keys;
                    const int kc = e % keys;
                    float p = 0.0f;
                    float ds = 0.0f;
                    if (visible(seg, causal, r0 + i, c0 + kc, len)) {
                        const float s = dot(q_s + i * MAX_D, k_s + kc * KV_STRIDE, d) * scale;
                        p = expf(s - lse_s[i]);
                        const float dp = dot(dy_s + i * MAX_D, v_s + kc * KV_STRIDE, d);
                        ds = scale * p * (dp - delta_s[i]);
                    }
                    p_s[i * P_STRIDE + kc] = p;
                    ds_s[i * P_STRIDE + kc] = ds;
                }
                __syncthreads();
                #pragma unroll
                for (int k = 0; k < KEYS_PER_WARP; ++k) {
                    const int kc = warp * KEYS_PER_WARP + k;
                    for (int i = 0; i < DKV_QROWS; ++i) {
                        const float p = p_s[i * P_STRIDE + kc];
                        const float ds = ds_s[i * P_STRIDE + kc];
                        #pragma unroll
                        for (int u = 0; u < DIMS_PER_LANE; ++u) {
                            const int j = lane + 32 * u;
                            if (j < d) {
                                dv[k][u] += p * dy_s[i * MAX_D + j];
                                dk[k][u] += ds * q_s[i * MAX_D + j];
                            }
                        }
                    }
                }
            }
        }
        __syncthreads();  // every thread is done reading k_s
        #pragma unroll
        for (int k = 0; k < KEYS_PER_WARP; ++k) {
            const int kc = warp * KEYS_PER_WARP + k;
            const int c = c0 + kc;
            #pragma unroll
            for (int u = 0; u < DIMS_PER_LANE; ++u) {
                const int j = lane + 32 * u;
                if (j < d) {
                    k_s[kc * KV_STRIDE + j] = dk[k][u];
                    if (c < len) {
                        dqkv[(size_t(b) * len + c) * n.width() + n.value_col(kv) + j] = dv[k][u];
                    }
                }
            }
        }
        __syncwarp();  // each warp turns its own keys back
        for (int k = 0; k < KEYS_PER_WARP; ++k) {
            const int kc = warp * KEYS_PER_WARP + k;
            const int c = c0 + kc;
            if (c >= len) {
                continue;
            }
            const size_t row = size_t(b) * len + c;
            for (int j = lane; j < d; j += 32) {
                dqkv[row * n.width() + n.key_col(kv) + j] =
                    unrotate(k_s + kc * KV_STRIDE, cos, sin, row, j, d);
            }
        }
        __syncthreads();  // k_s and v_s are loaded again for the next item
    }
}

// ---------------------------------------------------------------------------------------------
// The same attention on the tensor cores, for steps whose products are bf16 (Precision::Bf16):
// FlashAttention-2's loops (Dao, 2023, arXiv:2307.08691) with each product on
// mma.sync.m16n8k16 (bf16 operands, f32 sums). Same masks, RoPE and outputs as the f32
// kernels above; q, k, v, p, dy and ds are rounded to bf16 where they enter a product, as
// FlashAttention does, and every softmax statistic (max, sum, lse, delta) stays f32.
//
// attention_pack_bf16 first writes qkv (RoPE applied to q and k) and, for the backward, dy as
// bf16 heads of contiguous rows, (B, heads, T, d): the kernels then copy a tile into shared
// memory 16 bytes at a time by cp.async, with no RoPE to compute, however many blocks read
// it; for heads up to 64 wide the next tile's copies are in flight while a tile is used (two
// stages, `next_tile`).
//
// A warp owns 16 rows of a product: in the forward and dq, 16 query rows (key tiles of KT);
// in dkv, 16 keys (query tiles of QR). Scores stay in the mma's accumulator registers, where
// the PTX ISA says a lane holds rows group and group + 8, columns 2t and 2t + 1 of each
// 8-wide tile (lane = 4·group + t): the online softmax reduces a row over the four lanes of
// its group, and an accumulator turns into the next product's A fragment without leaving the
// registers. Operands come from shared memory by ldmatrix, four 8 × 8 matrices an
// instruction (transposed where a tile is stored k-major, as v is for p·v). dq and dk are
// turned back by RoPE in registers: dimension j + d/2 is the same lane's.
//
// Limits: head_dim 16, 32, 64 or 128, each its own kernels (`attention_fwd_bf16_d64`, …; the
// launcher sends other widths to the f32 kernels); blockDim.x 32, 64, 96 or 128.

// ATTN_ASYNC=0 (NEMO_DAG_CUDA_DEFINES) builds the tiles' copies as plain 16-byte loads and
// stores through registers, one stage: the kernels as they were before cp.async, to time the
// two against each other on a GPU (the SIMT shim always runs the cp.async model).
#ifndef ATTN_ASYNC
#define ATTN_ASYNC 1
#endif

constexpr int TC_MAX_WARPS = 4;
constexpr int TC_ROWS = 16 * TC_MAX_WARPS;  // a block's rows (forward, dq) or keys (dkv)

// Keys a tile (forward, dq) and query rows a tile (dkv) for heads D wide: fewer for the widest
// heads, whose accumulators would spill at 64.
template <int D>
struct TcTiles {
    static constexpr int KT = D > 64 ? 32 : 64;
    static constexpr int QR = D > 64 ? 16 : 32;
    static constexpr int ST = D + 8;  // a tile row in shared memory, in bf16s (padded)
    // Stages of the tiles a loop walks: two fit the 48 KB of static shared memory for heads up
    // to 64 wide, so the next tile's copies are in flight while one is used.
    static constexpr int STAGES = D > 64 || !ATTN_ASYNC ? 1 : 2;
};

// D += A·B over one warp: A 16 × 16 and B 16 × 8 in bf16, D 16 × 8 in f32.
static __device__ __forceinline__ void mma_bf16(float d[4], const unsigned a[4],
                                                const unsigned b[2]) {
#ifdef __CUDA_ARCH__
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    simt::mma_m16n8k16_bf16(d, a, b);
#endif
}

// cp.async: 16 bytes from global `from` to shared `to` (both 16-byte aligned), in flight until
// a cp_async_wait of this thread lets them land. cp_async_commit closes the thread's group of
// copies issued since its last; cp_async_wait<N> returns when at most the N newest groups are
// still in flight.
static __device__ __forceinline__ void copy16_async(unsigned short* to,
                                                    const unsigned short* from) {
#if defined(__CUDA_ARCH__) && !ATTN_ASYNC
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
#elif defined(__CUDA_ARCH__)
    const unsigned at = unsigned(__cvta_generic_to_shared(to));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(from));
#else
    simt::cp_async16(to, from);
#endif
}

static __device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && !ATTN_ASYNC
#elif defined(__CUDA_ARCH__)
    asm volatile("cp.async.commit_group;\n" ::);
#else
    simt::cp_async_commit();
#endif
}

template <int N>
static __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && !ATTN_ASYNC
#elif defined(__CUDA_ARCH__)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
    simt::cp_async_wait(N);
#endif
}

// 16 zero bytes at `to`, 16-byte aligned.
static __device__ __forceinline__ void zero16(unsigned short* to) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
#else
    simt::require_aligned(to, 16, "zero16");
    std::memset(to, 0, 16);
#endif
}

static __device__ __forceinline__ unsigned short bf16_bits(float x) {
    return __bfloat16_as_ushort(__float2bfloat16(x));
}

// Two bf16 values in a word, `lo` in the low half: an mma operand register.
static __device__ __forceinline__ unsigned pack(unsigned short lo, unsigned short hi) {
    return unsigned(lo) | (unsigned(hi) << 16);
}

static __device__ __forceinline__ unsigned pack_f32(float lo, float hi) {
    return pack(bf16_bits(lo), bf16_bits(hi));
}

// ldmatrix .x4: the warp loads four 8 × 8 matrices of bf16 from shared memory, lane 8·m + r
// passing the address of matrix m's row r (16 bytes, 16-byte aligned). Word m of lane 4·r + w
// is that row's values 2w and 2w + 1, or with Trans column r's values in rows 2w and 2w + 1:
// an mma fragment's word either way, one instruction for what takes 4 to 8 shared loads a lane.
template <bool Trans>
static __device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const unsigned short* row) {
#ifdef __CUDA_ARCH__
    const unsigned at = unsigned(__cvta_generic_to_shared(row));
    if constexpr (!Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    }
#else
    simt::ldmatrix_b16(r, 4, Trans, row);
#endif
}

// The A fragment of the 16 × 16 tile whose row r starts at s + r·rs (its columns contiguous):
// matrices (rows 0–7, columns 0–7), (8–15, 0–7), (0–7, 8–15), (8–15, 8–15).
static __device__ __forceinline__ void load_a(unsigned a[4], const unsigned short* s, int rs) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<false>(a, s + lane % 16 * rs + lane / 16 * 8);
}

// The B fragments of two 16 × 8 tiles side by side (k × 16 n), stored n-major: column n's k
// values at s + n·ns. Words 0, 1 are the first tile's, 2, 3 the second's: matrices (n 0–7,
// k 0–7), (n 0–7, k 8–15), (n 8–15, k 0–7), (n 8–15, k 8–15), as stored.
static __device__ __forceinline__ void load_b2_cols(unsigned b[4], const unsigned short* s,
                                                    int ns) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<false>(b, s + (lane % 8 + lane / 16 * 8) * ns + lane / 8 % 2 * 8);
}

// The same two B fragments stored k-major: row k's n values at s + k·ks. Matrices (k 0–7,
// n 0–7), (k 8–15, n 0–7), (k 0–7, n 8–15), (k 8–15, n 8–15), transposed.
static __device__ __forceinline__ void load_b2_rows(unsigned b[4], const unsigned short* s,
                                                    int ks) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<true>(b, s + lane % 16 * ks + lane / 16 * 8);
}

// Accumulators n0 and n0 + 1 (16 rows × 16 columns) as the A fragment of the next product.
static __device__ __forceinline__ void acc_to_a(unsigned a[4], const float (*acc)[4], int n0) {
    a[0] = pack_f32(acc[n0][0], acc[n0][1]);
    a[1] = pack_f32(acc[n0][2], acc[n0][3]);
    a[2] = pack_f32(acc[n0 + 1][0], acc[n0 + 1][1]);
    a[3] = pack_f32(acc[n0 + 1][2], acc[n0 + 1][3]);
}

// Accumulator element e of a 16-row product: its row (0–15), and its column in n-tile n.
static __device__ __forceinline__ int acc_row(int e) { return threadIdx.x % 32 / 4 + 8 * (e / 2); }
static __device__ __forceinline__ int acc_col(int n, int e) {
    return 8 * n + 2 * (threadIdx.x % 4) + e % 2;
}

// Value i of a head's row xr (d wide), turned by RoPE (c, s: the token's tables; null: not).
static __device__ __forceinline__ float rope_at(const float* xr, const float* c, const float* s,
                                                int i, int half) {
    if (c == nullptr) {
        return xr[i];
    }
    return i < half ? xr[i] * c[i] - xr[i + half] * s[i] : xr[i] * c[i] + xr[i - half] * s[i];
}

// Eight floats at p (16-byte aligned).
static __device__ __forceinline__ void load8(const float* p, float v[8]) {
#ifdef __CUDA_ARCH__
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
#else
    simt::require_aligned(p, 16, "attention_pack_bf16's load");
    std::memcpy(v, p, 32);
#endif
}

static __device__ __forceinline__ bool aligned16(const void* p) {
    return p == nullptr || reinterpret_cast<size_t>(p) % 16 == 0;
}

// x (B, T, heads·d) as bf16 heads of contiguous rows, out (B, heads, T, d); the first
// `rotated` heads turned by RoPE (cos, sin (B, T, d); null: none). Grid-stride: eight values
// a thread (16-byte loads and store) where d is a multiple of 8 and the buffers are 16-byte
// aligned, as for every head width the tensor-core kernels take; else two.
extern "C" __global__ void attention_pack_bf16(const float* x, const float* cos,
                                               const float* sin, unsigned short* out, int batch,
                                               int len, int heads, int rotated, int head_dim) {
    const int d = head_dim;
    const int half = d / 2;
    const bool octets = d % 8 == 0 && aligned16(x) && aligned16(cos) && aligned16(sin) &&
                        aligned16(out);
    const int width = octets ? 8 : 2;
    const size_t groups = size_t(batch) * len * heads * d / width;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t p = size_t(blockIdx.x) * blockDim.x + threadIdx.x; p < groups; p += stride) {
        const size_t e = width * p;
        const int j = int(e % d);
        const size_t row = e / d / heads;  // b·len + t
        const int head = int(e / d % heads);
        const float* xr = x + row * heads * d + size_t(head) * d;
        const bool turned = cos != nullptr && head < rotated;
        const float* c = turned ? cos + row * d : nullptr;
        const float* s = turned ? sin + row * d : nullptr;
        const size_t b = row / len;
        const size_t t = row % len;
        unsigned short* o = out + ((b * heads + head) * len + t) * d + j;
        if (!octets) {
            o[0] = bf16_bits(rope_at(xr, c, s, j, half));
            o[1] = bf16_bits(rope_at(xr, c, s, j + 1, half));
            continue;
        }
        // The eight values, their RoPE partners (the other half, the same eight lanes of it)
        // and the tables, each one 32-byte load.
        float v[8], partner[8], cv[8], sv[8];
        load8(xr + j, v);
        if (turned) {
            load8(xr + (j < half ? j + half : j - half), partner);
            load8(c + j, cv);
            load8(s + j, sv);
            for (int u = 0; u < 8; ++u) {
                v[u] = j < half ? v[u] * cv[u] - partner[u] * sv[u]
                                : v[u] * cv[u] + partner[u] * sv[u];
            }
        }
        unsigned short bits[8];
        for (int u = 0; u < 8; ++u) {
            bits[u] = bf16_bits(v[u]);
        }
#ifdef __CUDA_ARCH__
        *reinterpret_cast<uint4*>(o) =
            make_uint4(bits[0] | unsigned(bits[1]) << 16, bits[2] | unsigned(bits[3]) << 16,
                       bits[4] | unsigned(bits[5]) << 16, bits[6] | unsigned(bits[7]) << 16);
#else
        simt::require_aligned(o, 16, "attention_pack_bf16's store");
        std::memcpy(o, bits, 16);
#endif
    }
}

// Rows [r0, r0 + count) of head `head` of a packed (B, heads, T, D) tensor into `tile` (rows
// TcTiles<D>::ST apart), 16 bytes at a time by cp.async (the caller commits and waits); rows
// past the end are zeros, stored at once.
template <int D>
static __device__ void load_packed(unsigned short* tile, const unsigned short* packed, int b,
                                   int heads, int head, int r0, int count, int len) {
    constexpr int CHUNKS = D / 8;
    const unsigned short* from = packed + (size_t(b) * heads + head) * len * D;
    for (int e = threadIdx.x; e < count * CHUNKS; e += blockDim.x) {
        const int i = e / CHUNKS;
        const int c = e % CHUNKS * 8;
        unsigned short* to = tile + i * TcTiles<D>::ST + c;
        if (r0 + i < len) {
            copy16_async(to, from + size_t(r0 + i) * D + c);
        } else {
            zero16(to);
        }
    }
}

// The segment ids of rows [r0, r0 + count) into ids (0 past the end, and all 0 without
// segments: `sees` checks the ends itself).
static __device__ void load_segments(int* ids, const int* seg, int r0, int count, int len) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int r = r0 + i;
        ids[i] = r >= len || seg == nullptr ? 0 : seg[r];
    }
}

// The top of tile i's turn in a loop over `count` tiles through STAGES stages of shared
// memory, where fetch(j) issues and commits tile j's copies into stage j % STAGES (tile 0's
// before the loop). With two stages, tile i + 1's copies start here and land while tile i is
// used; with one, tile i's own. Returns with tile i landed for every thread.
template <int STAGES, class Fetch>
static __device__ __forceinline__ void next_tile(int i, int count, const Fetch& fetch) {
    __syncthreads();  // every warp is done with tile i - 1, whose stage is fetched into now
    if (STAGES > 1 && i + 1 < count) {
        fetch(i + 1);
        cp_async_wait<1>();
    } else {
        if (STAGES == 1 && i > 0) {
            fetch(i);
        }
        cp_async_wait<0>();
    }
    __syncthreads();  // tile i has landed, for every thread
}

// Key tile i of kv head `kv` in batch row b (its k, v and the keys' segment ids) into stage
// i % STAGES of the forward's and dq's stages, its copies committed as one group.
template <int D>
static __device__ void fetch_keys(unsigned short* k_stages, unsigned short* v_stages,
                                  int* kseg_stages, const AttnDims& n, const unsigned short* qkv,
                                  int b, int kv, const int* seg, int i) {
    constexpr int KT = TcTiles<D>::KT;
    constexpr int ST = TcTiles<D>::ST;
    const int at = i % TcTiles<D>::STAGES;
    const int all = n.heads + 2 * n.kv_heads;
    load_packed<D>(k_stages + at * KT * ST, qkv, b, all, n.heads + kv, i * KT, KT, n.len);
    load_packed<D>(v_stages + at * KT * ST, qkv, b, all, n.heads + n.kv_heads + kv, i * KT, KT,
                   n.len);
    load_segments(kseg_stages + at * KT, seg, i * KT, KT, n.len);
    cp_async_commit();
}

// Whether query r (segment sr) sees key c (segment sc), as `visible` above says.
static __device__ __forceinline__ bool sees(int causal, int len, int r, int sr, int c, int sc) {
    return r < len && c < len && sr == sc && !(causal && c > r);
}

// Whether queries [q0, q0 + nq) (segments qseg) see every key of [k0, k0 + nk) (segments
// kseg): all inside the sequence, every key at or before every query (causal), one segment
// for all. The lanes agree through shuffles, so a warp leaves the masks out of such a tile.
static __device__ bool all_visible(int causal, int len, int q0, int nq, const int* qseg, int k0,
                                   int nk, const int* kseg) {
    if (q0 + nq > len || k0 + nk > len || (causal && k0 + nk - 1 > q0)) {
        return false;  // the same for every lane
    }
    const int lane = threadIdx.x % 32;
    const int segment = qseg[0];
    int same = 1;
    for (int i = lane; i < nq; i += 32) {
        same &= qseg[i] == segment;
    }
    for (int i = lane; i < nk; i += 32) {
        same &= kseg[i] == segment;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        same &= __shfl_xor_sync(FULL, same, offset);
    }
    return same != 0;
}

// 2^x, as the GPU's special-function unit gives it (ex2.approx.ftz: 2^-inf = 0); the
// softmaxes below count in base 2, with log2(e) folded into the scores' scale.
static __device__ __forceinline__ float exp2_fast(float x) {
#ifdef __CUDA_ARCH__
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return std::exp2(x);
#endif
}

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// RoPE's transpose of a lane's gradient g[D / 8][4] (16 rows of one head) for element e of
// n-tile n at token `row`: dimension j + D/2 is n-tile n + D/16, in the same lane.
template <int D>
static __device__ __forceinline__ float unrotate_acc(const float (*g)[4], int n, int e,
                                                     const float* cos, const float* sin,
                                                     size_t row) {
    if (cos == nullptr) {
        return g[n][e];
    }
    constexpr int HALF_TILES = D / 16;
    const int j = acc_col(n, e);
    const float* c = cos + row * D;
    const float* s = sin + row * D;
    return n < HALF_TILES ? g[n][e] * c[j] + g[n + HALF_TILES][e] * s[j + D / 2]
                          : g[n][e] * c[j] - g[n - HALF_TILES][e] * s[j - D / 2];
}

// The forward for heads D wide: one item (batch row, head, tile of 16·warps query rows) at a
// time, grid-stride, from the packed qkv (B, h + 2k, T, D).
template <int D>
static __device__ void attention_fwd_tc(const AttnDims n, const unsigned short* qkv,
                                        const int* segments, float* y, float* lse, int causal) {
    if (n.d != D) {
        fill_nan(y, size_t(n.batch) * n.len * n.heads * n.d);
        fill_nan(lse, size_t(n.batch) * n.heads * n.len);
        return;
    }
    constexpr int KT = TcTiles<D>::KT;
    constexpr int ST = TcTiles<D>::ST;
    constexpr int KD = D / 16;  // k-steps over the head
    constexpr int ND = D / 8;   // n-tiles over the head
    constexpr int NK = KT / 8;  // n-tiles over a key tile
    constexpr int STAGES = TcTiles<D>::STAGES;
    __shared__ __align__(16) unsigned short q_s[TC_ROWS * ST];
    __shared__ __align__(16) unsigned short k_stages[STAGES * KT * ST];
    __shared__ __align__(16) unsigned short v_stages[STAGES * KT * ST];
    __shared__ int rseg_s[TC_ROWS];
    __shared__ int kseg_stages[STAGES * KT];
    const int all = n.heads + 2 * n.kv_heads;
    const int warp = threadIdx.x / 32;
    const int t = threadIdx.x % 4;
    const int rows = 16 * (blockDim.x / 32);
    const int tiles = (n.len + rows - 1) / rows;
    const float scale2 = LOG2E / sqrtf(float(D));  // scores in base 2
    const int heads = n.batch * n.heads;
    const long long items = (long long)heads * tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        // The last query tiles first: under the causal mask they see the most keys.
        const int head = int(item % heads % n.heads);
        const int b = int(item % heads / n.heads);
        const int kv = head / n.group();
        const int r0 = (tiles - 1 - int(item / heads)) * rows;
        const int w0 = r0 + 16 * warp;  // this warp's first row
        const int* seg = segments == nullptr ? nullptr : segments + size_t(b) * n.len;
        load_packed<D>(q_s, qkv, b, all, head, r0, rows, n.len);
        load_segments(rseg_s, seg, r0, rows, n.len);
        cp_async_commit();
        const int key_end = causal ? min(n.len, r0 + rows) : n.len;
        const int key_tiles = (key_end + KT - 1) / KT;
        const auto fetch = [&](int i) {
            fetch_keys<D>(k_stages, v_stages, kseg_stages, n, qkv, b, kv, seg, i);
        };
        fetch(0);
        cp_async_wait<1>();  // q has landed; the first key tile may still be in flight
        __syncthreads();
        unsigned qa[KD][4];
        #pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            load_a(qa[kk], q_s + 16 * warp * ST + 16 * kk, ST);
        }
        const int rseg[2] = {rseg_s[16 * warp + acc_row(0)], rseg_s[16 * warp + acc_row(2)]};
        float o[ND][4] = {};
        float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
        float l[2] = {0.0f, 0.0f};
        for (int i = 0; i < key_tiles; ++i) {
            next_tile<STAGES>(i, key_tiles, fetch);
            const int c0 = i * KT;
            const unsigned short* k_s = k_stages + i % STAGES * KT * ST;
            const unsigned short* v_s = v_stages + i % STAGES * KT * ST;
            const int* kseg_s = kseg_stages + i % STAGES * KT;
            if (causal && c0 > w0 + 15) {
                continue;  // none of the warp's rows sees this tile
            }
            float s[NK][4] = {};
            #pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                #pragma unroll
                for (int j = 0; j < NK; j += 2) {
                    unsigned kb[4];
                    load_b2_cols(kb, k_s + 8 * j * ST + 16 * kk, ST);
                    mma_bf16(s[j], qa[kk], kb);
                    mma_bf16(s[j + 1], qa[kk], kb + 2);
                }
            }
            // Scaled scores, masked unless the warp's rows see the whole tile.
            if (all_visible(causal, n.len, w0, 16, rseg_s + 16 * warp, c0, KT, kseg_s)) {
                #pragma unroll
                for (int j = 0; j < NK; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[j][e] *= scale2;
                    }
                }
            } else {
                #pragma unroll
                for (int j = 0; j < NK; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int c = acc_col(j, e);
                        const bool seen = sees(causal, n.len, w0 + acc_row(e), rseg[e / 2],
                                               c0 + c, kseg_s[c]);
                        s[j][e] = seen ? s[j][e] * scale2 : -CUDART_INF_F;
                    }
                }
            }
            // The online softmax of the warp's two rows per lane (h = 0: row group, 1: + 8).
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = -CUDART_INF_F;
                #pragma unroll
                for (int j = 0; j < NK; ++j) {
                    mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
                }
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
                const float m_new = fmaxf(m[h], mx);
                const bool none = m_new == -CUDART_INF_F;
                const float alpha = none ? 1.0f : exp2_fast(m[h] - m_new);
                float sum = 0.0f;
                #pragma unroll
                for (int j = 0; j < NK; ++j) {
                    #pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        s[j][e] = none ? 0.0f : exp2_fast(s[j][e] - m_new);
                        sum += s[j][e];
                    }
                }
                sum += __shfl_xor_sync(FULL, sum, 1);
                sum += __shfl_xor_sync(FULL, sum, 2);
                l[h] = l[h] * alpha + sum;
                m[h] = m_new;
                #pragma unroll
                for (int j = 0; j < ND; ++j) {
                    o[j][2 * h] *= alpha;
                    o[j][2 * h + 1] *= alpha;
                }
            }
            // o += p·v, the probabilities straight from the scores' registers.
            #pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                unsigned pa[4];
                acc_to_a(pa, s, 2 * kk);
                #pragma unroll
                for (int j = 0; j < ND; j += 2) {
                    unsigned vb[4];
                    load_b2_rows(vb, v_s + 16 * kk * ST + 8 * j, ST);
                    mma_bf16(o[j], pa, vb);
                    mma_bf16(o[j + 1], pa, vb + 2);
                }
            }
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = w0 + acc_row(2 * h);
            if (r >= n.len) {
                continue;
            }
            const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            float* yr = y + (size_t(b) * n.len + r) * n.heads * D + head * D;
            #pragma unroll
            for (int j = 0; j < ND; ++j) {
                yr[acc_col(j, 2 * h)] = o[j][2 * h] * inv;
                yr[acc_col(j, 2 * h + 1)] = o[j][2 * h + 1] * inv;
            }
            if (t == 0) {
                lse[(size_t(b) * n.heads + head) * n.len + r] =
                    l[h] > 0.0f ? (m[h] + log2f(l[h])) * LN2 : -CUDART_INF_F;
            }
        }
        __syncthreads();  // q_s is loaded again for the next item
    }
}

// dq for heads D wide: one item (batch row, head, tile of 16·warps query rows) at a time, from
// the packed qkv and dy (B, h, T, D). Per key tile: s = q·kᵀ and dp = dy·vᵀ on the tensor
// cores, p = exp(scale·s − lse) and ds = scale·p·(dp − delta) in registers, dq += ds·k.
template <int D>
static __device__ void attention_dq_tc(const AttnDims n, const unsigned short* qkv,
                                       const float* cos, const float* sin, const int* segments,
                                       const unsigned short* dy, const float* lse,
                                       const float* delta, unsigned short* dqkv, int causal) {
    if (n.d != D) {
        fill_nan(dqkv, size_t(n.batch) * n.len * n.width());
        return;
    }
    constexpr int KT = TcTiles<D>::KT;
    constexpr int ST = TcTiles<D>::ST;
    constexpr int KD = D / 16;
    constexpr int ND = D / 8;
    constexpr int NK = KT / 8;
    constexpr int STAGES = TcTiles<D>::STAGES;
    __shared__ __align__(16) unsigned short stage[TC_ROWS * ST];
    __shared__ __align__(16) unsigned short k_stages[STAGES * KT * ST];
    __shared__ __align__(16) unsigned short v_stages[STAGES * KT * ST];
    __shared__ int rseg_s[TC_ROWS];
    __shared__ int kseg_stages[STAGES * KT];
    const int all = n.heads + 2 * n.kv_heads;
    const int warp = threadIdx.x / 32;
    const int rows = 16 * (blockDim.x / 32);
    const int tiles = (n.len + rows - 1) / rows;
    const float scale = 1.0f / sqrtf(float(D));
    const float scale2 = scale * LOG2E;  // scores in base 2
    const int heads = n.batch * n.heads;
    const long long items = (long long)heads * tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        // The last query tiles first: under the causal mask they see the most keys.
        const int head = int(item % heads % n.heads);
        const int b = int(item % heads / n.heads);
        const int kv = head / n.group();
        const int r0 = (tiles - 1 - int(item / heads)) * rows;
        const int w0 = r0 + 16 * warp;
        const int* seg = segments == nullptr ? nullptr : segments + size_t(b) * n.len;
        // q, then dy, through the one staging tile into registers.
        unsigned qa[KD][4];
        unsigned da[KD][4];
        load_packed<D>(stage, qkv, b, all, head, r0, rows, n.len);
        load_segments(rseg_s, seg, r0, rows, n.len);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            load_a(qa[kk], stage + 16 * warp * ST + 16 * kk, ST);
        }
        __syncthreads();
        load_packed<D>(stage, dy, b, n.heads, head, r0, rows, n.len);
        cp_async_commit();
        const int key_end = causal ? min(n.len, r0 + rows) : n.len;
        const int key_tiles = (key_end + KT - 1) / KT;
        const auto fetch = [&](int i) {
            fetch_keys<D>(k_stages, v_stages, kseg_stages, n, qkv, b, kv, seg, i);
        };
        fetch(0);
        cp_async_wait<1>();  // dy has landed; the first key tile may still be in flight
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            load_a(da[kk], stage + 16 * warp * ST + 16 * kk, ST);
        }
        const int rseg[2] = {rseg_s[16 * warp + acc_row(0)], rseg_s[16 * warp + acc_row(2)]};
        float row_lse2[2];  // in base 2
        float row_delta[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = w0 + acc_row(2 * h);
            const size_t at = (size_t(b) * n.heads + head) * n.len + r;
            row_lse2[h] = r < n.len ? lse[at] * LOG2E : 0.0f;
            row_delta[h] = r < n.len ? delta[at] : 0.0f;
        }
        float dq[ND][4] = {};
        for (int i = 0; i < key_tiles; ++i) {
            next_tile<STAGES>(i, key_tiles, fetch);
            const int c0 = i * KT;
            const unsigned short* k_s = k_stages + i % STAGES * KT * ST;
            const unsigned short* v_s = v_stages + i % STAGES * KT * ST;
            const int* kseg_s = kseg_stages + i % STAGES * KT;
            if (causal && c0 > w0 + 15) {
                continue;
            }
            float s[NK][4] = {};
            float dp[NK][4] = {};
            #pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                #pragma unroll
                for (int j = 0; j < NK; j += 2) {
                    unsigned kb[4];
                    load_b2_cols(kb, k_s + 8 * j * ST + 16 * kk, ST);
                    mma_bf16(s[j], qa[kk], kb);
                    mma_bf16(s[j + 1], qa[kk], kb + 2);
                    unsigned vb[4];
                    load_b2_cols(vb, v_s + 8 * j * ST + 16 * kk, ST);
                    mma_bf16(dp[j], da[kk], vb);
                    mma_bf16(dp[j + 1], da[kk], vb + 2);
                }
            }
            // ds = scale·p·(dp − delta), masked unless the warp's rows see the whole tile.
            const bool open =
                all_visible(causal, n.len, w0, 16, rseg_s + 16 * warp, c0, KT, kseg_s);
            #pragma unroll
            for (int j = 0; j < NK; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = acc_col(j, e);
                    const bool seen = open || sees(causal, n.len, w0 + acc_row(e), rseg[e / 2],
                                                   c0 + c, kseg_s[c]);
                    const float p = exp2_fast(s[j][e] * scale2 - row_lse2[e / 2]);
                    s[j][e] = seen ? scale * p * (dp[j][e] - row_delta[e / 2]) : 0.0f;
                }
            }
            #pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                unsigned dsa[4];
                acc_to_a(dsa, s, 2 * kk);
                #pragma unroll
                for (int j = 0; j < ND; j += 2) {
                    unsigned kb[4];
                    load_b2_rows(kb, k_s + 16 * kk * ST + 8 * j, ST);
                    mma_bf16(dq[j], dsa, kb);
                    mma_bf16(dq[j + 1], dsa, kb + 2);
                }
            }
        }
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = w0 + acc_row(e);
            if (r >= n.len) {
                continue;
            }
            const size_t row = size_t(b) * n.len + r;
            #pragma unroll
            for (int j = 0; j < ND; ++j) {
                dqkv[row * n.width() + head * D + acc_col(j, e)] =
                    bf16_bits(unrotate_acc<D>(dq, j, e, cos, sin, row));
            }
        }
        __syncthreads();  // the staging tile is loaded again for the next item
    }
}

// dk and dv for heads D wide: one item (batch row, kv head, tile of 16·warps keys) at a time,
// summing over the group's query heads and their query tiles in order. Per query tile:
// sᵀ = k·qᵀ and dpᵀ = v·dyᵀ on the tensor cores, pᵀ and dsᵀ in registers, dv += pᵀ·dy and
// dk += dsᵀ·q.
template <int D>
static __device__ void attention_dkv_tc(const AttnDims n, const unsigned short* qkv,
                                        const float* cos, const float* sin, const int* segments,
                                        const unsigned short* dy, const float* lse,
                                        const float* delta, unsigned short* dqkv, int causal) {
    if (n.d != D) {
        fill_nan(dqkv, size_t(n.batch) * n.len * n.width());
        return;
    }
    constexpr int QR = TcTiles<D>::QR;
    constexpr int ST = TcTiles<D>::ST;
    constexpr int KD = D / 16;
    constexpr int ND = D / 8;
    constexpr int NQ = QR / 8;
    // v's fragments stay in registers, except for the widest heads, which would spill: there
    // they are read from v's own tile at each use.
    constexpr bool V_SHARED = D > 64;
    constexpr int STAGES = TcTiles<D>::STAGES;
    __shared__ __align__(16) unsigned short stage[TC_ROWS * ST];
    __shared__ __align__(16) unsigned short v_s[V_SHARED ? TC_ROWS * ST : 8];
    __shared__ __align__(16) unsigned short q_stages[STAGES * QR * ST];
    __shared__ __align__(16) unsigned short dy_stages[STAGES * QR * ST];
    __shared__ float lse_stages[STAGES * QR];
    __shared__ float delta_stages[STAGES * QR];
    __shared__ int kseg_s[TC_ROWS];
    __shared__ int qseg_stages[STAGES * QR];
    const int all = n.heads + 2 * n.kv_heads;
    const int warp = threadIdx.x / 32;
    const int keys = 16 * (blockDim.x / 32);
    const int tiles = (n.len + keys - 1) / keys;
    const float scale = 1.0f / sqrtf(float(D));
    const float scale2 = scale * LOG2E;  // scores in base 2
    const int heads = n.batch * n.kv_heads;
    const long long items = (long long)heads * tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        // The first key tiles first: under the causal mask the most query rows see them.
        const int kv = int(item % heads % n.kv_heads);
        const int b = int(item % heads / n.kv_heads);
        const int c0 = int(item / heads) * keys;
        const int w0 = c0 + 16 * warp;  // this warp's first key
        const int* seg = segments == nullptr ? nullptr : segments + size_t(b) * n.len;
        unsigned ka[KD][4];
        unsigned va[V_SHARED ? 1 : KD][4];
        load_packed<D>(stage, qkv, b, all, n.heads + kv, c0, keys, n.len);
        load_segments(kseg_s, seg, c0, keys, n.len);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            load_a(ka[kk], stage + 16 * warp * ST + 16 * kk, ST);
        }
        __syncthreads();
        unsigned short* v_tile = V_SHARED ? v_s : stage;
        load_packed<D>(v_tile, qkv, b, all, n.heads + n.kv_heads + kv, c0, keys, n.len);
        cp_async_commit();
        // The query tiles of the group's heads in order, each head's from the first that can
        // see the tile's keys (causal: no query row before its first key does).
        const int first_row = causal ? c0 / QR * QR : 0;
        const int per_head = (n.len - first_row + QR - 1) / QR;
        const int query_tiles = n.group() * per_head;
        // Query tile i's q, dy, segment ids, lse and delta into stage i % STAGES.
        const auto fetch = [&](int i) {
            const int at = i % STAGES;
            const int head = kv * n.group() + i / per_head;
            const int r0 = first_row + i % per_head * QR;
            load_packed<D>(q_stages + at * QR * ST, qkv, b, all, head, r0, QR, n.len);
            load_packed<D>(dy_stages + at * QR * ST, dy, b, n.heads, head, r0, QR, n.len);
            load_segments(qseg_stages + at * QR, seg, r0, QR, n.len);
            for (int j = threadIdx.x; j < QR; j += blockDim.x) {
                const int r = r0 + j;
                const size_t row = (size_t(b) * n.heads + head) * n.len + r;
                lse_stages[at * QR + j] = r < n.len ? lse[row] * LOG2E : 0.0f;  // in base 2
                delta_stages[at * QR + j] = r < n.len ? delta[row] : 0.0f;
            }
            cp_async_commit();
        };
        fetch(0);
        cp_async_wait<1>();  // v has landed; the first query tile may still be in flight
        __syncthreads();
        if constexpr (!V_SHARED) {
            #pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                load_a(va[kk], stage + 16 * warp * ST + 16 * kk, ST);
            }
        }
        const int kseg[2] = {kseg_s[16 * warp + acc_row(0)], kseg_s[16 * warp + acc_row(2)]};
        float dk[ND][4] = {};
        float dv[ND][4] = {};
        for (int t = 0; t < query_tiles; ++t) {
            next_tile<STAGES>(t, query_tiles, fetch);
            const int r0 = first_row + t % per_head * QR;
            const int at = t % STAGES;
            const unsigned short* q_s = q_stages + at * QR * ST;
            const unsigned short* dy_s = dy_stages + at * QR * ST;
            const float* lse_s = lse_stages + at * QR;
            const float* delta_s = delta_stages + at * QR;
            const int* qseg_s = qseg_stages + at * QR;
            if (causal && r0 + QR - 1 < w0) {
                continue;  // every query row of the tile comes before the warp's keys
            }
            // One product after the other, each fragment live only for its own.
            float s[NQ][4] = {};
            float dp[NQ][4] = {};
            #pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                #pragma unroll
                for (int j = 0; j < NQ; j += 2) {
                    unsigned qb[4];
                    load_b2_cols(qb, q_s + 8 * j * ST + 16 * kk, ST);
                    mma_bf16(s[j], ka[kk], qb);
                    mma_bf16(s[j + 1], ka[kk], qb + 2);
                }
            }
            #pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                unsigned* v = va[V_SHARED ? 0 : kk];
                if constexpr (V_SHARED) {
                    load_a(v, v_s + 16 * warp * ST + 16 * kk, ST);
                }
                #pragma unroll
                for (int j = 0; j < NQ; j += 2) {
                    unsigned db[4];
                    load_b2_cols(db, dy_s + 8 * j * ST + 16 * kk, ST);
                    mma_bf16(dp[j], v, db);
                    mma_bf16(dp[j + 1], v, db + 2);
                }
            }
            // pᵀ and dsᵀ, masked unless every query row of the tile sees the warp's keys.
            const bool open = all_visible(causal, n.len, r0, QR, qseg_s, w0, 16,
                                          kseg_s + 16 * warp);
            #pragma unroll
            for (int j = 0; j < NQ; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = acc_col(j, e);  // the query row within the tile
                    float p = 0.0f;
                    float ds = 0.0f;
                    if (open ||
                        sees(causal, n.len, r0 + i, qseg_s[i], w0 + acc_row(e), kseg[e / 2])) {
                        p = exp2_fast(s[j][e] * scale2 - lse_s[i]);
                        ds = scale * p * (dp[j][e] - delta_s[i]);
                    }
                    s[j][e] = p;
                    dp[j][e] = ds;
                }
            }
            #pragma unroll
            for (int kk = 0; kk < QR / 16; ++kk) {
                unsigned pa[4];
                acc_to_a(pa, s, 2 * kk);
                #pragma unroll
                for (int j = 0; j < ND; j += 2) {
                    unsigned db[4];
                    load_b2_rows(db, dy_s + 16 * kk * ST + 8 * j, ST);
                    mma_bf16(dv[j], pa, db);
                    mma_bf16(dv[j + 1], pa, db + 2);
                }
            }
            #pragma unroll
            for (int kk = 0; kk < QR / 16; ++kk) {
                unsigned dsa[4];
                acc_to_a(dsa, dp, 2 * kk);
                #pragma unroll
                for (int j = 0; j < ND; j += 2) {
                    unsigned qb[4];
                    load_b2_rows(qb, q_s + 16 * kk * ST + 8 * j, ST);
                    mma_bf16(dk[j], dsa, qb);
                    mma_bf16(dk[j + 1], dsa, qb + 2);
                }
            }
        }
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = w0 + acc_row(e);
            if (c >= n.len) {
                continue;
            }
            const size_t row = size_t(b) * n.len + c;
            #pragma unroll
            for (int j = 0; j < ND; ++j) {
                dqkv[row * n.width() + n.value_col(kv) + acc_col(j, e)] = bf16_bits(dv[j][e]);
                dqkv[row * n.width() + n.key_col(kv) + acc_col(j, e)] =
                    bf16_bits(unrotate_acc<D>(dk, j, e, cos, sin, row));
            }
        }
        __syncthreads();  // the staging tile is loaded again for the next item
    }
}

// The kernels, one for each head width (registers and shared memory are a kernel's, sized for
// its own width). `qkv` and `dy` are attention_pack_bf16's; dqkv is written in bf16 (the bytes
// a cast would make of the f32 gradient), for the qkv projection's backward products to read
// uncast; a launch with another head_dim gets NaN outputs.

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_fwd_bf16_d16(const unsigned short* qkv, const int* segments, float* y,
                           float* lse, int batch, int len, int heads, int kv_heads, int d,
                           int causal) {
    attention_fwd_tc<16>({batch, len, heads, kv_heads, d}, qkv, segments, y, lse, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dq_bf16_d16(const unsigned short* qkv, const float* cos, const float* sin,
                              const int* segments, const unsigned short* dy, const float* lse,
                              const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                              int kv_heads, int d, int causal) {
    attention_dq_tc<16>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                         delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dkv_bf16_d16(const unsigned short* qkv, const float* cos, const float* sin,
                               const int* segments, const unsigned short* dy, const float* lse,
                               const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                               int kv_heads, int d, int causal) {
    attention_dkv_tc<16>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                          delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_fwd_bf16_d32(const unsigned short* qkv, const int* segments, float* y,
                           float* lse, int batch, int len, int heads, int kv_heads, int d,
                           int causal) {
    attention_fwd_tc<32>({batch, len, heads, kv_heads, d}, qkv, segments, y, lse, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dq_bf16_d32(const unsigned short* qkv, const float* cos, const float* sin,
                              const int* segments, const unsigned short* dy, const float* lse,
                              const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                              int kv_heads, int d, int causal) {
    attention_dq_tc<32>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                         delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dkv_bf16_d32(const unsigned short* qkv, const float* cos, const float* sin,
                               const int* segments, const unsigned short* dy, const float* lse,
                               const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                               int kv_heads, int d, int causal) {
    attention_dkv_tc<32>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                          delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_fwd_bf16_d64(const unsigned short* qkv, const int* segments, float* y,
                           float* lse, int batch, int len, int heads, int kv_heads, int d,
                           int causal) {
    attention_fwd_tc<64>({batch, len, heads, kv_heads, d}, qkv, segments, y, lse, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dq_bf16_d64(const unsigned short* qkv, const float* cos, const float* sin,
                              const int* segments, const unsigned short* dy, const float* lse,
                              const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                              int kv_heads, int d, int causal) {
    attention_dq_tc<64>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                         delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dkv_bf16_d64(const unsigned short* qkv, const float* cos, const float* sin,
                               const int* segments, const unsigned short* dy, const float* lse,
                               const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                               int kv_heads, int d, int causal) {
    attention_dkv_tc<64>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                          delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_fwd_bf16_d128(const unsigned short* qkv, const int* segments, float* y,
                           float* lse, int batch, int len, int heads, int kv_heads, int d,
                           int causal) {
    attention_fwd_tc<128>({batch, len, heads, kv_heads, d}, qkv, segments, y, lse, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dq_bf16_d128(const unsigned short* qkv, const float* cos, const float* sin,
                              const int* segments, const unsigned short* dy, const float* lse,
                              const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                              int kv_heads, int d, int causal) {
    attention_dq_tc<128>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                         delta, dqkv, causal);
}

extern "C" __global__ void __launch_bounds__(ATTN_MAX_THREADS)
    attention_bwd_dkv_bf16_d128(const unsigned short* qkv, const float* cos, const float* sin,
                               const int* segments, const unsigned short* dy, const float* lse,
                               const float* delta, unsigned short* dqkv, int batch, int len, int heads,
                               int kv_heads, int d, int causal) {
    attention_dkv_tc<128>({batch, len, heads, kv_heads, d}, qkv, cos, sin, segments, dy, lse,
                          delta, dqkv, causal);
}
