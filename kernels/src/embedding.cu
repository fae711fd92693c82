// Embedding lookup on the GPU: the kernels of embedding.rs. The table is (V, D), ids N u32.
//
// Forward: out[t] = table[ids[t]], one block a token (tokens beyond the grid loop), threads
// across the row. An id outside the vocabulary gives a NaN row, never an out-of-bounds read.
//
// Backward: dtable[v] = Σ_{t : ids[t] = v} dout[t], deterministic without sorting or atomics:
// block b owns the vocabulary rows [b·R, (b+1)·R) with R = ceil(V / gridDim.x), and thread k
// owns the columns k, k + blockDim.x, …: every thread scans the ids in token order and adds
// the rows that fall in its block's range, so each dtable value has one writer and its sum
// runs in token order, whatever the grid. No barrier: no thread reads what another wrote.

#include <cuda_bf16.h>
#include <math_constants.h>

extern "C" __global__ void embedding_fwd_f32(const float* table, const unsigned* ids, float* out,
                                             int tokens, int vocab, int dim) {
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const unsigned id = ids[t];
        float* row = out + size_t(t) * dim;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            row[j] = id < unsigned(vocab) ? table[size_t(id) * dim + j] : CUDART_NAN_F;
        }
    }
}

extern "C" __global__ void embedding_bwd_f32(const float* dout, const unsigned* ids,
                                             float* dtable, int tokens, int vocab, int dim) {
    const unsigned per_block = (unsigned(vocab) + gridDim.x - 1) / gridDim.x;
    const unsigned first = blockIdx.x * per_block;
    const unsigned end = min(unsigned(vocab), first + per_block);
    for (unsigned v = first; v < end; ++v) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            dtable[size_t(v) * dim + j] = 0.0f;
        }
    }
    for (int t = 0; t < tokens; ++t) {
        const unsigned id = ids[t];
        if (id < first || id >= end) {
            continue;
        }
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            dtable[size_t(id) * dim + j] += dout[size_t(t) * dim + j];
        }
    }
}
