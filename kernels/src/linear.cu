// A register-blocked GEMM: C = alpha · op(A) · op(B) + beta · C, row-major, batched over
// gridDim.z. op(A) is m×k: A itself (m×k) or, with trans_a, A stored k×m; op(B) is k×n: B
// (k×n) or, with trans_b, B stored n×k. linear.rs's three products are its three uses:
//   y  = x · wᵀ   gemm(x, w, trans_b)          (m rows, n = out, k = in)
//   dx = g · w    gemm(g, w)
//   dw = gᵀ · x   gemm(g, x, trans_a)
//
// The classic shape of a fast f32 GEMM without tensor cores (as in Simon Boehm's "How to
// Optimize a CUDA Matmul Kernel", https://siboehm.com/articles/22/CUDA-MMM): a block of 256
// threads computes a 128×128 tile of C, stepping through k 8 at a time; each thread keeps an
// 8×8 sub-tile of C in registers and, per k, reads 8 values of A and 8 of B from shared
// memory for 64 FMAs. The next k-slice is fetched from global memory into registers while
// the current one is multiplied. A thread's 8 rows are ty*4 + {0..3} and 64 + ty*4 + {0..3}
// (its columns likewise with tx), so a warp's shared-memory reads are consecutive words.
//
// Each thread loads 4 values of each tile, consecutive along the stored matrix's contiguous
// dimension (k for a plain A, rows for a transposed one), so a warp's global loads coalesce
// in every transpose. Elements past m, n or k load as 0.
//
// Every output is one thread's fmaf chain over k = 0, 1, …, k-1 in order: the bytes never
// depend on the launch geometry, and the SIMT shim (whose fmaf rounds once, as the GPU's
// does) computes the same bytes as the GPU.
//
// gemm_bf16_f32 is the same GEMM with each operand rounded to bf16 (to nearest, ties to even)
// as it is loaded, the products still accumulated in f32: the arithmetic of a tensor-core GEMM
// of bf16 operands with f32 accumulation and output (cuBLASLt's CUBLAS_COMPUTE_32F over
// CUDA_R_16BF inputs), which is how Megatron-LM trains in bf16. It is what the trainer's bf16
// matmuls compute on the shim and wherever cuBLASLt is missing, and what cuBLASLt's results
// are held to (they differ in the order of the f32 sums, and in how alpha·sum + beta·c is
// rounded). cast_bf16 writes the bf16 operands cuBLASLt reads. gemm_bf16_f32_a16, _b16 and
// _ab16 are it with A, B or both already stored as bf16 (what cast_bf16 would have written,
// so the same bytes come out): a kernel that writes its output in bf16 saves the product
// the cast.
//
// Launch: block 256, grid (ceil(n/128), ceil(m/128), batches).

#include <cuda_bf16.h>

#define GEMM_BM 128
#define GEMM_BN 128
#define GEMM_BK 8

