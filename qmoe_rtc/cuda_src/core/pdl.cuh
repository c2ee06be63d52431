// core/pdl.cuh: programmatic dependent launch (sm_90+), the two points a kernel marks.
//
// A kernel launched with programmatic stream serialization may start while the previous kernel on the
// stream still runs. It must call pdl_wait() before it reads anything that kernel (or one before it)
// writes: the wait returns once every earlier grid of the chain has finished and its writes are
// visible. pdl_release() lets the next kernel of the chain start its blocks (they run their own
// prologue, then wait); a kernel that overlaps its predecessor calls it only after its own
// pdl_wait(), so whatever the kernels before it wrote is complete by the time its dependent starts
// (the router GEMM, always a forward's first launch and never overlapped, releases at once).
// Launched the ordinary way (or below sm_90) both are no-ops, so one translation unit serves every
// launch mode.
#pragma once

namespace qmoe {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace qmoe
