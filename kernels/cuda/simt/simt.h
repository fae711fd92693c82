// The SIMT shim: CUDA C++ kernels compiled unchanged by the host C++ compiler and executed on
// the CPU, one fiber per CUDA thread, for tests. It is force-included ahead of a `.cu` file.
//
// What it models: the launch state (threadIdx, blockIdx, blockDim, gridDim) of the running
// thread; __shared__ memory (per block: a block's fibers share one OS thread, new for each
// block, so shared memory starts at zero); block
// barriers (__syncthreads) and warp shuffles over 32 lanes with their real semantics: a
// barrier waits for every live thread of the block, a shuffle for every lane of the warp.
// What it refuses, with a message: a barrier some threads of the block can no longer reach
// (they returned, or wait at another barrier), a shuffle with a partial mask, a shuffle after
// lanes of the warp returned. Fibers run in thread order or in reverse (`reverse` of
// simt::launch): a kernel whose result depends on the order has a race.
//
// Three PTX instructions are modelled, because the tensor-core kernels are written with them:
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (mma_m16n8k16_bf16), a warp-wide
// rendezvous that multiplies the lanes' fragments laid out as the PTX ISA documents them, so
// a kernel that puts a value in the wrong lane or register gets a wrong product here too; and
// ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16 (ldmatrix_b16), the warp-wide load of
// those fragments from shared memory, each lane's row address used as the ISA says; and
// cp.async.cg.shared.global with its commit and wait groups (cp_async16), whose copies land
// at the latest moment the ISA allows in one schedule and at once in the other.
// What it cannot check: other inline PTX (TMA, wgmma), the memory model, timing.
// Fast-math intrinsics (__expf, rsqrtf) are libm calls here, a few ulp from the GPU's.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>

namespace simt {

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};

// The running CUDA thread's launch state.
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void syncthreads();
void syncwarp(unsigned mask);
// One 32-bit word through the warp: `lane` is the lane to read from (already resolved).
uint32_t exchange(unsigned mask, uint32_t word, int (*source)(int lane, int arg, int width),
                  int arg, int width);

int source_xor(int lane, int arg, int width);
int source_down(int lane, int arg, int width);
int source_up(int lane, int arg, int width);
int source_idx(int lane, int arg, int width);

template <class T>
T shuffle(unsigned mask, T value, int (*source)(int, int, int), int arg, int width) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 32- or 64-bit values");
    uint32_t words[sizeof(T) / 4];
    std::memcpy(words, &value, sizeof(T));
    for (auto& w : words) {
        w = exchange(mask, w, source, arg, width);
    }
    std::memcpy(&value, words, sizeof(T));
    return value;
}

// D += A·B for one warp, as mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: each lane
// passes its A fragment (four words of two bf16 values), its B fragment (two words) and its
// four f32 accumulators. Every lane of a full warp must call it.
void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]);

// ldmatrix.sync.aligned.m8n8.x{count}{.trans}.shared.b16 for one warp: lane 8·m + r passes the
// address of row r of 8 × 8 matrix m (eight bf16 values, 16 bytes, 16-byte aligned), and
// lane 4·r + w receives in words[m] that row's values 2w and 2w + 1, or with `trans` column
// r's values in rows 2w and 2w + 1, the first in the low half. Every lane of a full warp must
// call it, with the same count (1, 2 or 4) and the same trans; lanes past 8·count pass an
// address that is not read.
void ldmatrix_b16(uint32_t* words, int count, bool trans, const void* row);

// cp.async.cg.shared.global [to], [from], 16 for the calling thread (both 16-byte aligned),
// cp.async.commit_group (cp_async_commit: the thread's copies since its last commit become a
// group) and cp.async.wait_group n (cp_async_wait: every group but the n most recent has
// landed). A copy is in flight from its issue until a wait lets it land: in the forward
// schedule it lands at that wait, the latest the ISA allows; in the reverse schedule at its
// issue, the earliest. A kernel that reads a tile before waiting for it, or copies into
// shared memory another warp may still read, gives different bytes in the two schedules.
// Copies never waited for are dropped with the block, as its shared memory is.
void cp_async16(void* to, const void* from);
void cp_async_commit();
void cp_async_wait(int pending);

// Stops the kernel with a reason unless `p` is `bytes`-aligned: what a vector load or store of
// that width needs on a GPU, where a misaligned one faults, and the host does not.
void require_aligned(const void* p, std::size_t bytes, const char* what);

// Run `kernel` over `grid` blocks of `block` threads. Returns 0, or 1 with the reason in
// last_error().
int launch(dim3 grid, dim3 block, bool reverse, const std::function<void()>& kernel);
const char* last_error();
// Fail a launch before it starts, with `why` as its last_error(); returns 1.
int refuse(const char* why);

// A launch as cuLaunchKernel takes it: the geometry, and one pointer to each argument's value.
struct Geometry {
    unsigned grid[3];
    unsigned block[3];
    int reverse;
};

template <class... A, std::size_t... I>
void call_with(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}

template <class... A>
int launch_erased(void (*kernel)(A...), const Geometry& g, void** params) {
    return launch(dim3(g.grid[0], g.grid[1], g.grid[2]), dim3(g.block[0], g.block[1], g.block[2]),
                  g.reverse != 0,
                  [&] { call_with(kernel, params, std::index_sequence_for<A...>{}); });
}

}  // namespace simt

using simt::dim3;
using simt::uint3;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())
#define warpSize 32

inline void __syncthreads() { simt::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { simt::syncwarp(mask); }

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return simt::shuffle(mask, v, simt::source_xor, lane_mask, width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return simt::shuffle(mask, v, simt::source_down, int(delta), width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return simt::shuffle(mask, v, simt::source_up, int(delta), width);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    return simt::shuffle(mask, v, simt::source_idx, src_lane, width);
}

// Device math the host's libm spells differently.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Round-to-nearest arithmetic the GPU never fuses into an FMA; the host compiler fuses
// nothing (x86-64 without -mfma has no FMA to fuse into).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
using std::max;
using std::min;
