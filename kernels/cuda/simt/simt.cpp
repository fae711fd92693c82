// The SIMT shim's scheduler (see simt.h). Blocks run one after another, each on an OS thread
// of its own; within a block, each CUDA thread is a fiber (ucontext) with its own stack. Warps
// run one at a time, each as far as it can go alone (to a block barrier, or its end), so a
// shared-memory race between warps shows as a difference between the two schedules (lowest
// warp first, or highest first). A block barrier releases the block when every thread waits
// at it; when nothing can go on and some thread has not ended, the kernel is wrong, and the
// launch says why.

#include "simt.h"

#include "cuda_bf16.h"

#include <ucontext.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace simt {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kWarp = 32;
constexpr int kMmaWords = 6;  // a lane's A (4 words) and B (2 words) of one mma

enum class State { Ready, AtBlockBarrier, AtWarpBarrier, Done };

// What a lane waits at when its state is AtWarpBarrier: a warp releases its lanes only when
// they all wait at the same kind of warp-level operation.
enum class WarpOp { Shuffle, Syncwarp, Mma, Ldmatrix };

// A cp.async copy in flight: where it lands, the 16 bytes read at its issue (the kernels copy
// from global memory no thread writes), and the group it is in (the thread's commits before it).
struct Copy {
    void* to;
    unsigned char bytes[16];
    int group;
};

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    uint3 index;
    unsigned linear;
    State state;
    WarpOp op;
    std::vector<Copy> copies;  // cp.async copies in flight
    int commits;               // cp.async.commit_group calls so far
};

// One launch: its geometry, and the block being run.
struct Launch {
    dim3 grid, block;
    uint3 block_index;
    const std::function<void()>* kernel;
    bool reverse;  // the schedule: cp.async copies land at once when reversed
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    Fiber* current;
    std::vector<uint32_t> words;  // one exchange slot per thread
    std::vector<uint32_t> frags;  // kMmaWords a thread, for mma_m16n8k16_bf16
    std::vector<const void*> rows;  // a row address a thread, for ldmatrix_b16
    std::vector<int> forms;         // 2·count + trans a thread, for ldmatrix_b16
    std::string error;
};

thread_local Launch* active = nullptr;
thread_local std::string last_error_message;

[[noreturn]] void misuse(const char* what);

Fiber& current_fiber() {
    if (active == nullptr || active->current == nullptr) {
        misuse("a device function was called outside a kernel launch");
    }
    return *active->current;
}

// Back to the scheduler until released; a fiber in error is never resumed.
void wait(State state) {
    Fiber& fiber = current_fiber();
    fiber.state = state;
    swapcontext(&fiber.context, &active->scheduler);
}

// A misuse inside a kernel: record it and leave the fiber parked for good.
[[noreturn]] void misuse(const char* what) {
    if (active == nullptr || active->current == nullptr) {
        last_error_message = what;
        std::abort();
    }
    if (active->error.empty()) {
        active->error = what;
    }
    for (;;) {
        wait(State::AtBlockBarrier);
    }
}

void entry() {
    (*active->kernel)();
    active->current->state = State::Done;
    swapcontext(&active->current->context, &active->scheduler);
}

std::string where(const Launch& l) {
    return "block (" + std::to_string(l.block_index.x) + "," + std::to_string(l.block_index.y) +
           "," + std::to_string(l.block_index.z) + ")";
}

// Whether warp `first..end` can be released from an exchange: all its lanes wait at one.
// Sets `l.error` if some lanes returned while others wait there, or if its lanes wait at
// different kinds of warp-level operation (divergent lanes at a shuffle and at an mma).
bool warp_ready(Launch& l, size_t first, size_t end) {
    size_t waiting = 0, done = 0;
    for (size_t i = first; i < end; ++i) {
        waiting += l.fibers[i].state == State::AtWarpBarrier;
        done += l.fibers[i].state == State::Done;
    }
    if (waiting > 0 && done > 0) {
        l.error = "a warp shuffle, __syncwarp, mma.sync or ldmatrix after lanes of the warp "
                  "returned, in " +
                  where(l);
    }
    if (waiting == end - first) {
        for (size_t i = first + 1; i < end; ++i) {
            if (l.fibers[i].op != l.fibers[first].op) {
                l.error = "lanes of a warp wait at different warp-level operations (a shuffle, "
                          "__syncwarp, mma.sync or ldmatrix in divergent code), in " +
                          where(l);
                return false;
            }
        }
    }
    return waiting == end - first;
}

