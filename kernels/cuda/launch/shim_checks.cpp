// Kernels that check the SIMT shim itself: each shuffle's lanes, and the kernel errors the
// shim must catch (a race that only a missing barrier allows, divergent barriers, shuffles
// after lanes returned).

// out[t] = the value each shuffle gives thread t of a block, lanes holding 100 + lane.
__global__ void shuffles(int* out, int kind, int arg, int width) {
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
__global__ void neighbour(int* out, int with_barrier) {
    __shared__ int slots[1024];
    const int t = threadIdx.x;
    slots[t] = t * 7 + 1;
    if (with_barrier) {
        __syncthreads();
    }
    out[t] = slots[(t + 1) % blockDim.x];
    __syncthreads();
}

__global__ void divergent_barrier() {
    if (threadIdx.x % 2 == 0) {
        __syncthreads();
    } else {
        __syncwarp();
    }
}

__global__ void barrier_after_return() {
    if (threadIdx.x == 0) {
        return;
    }
    __syncthreads();
}

__global__ void shuffle_after_return(int* out) {
    if (threadIdx.x == 5) {
        return;
    }
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

extern "C" int simt_check_shuffles(unsigned block, int* out, int kind, int arg, int width) {
    return simt::launch(1, block, false, [&] { shuffles(out, kind, arg, width); });
}
extern "C" int simt_check_neighbour(unsigned block, int reverse, int* out, int with_barrier) {
    return simt::launch(1, block, reverse != 0, [&] { neighbour(out, with_barrier); });
}
extern "C" int simt_check_divergent_barrier(unsigned block) {
    return simt::launch(1, block, false, [&] { divergent_barrier(); });
}
extern "C" int simt_check_barrier_after_return(unsigned block) {
    return simt::launch(1, block, false, [&] { barrier_after_return(); });
}
extern "C" int simt_check_shuffle_after_return(unsigned block, int* out) {
    return simt::launch(1, block, false, [&] { shuffle_after_return(out); });
}
