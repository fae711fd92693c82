// Mamba-2's chunked SSD scan on the GPU: step 4 without the D·x skip, forward and (at the end
// of the file) backward. The CPU version is ssd_chunked in ops/model/src/mamba2.rs; ssd.rs
// holds the recurrence it is tested against. Per row b and head h, with Δ = dt, A = a[h] < 0,
// and B, C read from group g = h / (H/G):
//   S_t = keep_t · exp(Δ_t A) · S_{t−1} + Δ_t x_t ⊗ B_t,   y_t = S_t · C_t,
// keep_t = 0 where token t starts a run (starts[b·T + t] == t), else 1.
//
// The chunked form, in four launches (the stages of the reference Triton kernels): time is cut
// into chunks of `chunk` tokens, cs_t = Σ_{first ≤ u ≤ t} Δ_u A inside a chunk, and
//   1. ssd_chunk_cumsum_f32:   cs, one thread a (row, head, chunk);
//   2. ssd_chunk_state_f32:    the state a chunk leaves from its own tokens,
//                              Σ_s exp(cs_last − cs_s) Δ_s x_s ⊗ B_s over s in the last
//                              token's run; one block a (row, head, chunk), one thread a (p, n);
//   3. ssd_state_passing_f32:  the state entering each chunk, chunk by chunk:
//                              S_in(next) = exp(cs_last) · S_in + own when the last token's
//                              run crosses into the chunk, else own; one block a (row, head);
//   4. ssd_chunk_scan_f32:     y_t = Σ_{s ≤ t in t's run} (C_t·B_s) exp(cs_t − cs_s) Δ_s x_s
//                              + exp(cs_t) C_t·S_in when t's run began before the chunk;
//                              one block a (row, head, chunk), one thread a (t, p).
// Every sum runs in a fixed order and no thread writes what another reads in the same launch,
// so the bytes never depend on timing. exp is only taken of differences cs_t − cs_s with s ≤ t
// (≤ 0: Δ > 0 and A < 0), never of the masked half, so large steps cannot make inf · 0.
//
// Correctness first: no shared-memory tiles and no tensor cores (the reference kernels do
// stages 2 and 4 as GEMMs); each of the P threads of token t recomputes C_t·B_s. These are
// the kernels the faster ones will be held to.
//
// Layouts: x, y [B, T, H, P]; dt [B, T, H]; a [H]; b, c [B, T, G, N]; starts [B, T] (int);
// cs [B, H, chunks, chunk]; own and entering [B, H, chunks, P, N]. Any grid and block work.

#include <cuda_bf16.h>

struct SsdDims {
    int batch, len, heads, p, groups, n, chunk;

    __device__ int chunks() const { return (len + chunk - 1) / chunk; }
    // The first and one past the last token of chunk `ch`.
    __device__ int first(int ch) const { return ch * chunk; }
    __device__ int end(int ch) const { return min(len, (ch + 1) * chunk); }
    __device__ size_t x_at(int b, int t, int h) const {
        return ((size_t(b) * len + t) * heads + h) * p;
    }
    __device__ size_t dt_at(int b, int t, int h) const { return (size_t(b) * len + t) * heads + h; }
    // B and C of token t for head h: its group's N values.
    __device__ size_t bc_at(int b, int t, int h) const {
        return ((size_t(b) * len + t) * groups + h / (heads / groups)) * n;
    }
};

static __device__ __forceinline__ SsdDims ssd_dims(int batch, int len, int heads, int p,
                                                   int groups, int n, int chunk) {
    SsdDims d;
    d.batch = batch;
    d.len = len;
    d.heads = heads;
    d.p = p;
    d.groups = groups;
    d.n = n;
    d.chunk = chunk;
    return d;
}