// Run warp `first..end` as far as it goes alone: its lanes to their next wait point, again
// and again while the warp's own exchanges release it. False if the kernel failed.
bool run_warp(Launch& l, size_t first, size_t end, bool reverse) {
    for (;;) {
        for (size_t k = 0; k < end - first; ++k) {
            Fiber& f = l.fibers[reverse ? end - 1 - k : first + k];
            if (f.state == State::Ready) {
                l.current = &f;
                swapcontext(&l.scheduler, &f.context);
                l.current = nullptr;
                if (!l.error.empty()) {
                    return false;
                }
            }
        }
        if (!warp_ready(l, first, end)) {
            return l.error.empty();
        }
        for (size_t i = first; i < end; ++i) {
            l.fibers[i].state = State::Ready;
        }
    }
}

// Warps run one at a time, each as far as it can before the next starts (the most skew a
// GPU may show between warps), lowest first or, reversed, highest first with lanes in
// reverse. Then a block barrier releases the block, or nothing can go on: an error.
bool run_block(Launch& l, bool reverse) {
    size_t n = l.fibers.size();
    for (size_t i = 0; i < n; ++i) {
        Fiber& f = l.fibers[i];
        unsigned bx = l.block.x, by = l.block.y;
        f.index = {unsigned(i % bx), unsigned(i / bx % by), unsigned(i / (bx * by))};
        f.linear = unsigned(i);
        f.state = State::Ready;
        f.copies.clear();
        f.commits = 0;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.get();
        f.context.uc_stack.ss_size = kStackBytes;
        f.context.uc_link = nullptr;
        makecontext(&f.context, entry, 0);
    }
    size_t warps = (n + kWarp - 1) / kWarp;
    for (;;) {
        for (size_t k = 0; k < warps; ++k) {
            size_t w = reverse ? warps - 1 - k : k;
            if (!run_warp(l, w * kWarp, std::min(n, (w + 1) * kWarp), reverse)) {
                return false;
            }
        }
        size_t live = 0, at_block = 0;
        for (auto& f : l.fibers) {
            live += f.state != State::Done;
            at_block += f.state == State::AtBlockBarrier;
        }
        if (live == 0) {
            return true;
        }
        if (at_block != live) {
            l.error = "threads of " + where(l) +
                      " wait at different barriers (__syncthreads or a shuffle in divergent code)";
            return false;
        }
        if (live != n) {
            l.error = "__syncthreads after some threads of the block returned, in " + where(l);
            return false;
        }
        for (auto& f : l.fibers) {
            f.state = State::Ready;
        }
    }
}

}  // namespace

const uint3& thread_idx() { return current_fiber().index; }
const uint3& block_idx() {
    current_fiber();
    return active->block_index;
}
const dim3& block_dim() {
    current_fiber();
    return active->block;
}
const dim3& grid_dim() {
    current_fiber();
    return active->grid;
}

void syncthreads() { wait(State::AtBlockBarrier); }

void syncwarp(unsigned mask) {
    if (mask != 0xffffffffu) {
        misuse("__syncwarp with a partial mask: the shim runs full warps only");
    }
    current_fiber().op = WarpOp::Syncwarp;
    wait(State::AtWarpBarrier);
}

int source_xor(int lane, int arg, int width) {
    int src = lane ^ arg;
    return (src / width == lane / width) ? src : lane;
}
int source_down(int lane, int arg, int width) {
    int src = lane + arg;
    return (src / width == lane / width) ? src : lane;
}
int source_up(int lane, int arg, int width) {
    int src = lane - arg;
    return (src >= 0 && src / width == lane / width) ? src : lane;
}
int source_idx(int lane, int arg, int width) { return lane / width * width + arg % width; }

