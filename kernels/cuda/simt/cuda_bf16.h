// The shim's stand-in for CUDA's cuda_bf16.h: bfloat16 storage and its conversions, rounding
// to nearest even as the GPU's cvt.rn.bf16.f32 does, NaN kept quiet.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t bits;
};

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return {uint16_t((u >> 16) | 0x0040u)};
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = uint32_t(b.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }
