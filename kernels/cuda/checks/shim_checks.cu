// Kernels that check the SIMT shim itself (built for the shim only, never for a GPU): each
// shuffle's lanes, and the kernel errors the shim must catch (a race that only a missing
// barrier allows, divergent barriers, shuffles after lanes returned).

// out[t] = the value each shuffle gives thread t of a block, lanes holding 100 + lane.
extern "C" __global__ void check_shuffles(int* out, int kind, int arg, int width) {
    const int t = threadIdx.x;
    const int v = 100 + t % 32;
    int got = 0;
    switch (kind) {
        case 0: got = __shfl_xor_sync(0xffffffffu, v, arg, width); break;
        case 1: got = __shfl_down_sync(0xffffffffu, v, unsigned(arg), width); break;
        case 2: got = __shfl_up_sync(0xffffffffu, v, unsigned(arg), width); break;
        default: got = __shfl_sync(0xffffffffu, v, arg, width); break;
    }
    out[t] = got;
}

// Each thread writes its slot, then reads its neighbour's: correct only with the barrier.
extern "C" __global__ void check_neighbour(int* out, int with_barrier) {
    __shared__ int slots[1024];
    const int t = threadIdx.x;
    slots[t] = t * 7 + 1;
    if (with_barrier) {
        __syncthreads();
    }
    out[t] = slots[(t + 1) % blockDim.x];
    __syncthreads();
}

extern "C" __global__ void check_divergent_barrier() {
    if (threadIdx.x % 2 == 0) {
        __syncthreads();
    } else {
        __syncwarp();
    }
}

extern "C" __global__ void check_barrier_after_return() {
    if (threadIdx.x == 0) {
        return;
    }
    __syncthreads();
}

extern "C" __global__ void check_shuffle_after_return(int* out) {
    if (threadIdx.x == 5) {
        return;
    }
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

// Lanes of one warp at two different warp-level operations: half at a shuffle, half at
// __syncwarp (divergent code); the shim refuses it rather than pair them up.
extern "C" __global__ void check_mixed_warp_ops(int* out) {
    if (threadIdx.x % 32 < 16) {
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
    } else {
        __syncwarp();
    }
}

// A 16-byte copy from an address 8 bytes past a 16-byte boundary: a GPU's vector load faults.
extern "C" __global__ void check_misaligned_vector(int* out) {
    alignas(16) unsigned short buffer[16] = {};
    simt::require_aligned(buffer + 4, 16, "check_misaligned_vector");
    out[threadIdx.x] = buffer[0];
}

// out[4·t + m] = word m of what ldmatrix (count matrices, trans or not) gives thread t, each
// lane passing row (7·lane) % 32 of a table whose row R holds R·8 + c at column c: rows out
// of order, so the lanes' own addresses are what is read.
extern "C" __global__ void check_ldmatrix(unsigned* out, int count, int trans) {
    __shared__ __align__(16) unsigned short table[32 * 8];
    for (int i = threadIdx.x; i < 32 * 8; i += blockDim.x) {
        table[i] = (unsigned short)i;
    }
    __syncthreads();
    const int lane = threadIdx.x % 32;
    unsigned words[4] = {};
    simt::ldmatrix_b16(words, count, trans != 0, table + (7 * lane) % 32 * 8);
    for (int m = 0; m < 4; ++m) {
        out[4 * threadIdx.x + m] = words[m];
    }
}

// Lanes of one warp asking ldmatrix for different transposes.
extern "C" __global__ void check_ldmatrix_mixed(int* out) {
    __shared__ __align__(16) unsigned short table[32 * 8];
    unsigned words[2];
    simt::ldmatrix_b16(words, 2, threadIdx.x % 2 == 0, table + threadIdx.x % 16 * 8);
    out[threadIdx.x] = int(words[0]);
}

// Each thread copies its 16 bytes of src (4 ints from 4·t) into two shared slots by cp.async,
// one group each, waits for all but the newest group, then out[2t] = its first slot's first
// int and out[2t + 1] = its second slot's: the second group may still be in flight.
extern "C" __global__ void check_cp_async_groups(int* out, const int* src) {
    __shared__ __align__(16) int first[4 * 64];
    __shared__ __align__(16) int second[4 * 64];
    const int t = threadIdx.x;
    simt::cp_async16(first + 4 * t, src + 4 * t);
    simt::cp_async_commit();
    simt::cp_async16(second + 4 * t, src + 4 * t);
    simt::cp_async_commit();
    simt::cp_async_wait(1);
    out[2 * t] = first[4 * t];
    out[2 * t + 1] = second[4 * t];
}

// Each thread copies its 16 bytes by cp.async, waits for them (or not), then reads its
// neighbour's after a barrier: correct only with the wait.
extern "C" __global__ void check_cp_async_neighbour(int* out, const int* src, int with_wait) {
    __shared__ __align__(16) int slots[4 * 64];
    const int t = threadIdx.x;
    simt::cp_async16(slots + 4 * t, src + 4 * t);
    simt::cp_async_commit();
    if (with_wait) {
        simt::cp_async_wait(0);
    }
    __syncthreads();
    out[t] = slots[4 * ((t + 1) % blockDim.x)];
}