uint32_t exchange(unsigned mask, uint32_t word, int (*source)(int, int, int), int arg,
                  int width) {
    if (mask != 0xffffffffu) {
        misuse("a warp shuffle with a partial mask: the shim runs full warps only");
    }
    if (width <= 0 || width > kWarp || (width & (width - 1)) != 0) {
        misuse("a warp shuffle's width must be a power of two up to 32");
    }
    Fiber& me = current_fiber();
    unsigned warp_start = me.linear / kWarp * kWarp;
    int lane = int(me.linear % kWarp);
    active->words[me.linear] = word;
    me.op = WarpOp::Shuffle;
    wait(State::AtWarpBarrier);
    unsigned from = warp_start + unsigned(source(lane, arg, width));
    uint32_t got = from < active->fibers.size() ? active->words[from] : word;
    wait(State::AtWarpBarrier);  // every lane has read before any writes again
    return got;
}

namespace {

// The bf16 value in half `half` (0: the low 16 bits) of `word`, as an f32.
float bf16_at(uint32_t word, int half) {
    return __bfloat162float(__nv_bfloat16{uint16_t(word >> (16 * half))});
}

}  // namespace

void require_aligned(const void* p, std::size_t bytes, const char* what) {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes != 0) {
        static thread_local std::string why;
        why = std::string(what) + ": a pointer not " + std::to_string(bytes) +
              "-byte aligned, which a GPU's vector access faults on";
        misuse(why.c_str());
    }
}

void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    Fiber& me = current_fiber();
    unsigned warp_start = me.linear / kWarp * kWarp;
    if (warp_start + kWarp > active->fibers.size()) {
        misuse("mma.sync in a partial warp: it needs all 32 lanes");
    }
    uint32_t* mine = &active->frags[size_t(me.linear) * kMmaWords];
    std::memcpy(mine, a, 4 * sizeof(uint32_t));
    std::memcpy(mine + 4, b, 2 * sizeof(uint32_t));
    me.op = WarpOp::Mma;
    wait(State::AtWarpBarrier);
    // The warp's A (16 × 16) and B (16 × 8) from the lanes' fragments, as PTX lays them out
    // for mma.m16n8k16 with 16-bit operands: lane = 4·group + t; A's words hold (row, col)
    // pairs (group, 2t), (group + 8, 2t), (group, 2t + 8), (group + 8, 2t + 8) and the next
    // column; B's words hold (2t, group), (2t + 8, group) and the next row.
    float A[16][16], B[16][8];
    for (int lane = 0; lane < kWarp; ++lane) {
        const uint32_t* f = &active->frags[size_t(warp_start + lane) * kMmaWords];
        int g = lane / 4, t = lane % 4;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = bf16_at(f[0], h);
            A[g + 8][2 * t + h] = bf16_at(f[1], h);
            A[g][2 * t + 8 + h] = bf16_at(f[2], h);
            A[g + 8][2 * t + 8 + h] = bf16_at(f[3], h);
            B[2 * t + h][g] = bf16_at(f[4], h);
            B[2 * t + 8 + h][g] = bf16_at(f[5], h);
        }
    }
    wait(State::AtWarpBarrier);  // every lane has read before any writes again
    // This lane's part of D = A·B + C: (group, 2t), (group, 2t + 1), (group + 8, 2t),
    // (group + 8, 2t + 1). Each product of two bf16 values is exact in f32.
    int lane = int(me.linear % kWarp), g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float sum = d[i];
        for (int k = 0; k < 16; ++k) {
            sum += A[row][k] * B[k][col];
        }
        d[i] = sum;
    }
}