extern "C" __global__ void ssd_chunk_cumsum_f32(const float* dt, const float* a, float* cs,
                                                int batch, int len, int heads, int chunk) {
    const SsdDims d = ssd_dims(batch, len, heads, 1, 1, 1, chunk);
    const int items = batch * heads * d.chunks();
    const int stride = gridDim.x * blockDim.x;
    for (int item = blockIdx.x * blockDim.x + threadIdx.x; item < items; item += stride) {
        const int ch = item % d.chunks();
        const int h = (item / d.chunks()) % heads;
        const int b = item / (d.chunks() * heads);
        float sum = 0.0f;
        for (int t = d.first(ch); t < d.end(ch); ++t) {
            sum += dt[d.dt_at(b, t, h)] * a[h];
            cs[size_t(item) * chunk + (t - d.first(ch))] = sum;
        }
    }
}

extern "C" __global__ void ssd_chunk_state_f32(const float* x, const float* dt, const float* bm,
                                               const float* cs, const int* starts, float* own,
                                               int batch, int len, int heads, int p, int groups,
                                               int n, int chunk) {
    const SsdDims d = ssd_dims(batch, len, heads, p, groups, n, chunk);
    const int items = batch * heads * d.chunks();
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int ch = item % d.chunks();
        const int h = (item / d.chunks()) % heads;
        const int b = item / (d.chunks() * heads);
        const int first = d.first(ch);
        const int last = d.end(ch) - 1;
        const int last_start = starts[size_t(b) * len + last];
        const float* cs_chunk = cs + size_t(item) * chunk;
        const float cs_last = cs_chunk[last - first];
        for (int e = threadIdx.x; e < p * n; e += blockDim.x) {
            const int i = e / n;
            const int k = e % n;
            float sum = 0.0f;
            for (int s = max(first, last_start); s <= last; ++s) {
                const float dtx = dt[d.dt_at(b, s, h)] * x[d.x_at(b, s, h) + i];
                sum += expf(cs_last - cs_chunk[s - first]) * dtx * bm[d.bc_at(b, s, h) + k];
            }
            own[size_t(item) * p * n + e] = sum;
        }
    }
}

extern "C" __global__ void ssd_state_passing_f32(const float* cs, const int* starts,
                                                 const float* own, float* entering, int batch,
                                                 int len, int heads, int p, int n, int chunk) {
    const SsdDims d = ssd_dims(batch, len, heads, p, 1, n, chunk);
    const int chunks = d.chunks();
    for (int item = blockIdx.x; item < batch * heads; item += gridDim.x) {
        const int b = item / heads;
        for (int e = threadIdx.x; e < p * n; e += blockDim.x) {
            float state = 0.0f;
            for (int ch = 0; ch < chunks; ++ch) {
                const size_t at = (size_t(item) * chunks + ch) * p * n + e;
                entering[at] = state;
                const int last = d.end(ch) - 1;
                const bool crosses = starts[size_t(b) * len + last] < d.first(ch);
                const float cs_last = cs[(size_t(item) * chunks + ch) * chunk + last - d.first(ch)];
                state = crosses ? expf(cs_last) * state + own[at] : own[at];
            }
        }
    }
}

extern "C" __global__ void ssd_chunk_scan_f32(const float* x, const float* dt, const float* bm,
                                              const float* cm, const float* cs, const int* starts,
                                              const float* entering, float* y, int batch, int len,
                                              int heads, int p, int groups, int n, int chunk) {
    const SsdDims d = ssd_dims(batch, len, heads, p, groups, n, chunk);
    const int items = batch * heads * d.chunks();
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int ch = item % d.chunks();
        const int h = (item / d.chunks()) % heads;
        const int b = item / (d.chunks() * heads);
        const int first = d.first(ch);
        const float* cs_chunk = cs + size_t(item) * chunk;
        const float* state = entering + size_t(item) * p * n;
        for (int e = threadIdx.x; e < (d.end(ch) - first) * p; e += blockDim.x) {
            const int t = first + e / p;
            const int i = e % p;
            const int start = starts[size_t(b) * len + t];
            const float* c_t = cm + d.bc_at(b, t, h);
            float sum = 0.0f;
            for (int s = max(first, start); s <= t; ++s) {
                const float* b_s = bm + d.bc_at(b, s, h);
                float cb = 0.0f;
                for (int k = 0; k < n; ++k) {
                    cb += c_t[k] * b_s[k];
                }
                const float dtx = dt[d.dt_at(b, s, h)] * x[d.x_at(b, s, h) + i];
                sum += cb * expf(cs_chunk[t - first] - cs_chunk[s - first]) * dtx;
            }
            if (start < first) {
                float cs_in = 0.0f;
                for (int k = 0; k < n; ++k) {
                    cs_in += c_t[k] * state[size_t(i) * n + k];
                }
                sum += expf(cs_chunk[t - first]) * cs_in;
            }
            y[d.x_at(b, t, h) + i] = sum;
        }
    }
}

