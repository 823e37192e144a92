// kdagen: one include for the runtime, whichever vendor compiles the source.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define KDAGEN_AMD 1
#elif defined(__CUDACC__)
#include "hip_on_cuda.h"
#define KDAGEN_NVIDIA 1
#else
#error "kdagen kernels are compiled by hipcc (AMD) or nvcc (NVIDIA)"
#endif

#include <stdint.h>