void ldmatrix_b16(uint32_t* words, int count, bool trans, const void* row) {
    Fiber& me = current_fiber();
    unsigned warp_start = me.linear / kWarp * kWarp;
    if (warp_start + kWarp > active->fibers.size()) {
        misuse("ldmatrix in a partial warp: it needs all 32 lanes");
    }
    if (count != 1 && count != 2 && count != 4) {
        misuse("ldmatrix loads 1, 2 or 4 matrices");
    }
    int lane = int(me.linear % kWarp);
    if (lane < 8 * count) {
        require_aligned(row, 16, "ldmatrix");
    }
    active->rows[me.linear] = row;
    active->forms[me.linear] = 2 * count + int(trans);
    me.op = WarpOp::Ldmatrix;
    wait(State::AtWarpBarrier);
    for (unsigned i = warp_start; i < warp_start + kWarp; ++i) {
        if (active->forms[i] != active->forms[me.linear]) {
            misuse("lanes of a warp ask ldmatrix for different numbers of matrices or transposes");
        }
    }
    // Value `col` of the row whose address lane `from` passed.
    auto at = [&](int from, int col) {
        uint16_t v;
        std::memcpy(&v, static_cast<const uint16_t*>(active->rows[warp_start + from]) + col, 2);
        return uint32_t(v);
    };
    int r = lane / 4, w = lane % 4;
    for (int m = 0; m < count; ++m) {
        if (trans) {
            words[m] = at(8 * m + 2 * w, r) | at(8 * m + 2 * w + 1, r) << 16;
        } else {
            words[m] = at(8 * m + r, 2 * w) | at(8 * m + r, 2 * w + 1) << 16;
        }
    }
    wait(State::AtWarpBarrier);  // every lane has read before any passes a new address
}

void cp_async16(void* to, const void* from) {
    Fiber& me = current_fiber();
    require_aligned(to, 16, "cp.async's shared address");
    require_aligned(from, 16, "cp.async's global address");
    if (active->reverse) {
        std::memcpy(to, from, 16);
        return;
    }
    Copy copy{to, {}, me.commits};
    std::memcpy(copy.bytes, from, 16);
    me.copies.push_back(copy);
}

void cp_async_commit() { ++current_fiber().commits; }

void cp_async_wait(int pending) {
    Fiber& me = current_fiber();
    if (pending < 0) {
        misuse("cp.async.wait_group with a negative count");
    }
    // Groups 0 .. commits - 1 are committed; all but the `pending` most recent land.
    const int landed = me.commits - pending;
    std::vector<Copy> still;
    for (const Copy& c : me.copies) {
        if (c.group < landed) {
            std::memcpy(c.to, c.bytes, 16);
        } else {
            still.push_back(c);
        }
    }
    me.copies.swap(still);
}

int launch(dim3 grid, dim3 block, bool reverse, const std::function<void()>& kernel) {
    size_t threads = size_t(block.x) * block.y * block.z;
    if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
        last_error_message = "a launch needs 1 to 1024 threads a block and a grid of at least 1";
        return 1;
    }
    Launch l;
    l.grid = grid;
    l.block = block;
    l.kernel = &kernel;
    l.reverse = reverse;
    l.fibers.resize(threads);
    for (auto& f : l.fibers) {
        f.stack.reset(new char[kStackBytes]);
    }
    l.words.assign(threads, 0);
    l.frags.assign(threads * kMmaWords, 0);
    l.rows.assign(threads, nullptr);
    l.forms.assign(threads, 0);
    l.current = nullptr;
    bool ok = true;
    for (unsigned z = 0; z < grid.z && ok; ++z) {
        for (unsigned y = 0; y < grid.y && ok; ++y) {
            for (unsigned x = 0; x < grid.x && ok; ++x) {
                l.block_index = {x, y, z};
                // A fresh OS thread a block: its __shared__ (thread_local) memory starts at
                // zero, never with what an earlier block or launch left there.
                std::thread runner([&] {
                    active = &l;
                    ok = run_block(l, reverse);
                    active = nullptr;
                });
                runner.join();
            }
        }
    }
    if (!ok) {
        last_error_message = l.error;
        return 1;
    }
    return 0;
}

const char* last_error() { return last_error_message.c_str(); }

int refuse(const char* why) {
    last_error_message = why;
    return 1;
}

}  // namespace simt

extern "C" const char* simt_last_error() { return simt::last_error(); }
