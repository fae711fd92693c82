// Mamba-2's chunked SSD scan on the GPU (the forward of step 4 without the D·x skip; the CPU
// version is ssd_chunked in ops/model/src/mamba2.rs, and ssd.rs holds the recurrence it is
// tested against). Per row b and head h, with Δ = dt, A = a[h] < 0, and B, C read from group
// g = h / (H/G):
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
