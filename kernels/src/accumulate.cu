// Element by element, grid-stride (ACC_ILP elements a thread an iteration): acc += x, how the GPU trainer sums
// gradients over micro-batches and over the two paths into a residual stream, in the order it
// issues them (no atomics: the same launches give the same bytes); dst = src, a copy in
// stream order with the launches around it; and a copy of a range of columns between two
// row-major matrices, how a Mamba-2 block splits its projection into z, [x, B, C] and dt and
// joins their gradients again.

// Elements a thread takes an iteration: their loads are all issued before any store, so a
// thread has this many in flight (one at a time leaves a multiprocessor a third of the bytes
// in flight that the memory's bandwidth wants).
constexpr int ACC_ILP = 4;

extern "C" __global__ void add_f32(float* acc, const float* x, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += ACC_ILP * stride) {
        float a[ACC_ILP], b[ACC_ILP];
        for (int u = 0; u < ACC_ILP; ++u) {
            const size_t k = i + u * stride;
            a[u] = k < n ? acc[k] : 0.0f;
            b[u] = k < n ? x[k] : 0.0f;
        }
        for (int u = 0; u < ACC_ILP; ++u) {
            const size_t k = i + u * stride;
            if (k < n) {
                acc[k] = a[u] + b[u];
            }
        }
    }
}

extern "C" __global__ void copy_f32(float* dst, const float* src, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += ACC_ILP * stride) {
        float v[ACC_ILP];
        for (int u = 0; u < ACC_ILP; ++u) {
            const size_t k = i + u * stride;
            v[u] = k < n ? src[k] : 0.0f;
        }
        for (int u = 0; u < ACC_ILP; ++u) {
            const size_t k = i + u * stride;
            if (k < n) {
                dst[k] = v[u];
            }
        }
    }
}

// dst[r, dst_offset + j] = src[r, src_offset + j] for r < rows, j < width; src has src_cols
// columns and dst dst_cols.
extern "C" __global__ void copy_columns_f32(float* dst, int dst_cols, int dst_offset,
                                            const float* src, int src_cols, int src_offset,
                                            int rows, int width) {
    const size_t n = size_t(rows) * width;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / width;
        const size_t j = i % width;
        dst[r * dst_cols + dst_offset + j] = src[r * src_cols + src_offset + j];
    }
}
