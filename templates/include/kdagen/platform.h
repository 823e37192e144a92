// kdagen: one include for the runtime, whichever vendor compiles the source.
#pragma once

#if defined(KDAGEN_EMULATE)
#include "emulate.h"  // the CPU emulation (tests without a GPU); defines KDAGEN_AMD or _NVIDIA
#elif defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define KDAGEN_AMD 1
#elif defined(__CUDACC__)
#include "hip_on_cuda.h"
#define KDAGEN_NVIDIA 1
#else
#error "kdagen kernels are compiled by hipcc (AMD) or nvcc (NVIDIA), or emulated (KDAGEN_EMULATE)"
#endif

#include <stdint.h>

// A kernel's dynamic shared memory (LDS), 16-byte aligned.
#ifndef KDAGEN_DYNAMIC_SHARED
#define KDAGEN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif
