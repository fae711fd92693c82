// Element by element, one thread an element, grid-stride: acc += x, how the GPU trainer sums
// gradients over micro-batches and over the two paths into a residual stream, in the order it
// issues them (no atomics: the same launches give the same bytes); dst = src, a copy in
// stream order with the launches around it; and a copy of a range of columns between two
// row-major matrices, how a Mamba-2 block splits its projection into z, [x, B, C] and dt and
// joins their gradients again.

extern "C" __global__ void add_f32(float* acc, const float* x, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc[i] += x[i];
    }
}

extern "C" __global__ void copy_f32(float* dst, const float* src, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = src[i];
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
