// kernel_compat.cuh: what a kernel .cuh includes so that one source builds under nvcc and under the
// host execution harness (cuda/emulation/emulation.h, which explains the rules). Installed with the
// kernel headers (laminar/cuda/), so a host application's nvcc build finds it next to them.
//
// LAMINAR_KERNELS is 1 where __global__ kernels can be compiled: under nvcc, and in a host
// translation unit that included emulation.h first. Elsewhere (the CPU library sources that only
// want the LAMINAR_HOST_DEVICE helpers of a .cuh) it is 0 and the kernels are left out.
#pragma once

// Loop unrolling hints for nvcc; the host compiler decides for itself.
#if defined(__CUDACC__)
#define LAMINAR_UNROLL _Pragma("unroll")
#define LAMINAR_NO_UNROLL _Pragma("unroll 1")
#else
#define LAMINAR_UNROLL
#define LAMINAR_NO_UNROLL
#endif

#if defined(__CUDACC__)
#define LAMINAR_KERNELS 1
// One dynamic shared-memory arena per block, sized by the launch.
#define LAMINAR_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
// A fixed-size shared variable (array types allowed: LAMINAR_SHARED(float[32], partial)).
#define LAMINAR_SHARED(type, name) __shared__ type name
#elif defined(LAMINAR_CUDA_EMULATION)
#define LAMINAR_KERNELS 1
#else
#define LAMINAR_KERNELS 0
#endif
