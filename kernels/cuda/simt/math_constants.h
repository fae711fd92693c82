// The shim's stand-in for CUDA's math_constants.h (the constants the kernels use).
#pragma once

#include <limits>

#define CUDART_INF_F (std::numeric_limits<float>::infinity())
#define CUDART_NAN_F (std::numeric_limits<float>::quiet_NaN())
#define CUDART_MAX_NORMAL_F (std::numeric_limits<float>::max())