// The backward, by the recurrence run in reverse, one block a (row, head); the forward's
// entering states are its checkpoints, so each chunk's states are recomputed from them, never
// stored for every token. With dS_t the gradient of the state after token t and
// γ_t = keep_t · exp(Δ_t A):
//   dS_t = dy_t ⊗ C_t + γ_{t+1} dS_{t+1}
//   dx_t = Δ_t dS_t·B_t       dB_t = Δ_t dS_tᵀ·x_t       dC_t = S_tᵀ·dy_t
//   dγ_t = Σ dS_t ⊙ S_{t−1}   dΔ_t = Σ dS_t ⊙ (x_t ⊗ B_t) + dγ_t γ_t A   dA += dγ_t γ_t Δ_t
// dB and dC are written per head (db_h, dc_h [B, T, H, N]) and dA per row (da_row [B, H]);
// ssd_bwd_reduce_f32 sums them over a group's heads and over rows, in order. Each token's sums
// over p, n or both are products written to `scratch` and added, after a barrier, by one
// thread each, in index order. scratch holds, per (row, head), (chunk + 5) · P · N floats.
// Correctness first, like the forward: sequential in time inside a block.
extern "C" __global__ void ssd_bwd_f32(const float* x, const float* dt, const float* a,
                                       const float* bm, const float* cm, const int* starts,
                                       const float* entering, const float* dy, float* scratch,
                                       float* dx, float* ddt, float* db_h, float* dc_h,
                                       float* da_row, int batch, int len, int heads, int p,
                                       int groups, int n, int chunk) {
    const SsdDims d = ssd_dims(batch, len, heads, p, groups, n, chunk);
    const int chunks = d.chunks();
    const int pn = p * n;
    for (int item = blockIdx.x; item < batch * heads; item += gridDim.x) {
        const int b = item / heads;
        const int h = item % heads;
        const float a_h = a[h];
        // states[0] = S before the chunk, states[1 + u] = S after its token u.
        float* states = scratch + size_t(item) * (chunk + 5) * pn;
        float* ds = states + size_t(chunk + 1) * pn;
        float* q_dx = ds + pn;  // dS ⊙ B, summed over n
        float* q_db = q_dx + pn;  // dS ⊙ x, summed over p
        float* q_dc = q_db + pn;  // S ⊙ dy, summed over p
        for (int e = threadIdx.x; e < pn; e += blockDim.x) {
            ds[e] = 0.0f;
        }
        float gamma_next = 0.0f;  // γ_{t+1}; nothing follows the last token
        float da = 0.0f;          // thread 0's running dA
        for (int ch = chunks - 1; ch >= 0; --ch) {
            const int first = d.first(ch);
            for (int e = threadIdx.x; e < pn; e += blockDim.x) {
                float s = entering[(size_t(item) * chunks + ch) * pn + e];
                states[e] = s;
                for (int t = first; t < d.end(ch); ++t) {
                    const float delta = dt[d.dt_at(b, t, h)];
                    const float gamma =
                        starts[size_t(b) * len + t] < t ? expf(delta * a_h) : 0.0f;
                    s = gamma * s + delta * x[d.x_at(b, t, h) + e / n] * bm[d.bc_at(b, t, h) + e % n];
                    states[size_t(t - first + 1) * pn + e] = s;
                }
            }
            for (int t = d.end(ch) - 1; t >= first; --t) {
                const float delta = dt[d.dt_at(b, t, h)];
                const float gamma = starts[size_t(b) * len + t] < t ? expf(delta * a_h) : 0.0f;
                const float* s_t = states + size_t(t - first + 1) * pn;
                const float* s_prev = states + size_t(t - first) * pn;
                const float* x_t = x + d.x_at(b, t, h);
                const float* dy_t = dy + d.x_at(b, t, h);
                const float* b_t = bm + d.bc_at(b, t, h);
                const float* c_t = cm + d.bc_at(b, t, h);
                for (int e = threadIdx.x; e < pn; e += blockDim.x) {
                    const int i = e / n;
                    const int k = e % n;
                    ds[e] = gamma_next * ds[e] + dy_t[i] * c_t[k];
                    q_dx[e] = ds[e] * b_t[k];
                    q_db[e] = ds[e] * x_t[i];
                    q_dc[e] = s_t[e] * dy_t[i];
                }
                __syncthreads();
                for (int j = threadIdx.x; j < p + n + 1; j += blockDim.x) {
                    if (j < p) {
                        float sum = 0.0f;
                        for (int k = 0; k < n; ++k) {
                            sum += q_dx[j * n + k];
                        }
                        dx[d.x_at(b, t, h) + j] = delta * sum;
                    } else if (j < p + n) {
                        const int k = j - p;
                        float sum_b = 0.0f;
                        float sum_c = 0.0f;
                        for (int i = 0; i < p; ++i) {
                            sum_b += q_db[i * n + k];
                            sum_c += q_dc[i * n + k];
                        }
                        const size_t at = d.dt_at(b, t, h) * n + k;  // [B, T, H, N]
                        db_h[at] = delta * sum_b;
                        dc_h[at] = sum_c;
                    } else {
                        float sum_xb = 0.0f;
                        float sum_gamma = 0.0f;
                        for (int e = 0; e < pn; ++e) {
                            sum_xb += q_db[e] * b_t[e % n];
                            sum_gamma += ds[e] * s_prev[e];
                        }
                        ddt[d.dt_at(b, t, h)] = sum_xb + sum_gamma * gamma * a_h;
                        da += sum_gamma * gamma * delta;
                    }
                }
                __syncthreads();  // the products are written again for the next token
                gamma_next = gamma;
            }
        }
        // The thread that summed the scalars holds dA (j = p + n, thread (p + n) % blockDim.x).
        if (threadIdx.x == (p + n) % blockDim.x) {
            da_row[item] = da;
        }
    }
}