// An operand as the GEMM multiplies it: itself, or rounded to bf16 (a bf16 one already is).
template <bool BF16>
static __device__ __forceinline__ float gemm_operand(float v) {
    return BF16 ? __bfloat162float(__float2bfloat16_rn(v)) : v;
}
template <bool BF16>
static __device__ __forceinline__ float gemm_operand(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

// op(A)[row][kk], or 0 outside m×k.
template <bool BF16, class TA>
static __device__ __forceinline__ float gemm_a_at(const TA* a, int m, int k, int trans_a,
                                                  int row, int kk) {
    if (row >= m || kk >= k) return 0.0f;
    return gemm_operand<BF16>(trans_a ? a[size_t(kk) * m + row] : a[size_t(row) * k + kk]);
}

// op(B)[kk][col], or 0 outside k×n.
template <bool BF16, class TB>
static __device__ __forceinline__ float gemm_b_at(const TB* b, int n, int k, int trans_b,
                                                  int kk, int col) {
    if (kk >= k || col >= n) return 0.0f;
    return gemm_operand<BF16>(trans_b ? b[size_t(col) * k + kk] : b[size_t(kk) * n + col]);
}

template <bool BF16, class TA, class TB>
static __device__ __forceinline__ void gemm_tiles(const TA* a, const TB* b, float* c,
                                                  int m, int n, int k, int trans_a, int trans_b,
                                                  float alpha, float beta, long long stride_a,
                                                  long long stride_b, long long stride_c) {
    __shared__ float a_tile[GEMM_BK][GEMM_BM];  // op(A) tile, k-major: a_tile[kk][row]
    __shared__ float b_tile[GEMM_BK][GEMM_BN];  // op(B) tile: b_tile[kk][col]
    a += blockIdx.z * stride_a;
    b += blockIdx.z * stride_b;
    c += blockIdx.z * stride_c;
    const int tid = threadIdx.x;
    const int row0 = blockIdx.y * GEMM_BM, col0 = blockIdx.x * GEMM_BN;

    // The 4 values of each tile this thread loads: (a_row + j·a_dr, a_k + j·a_dk), j < 4.
    const int a_row = trans_a ? (tid % 32) * 4 : tid / 2;
    const int a_k = trans_a ? tid / 32 : (tid % 2) * 4;
    const int a_dr = trans_a ? 1 : 0, a_dk = trans_a ? 0 : 1;
    const int b_col = trans_b ? tid / 2 : (tid % 32) * 4;
    const int b_k = trans_b ? (tid % 2) * 4 : tid / 32;
    const int b_dc = trans_b ? 0 : 1, b_dk = trans_b ? 1 : 0;

    float a_next[4], b_next[4];
    for (int j = 0; j < 4; ++j) {
        a_next[j] =
            gemm_a_at<BF16, TA>(a, m, k, trans_a, row0 + a_row + j * a_dr, a_k + j * a_dk);
        b_next[j] =
            gemm_b_at<BF16, TB>(b, n, k, trans_b, b_k + j * b_dk, col0 + b_col + j * b_dc);
    }

    const int tx = tid % 16, ty = tid / 16;
    float acc[8][8];
    for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    }
    for (int t = 0; t < k; t += GEMM_BK) {
        for (int j = 0; j < 4; ++j) {
            a_tile[a_k + j * a_dk][a_row + j * a_dr] = a_next[j];
            b_tile[b_k + j * b_dk][b_col + j * b_dc] = b_next[j];
        }
        __syncthreads();
        if (t + GEMM_BK < k) {  // the next slice's loads are in flight during the FMAs
            const int next = t + GEMM_BK;
            for (int j = 0; j < 4; ++j) {
                a_next[j] = gemm_a_at<BF16, TA>(a, m, k, trans_a, row0 + a_row + j * a_dr,
                                                next + a_k + j * a_dk);
                b_next[j] = gemm_b_at<BF16, TB>(b, n, k, trans_b, next + b_k + j * b_dk,
                                                col0 + b_col + j * b_dc);
            }
        }
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            float ra[8], rb[8];
            for (int i = 0; i < 4; ++i) {
                ra[i] = a_tile[kk][ty * 4 + i];
                ra[4 + i] = a_tile[kk][64 + ty * 4 + i];
                rb[i] = b_tile[kk][tx * 4 + i];
                rb[4 + i] = b_tile[kk][64 + tx * 4 + i];
            }
            for (int i = 0; i < 8; ++i) {
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
            }
        }
        __syncthreads();
    }

    for (int i = 0; i < 8; ++i) {
        const int row = row0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (row >= m) continue;
        for (int j = 0; j < 8; ++j) {
            const int col = col0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (col >= n) continue;
            const size_t at = size_t(row) * n + col;
            // Rounded step by step (never fused), so the shim's bytes are the GPU's here too.
            const float scaled = __fmul_rn(alpha, acc[i][j]);
            c[at] = beta == 0.0f ? scaled : __fadd_rn(scaled, __fmul_rn(beta, c[at]));
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_f32(const float* a, const float* b, float* c, int m, int n, int k, int trans_a,
             int trans_b, float alpha, float beta, long long stride_a, long long stride_b,
             long long stride_c) {
    gemm_tiles<false, float, float>(a, b, c, m, n, k, trans_a, trans_b, alpha, beta, stride_a, stride_b,
                      stride_c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_bf16_f32(const float* a, const float* b, float* c, int m, int n, int k, int trans_a,
                  int trans_b, float alpha, float beta, long long stride_a, long long stride_b,
                  long long stride_c) {
    gemm_tiles<true, float, float>(a, b, c, m, n, k, trans_a, trans_b, alpha, beta, stride_a,
                                   stride_b, stride_c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_bf16_f32_a16(const __nv_bfloat16* a, const float* b, float* c, int m, int n, int k,
                      int trans_a, int trans_b, float alpha, float beta, long long stride_a,
                      long long stride_b, long long stride_c) {
    gemm_tiles<true, __nv_bfloat16, float>(a, b, c, m, n, k, trans_a, trans_b, alpha, beta,
                                           stride_a, stride_b, stride_c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_bf16_f32_b16(const float* a, const __nv_bfloat16* b, float* c, int m, int n, int k,
                      int trans_a, int trans_b, float alpha, float beta, long long stride_a,
                      long long stride_b, long long stride_c) {
    gemm_tiles<true, float, __nv_bfloat16>(a, b, c, m, n, k, trans_a, trans_b, alpha, beta,
                                           stride_a, stride_b, stride_c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_bf16_f32_ab16(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, int m, int n,
                       int k, int trans_a, int trans_b, float alpha, float beta,
                       long long stride_a, long long stride_b, long long stride_c) {
    gemm_tiles<true, __nv_bfloat16, __nv_bfloat16>(a, b, c, m, n, k, trans_a, trans_b, alpha,
                                                   beta, stride_a, stride_b, stride_c);
}

// Four values from x (16-byte aligned), rounded to bf16 into y (8-byte aligned): one 16-byte
// load and one 8-byte store, so a thread has four times the bytes in flight of a scalar copy.
static __device__ __forceinline__ void cast4_bf16(const float* x, __nv_bfloat16* y) {
    float v[4];
#ifdef __CUDA_ARCH__
    const float4 f = *reinterpret_cast<const float4*>(x);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
#else
    simt::require_aligned(x, 16, "cast_bf16's load");
    std::memcpy(v, x, 16);
#endif
    unsigned short b[4];
    for (int j = 0; j < 4; ++j) {
        b[j] = __bfloat16_as_ushort(__float2bfloat16_rn(v[j]));
    }
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint2*>(y) =
        make_uint2(b[0] | unsigned(b[1]) << 16, b[2] | unsigned(b[3]) << 16);
#else
    simt::require_aligned(y, 8, "cast_bf16's store");
    std::memcpy(y, b, 8);
#endif
}

// y[i] = x[i] rounded to bf16 (to nearest, ties to even), for i < n. Grid-stride, block 256:
// four values a thread at a time where x is 16-byte and y 8-byte aligned (a buffer's start,
// and most slots in it), else one.
extern "C" __global__ void cast_bf16(const float* x, __nv_bfloat16* y, size_t n) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    size_t done = 0;
    if (reinterpret_cast<size_t>(x) % 16 == 0 && reinterpret_cast<size_t>(y) % 8 == 0) {
        const size_t quads = n / 4;
        for (size_t q = first; q < quads; q += stride) {
            cast4_bf16(x + 4 * q, y + 4 * q);
        }
        done = 4 * quads;
    }
    for (size_t i = done + first; i < n; i += stride) {
        y[i] = __float2bfloat16_rn(x[i]);
    }
}
