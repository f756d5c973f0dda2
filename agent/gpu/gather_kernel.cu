// The device copy path's gather/scatter kernel: one launch copies every piece of a
// batch (agent/gpu/device_batch.h plans them), each block taking whole descriptors
// in turn. Built into a fatbin by nvcc (agent/BUILD.bazel, :gather_kernel_image) and
// loaded with cuModuleLoadData; no CUDA runtime is linked.
#include "agent/gpu/gather_kernel.h"

namespace {

// Copies one descriptor with the block's threads: 16-byte words when both addresses
// and the length allow, else 8-byte words, else bytes.
__device__ void CopyOne(const kvagent::agent::GatherCopy& c) {
  const uint64_t aligned = c.src | c.dst | c.bytes;
  if ((aligned & 15) == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(c.src);
    uint4* dst = reinterpret_cast<uint4*>(c.dst);
    for (uint64_t i = threadIdx.x; i < c.bytes / 16; i += blockDim.x) dst[i] = src[i];
  } else if ((aligned & 7) == 0) {
    const uint64_t* src = reinterpret_cast<const uint64_t*>(c.src);
    uint64_t* dst = reinterpret_cast<uint64_t*>(c.dst);
    for (uint64_t i = threadIdx.x; i < c.bytes / 8; i += blockDim.x) dst[i] = src[i];
  } else {
    const unsigned char* src = reinterpret_cast<const unsigned char*>(c.src);
    unsigned char* dst = reinterpret_cast<unsigned char*>(c.dst);
    for (uint64_t i = threadIdx.x; i < c.bytes; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kvagent::agent::kGatherThreads)
    kvagent_gather_copy(const kvagent::agent::GatherCopy* copies, unsigned long long count) {
  for (unsigned long long d = blockIdx.x; d < count; d += gridDim.x) CopyOne(copies[d]);
}
