// The gather/scatter copy kernel shared by its CUDA source (gather_kernel.cu, compiled
// by nvcc in the Bazel build) and the device copy path that launches it through the
// driver API (agent/paths/device_copy.cc): the descriptor layout, the kernel's name
// and launch shape, and the embedded fatbin (generated gather_kernel_image.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvagent::agent {

// One copy of the kernel: `bytes` from `src` to `dst`, both device addresses in the
// launching context's unified address space. An array of these is copied to the
// device before each launch; the kernel reads it there.
struct GatherCopy {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
};
static_assert(sizeof(GatherCopy) == 24, "the kernel and the host agree on 24 bytes");

// extern "C" in the .cu, so the module exports it under this name.
inline constexpr char kGatherKernelName[] = "kvagent_gather_copy";
// Threads per block; each block copies whole descriptors, 16 bytes per thread per
// step when both sides and the length are 16-byte aligned.
inline constexpr unsigned kGatherThreads = 256;

#ifndef __CUDACC__
// The fatbin nvcc built (cubins for the architectures in agent/BUILD.bazel and PTX
// for newer ones), for cuModuleLoadData; `nvcc --version`'s release line as it ran.
const unsigned char* GatherKernelImage();
size_t GatherKernelImageBytes();
const char* GatherKernelCompiler();
#endif

}  // namespace kvagent::agent
