// A plain tiled GEMM: C = alpha · op(A) · op(B) + beta · C, row-major, batched over
// gridDim.z. op(A) is m×k: A itself (m×k) or, with trans_a, A stored k×m; op(B) is k×n: B
// (k×n) or, with trans_b, B stored n×k. linear.rs's three products are its three uses:
//   y  = x · wᵀ   gemm(x, w, trans_b)          (m rows, n = out, k = in)
//   dx = g · w    gemm(g, w)
//   dw = gᵀ · x   gemm(g, x, trans_a)
// On a GPU the training GEMMs belong to cuBLASLt; this kernel runs them in the SIMT shim (so
// a whole training step can be checked on the CPU) and is the reference cuBLASLt's results
// are checked against. Each output is summed over k in order, 16 at a time, by one thread:
// the bytes never depend on the launch.
//
// Launch: block (16, 16), grid (ceil(n/16), ceil(m/16), batches).

#define GEMM_TILE 16

extern "C" __global__ void gemm_f32(const float* a, const float* b, float* c, int m, int n,
                                    int k, int trans_a, int trans_b, float alpha, float beta,
                                    long long stride_a, long long stride_b, long long stride_c) {
    __shared__ float a_tile[GEMM_TILE][GEMM_TILE + 1];
    __shared__ float b_tile[GEMM_TILE][GEMM_TILE + 1];
    a += blockIdx.z * stride_a;
    b += blockIdx.z * stride_b;
    c += blockIdx.z * stride_c;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * GEMM_TILE + ty;
    const int col = blockIdx.x * GEMM_TILE + tx;
    float acc = 0.0f;
    for (int t = 0; t < k; t += GEMM_TILE) {
        const int ka = t + tx;  // this thread loads op(A)[row][ka] and op(B)[kb][col]
        const int kb = t + ty;
        float av = 0.0f, bv = 0.0f;
        if (row < m && ka < k) {
            av = trans_a ? a[size_t(ka) * m + row] : a[size_t(row) * k + ka];
        }
        if (kb < k && col < n) {
            bv = trans_b ? b[size_t(col) * k + kb] : b[size_t(kb) * n + col];
        }
        a_tile[ty][tx] = av;
        b_tile[ty][tx] = bv;
        __syncthreads();
        for (int i = 0; i < GEMM_TILE; ++i) {
            acc += a_tile[ty][i] * b_tile[i][tx];
        }
        __syncthreads();
    }
    if (row < m && col < n) {
        const size_t at = size_t(row) * n + col;
        c[at] = beta == 0.0f ? alpha * acc : alpha * acc + beta * c[at];
    }
}