// db[b, t, g, :] = Σ_{h in g} db_h[b, t, h, :] and dc likewise, heads in order; da[h] =
// Σ_b da_row[b, h], rows in order. Grid-stride over B·T·G·N, then H.
extern "C" __global__ void ssd_bwd_reduce_f32(const float* db_h, const float* dc_h,
                                              const float* da_row, float* db, float* dc,
                                              float* da, int batch, int len, int heads,
                                              int groups, int n) {
    const size_t total = size_t(batch) * len * groups * n;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    const int per_group = heads / groups;
    for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
        const int k = int(e % n);
        const int g = int((e / n) % groups);
        const size_t token = e / (size_t(n) * groups);
        float sum_b = 0.0f;
        float sum_c = 0.0f;
        for (int h = g * per_group; h < (g + 1) * per_group; ++h) {
            sum_b += db_h[(token * heads + h) * n + k];
            sum_c += dc_h[(token * heads + h) * n + k];
        }
        db[e] = sum_b;
        dc[e] = sum_c;
    }
    for (size_t h = size_t(blockIdx.x) * blockDim.x + threadIdx.x; h < size_t(heads); h += stride) {
        float sum = 0.0f;
        for (int b = 0; b < batch; ++b) {
            sum += da_row[size_t(b) * heads + h];
        }
        da[h] = sum;
    }
}
