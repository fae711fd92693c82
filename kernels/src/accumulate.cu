// Element by element, one thread an element, grid-stride: acc += x, how the GPU trainer sums
// gradients over micro-batches and over the two paths into a residual stream, in the order it
// issues them (no atomics: the same launches give the same bytes); and dst = src, a copy in
// stream order with the launches around it.

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
