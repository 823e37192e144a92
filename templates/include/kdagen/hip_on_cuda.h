// kdagen: the subset of the HIP runtime API that kdagen's kernels use, mapped onto
// CUDA, so that the same .hip source builds with nvcc. HIP is a CUDA dialect; only
// names differ. Cross-lane and matrix instructions are not here: they live in the
// vendor layer (vendor_cuda.h / vendor_cdna.h).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

using hipStream_t = cudaStream_t;
using hipError_t = cudaError_t;
using hipDeviceAttribute_t = cudaDeviceAttr;

#define hipSuccess cudaSuccess
#define hipFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount

inline hipError_t hipGetLastError() { return cudaGetLastError(); }
inline const char* hipGetErrorString(hipError_t e) { return cudaGetErrorString(e); }
inline hipError_t hipGetDevice(int* d) { return cudaGetDevice(d); }
inline hipError_t hipDeviceGetAttribute(int* v, hipDeviceAttribute_t a, int d) {
  return cudaDeviceGetAttribute(v, a, d);
}
inline hipError_t hipFuncSetAttribute(const void* f, cudaFuncAttribute a, int v) {
  return cudaFuncSetAttribute(f, a, v);
}

inline hipError_t hipOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void* f, int threads,
                                                              size_t shared) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, f, threads, shared);
}

#define hipLaunchKernelGGL(kernel, grid, block, shmem, stream, ...) \
  kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
