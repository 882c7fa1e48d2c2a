// The few operations the decode kernel is written in: byte permutes, half2 arithmetic, conversions, the m16n8k16
// tensor-core product, shuffles, votes and barriers. On the GPU each is an instruction or two; compiled as C++
// with KIVI_EMULATE (the CPU tests) they run on the software warp of emulate.h, with the same results.
#pragma once

#include <cstdint>

#ifdef KIVI_EMULATE
#include "emulate.h"
#else

#define KIVI_DEVICE __device__ __forceinline__
#define KIVI_HOST_DEVICE __host__ __device__

KIVI_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// a op b on fp16 pairs, rounded to nearest: hsub2, hadd2, hmul2.
#define KIVI_HALF2_BINARY(name, instruction)                       \
  KIVI_DEVICE uint32_t name(uint32_t a, uint32_t b) {              \
    uint32_t d;                                                    \
    asm(instruction " %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));    \
    return d;                                                      \
  }
KIVI_HALF2_BINARY(hsub2, "sub.rn.f16x2")
KIVI_HALF2_BINARY(hadd2, "add.rn.f16x2")
KIVI_HALF2_BINARY(hmul2, "mul.rn.f16x2")
#undef KIVI_HALF2_BINARY

KIVI_DEVICE uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// x, as a value the compiler cannot trace back: what is derived from it is computed again, not kept live.
KIVI_DEVICE int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// The larger of each 16-bit half, unsigned.
KIVI_DEVICE uint32_t max_u16x2(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }

// {lo, hi} rounded to nearest into one half2 (lo in the low 16 bits).
KIVI_DEVICE uint32_t pack_half2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

KIVI_DEVICE uint16_t float_to_half(float x) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}

KIVI_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

KIVI_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

KIVI_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

KIVI_DEVICE uint32_t shfl(uint32_t v, int src) { return __shfl_sync(0xFFFFFFFFu, v, src); }
KIVI_DEVICE float shfl(float v, int src) { return __shfl_sync(0xFFFFFFFFu, v, src); }
KIVI_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xFFFFFFFFu, v, mask); }
KIVI_DEVICE bool warp_any(bool p) { return __any_sync(0xFFFFFFFFu, p); }
KIVI_DEVICE uint32_t warp_max(uint32_t v) { return __reduce_max_sync(0xFFFFFFFFu, v); }
KIVI_DEVICE void sync_block() { __syncthreads(); }

// 16 bytes from global to shared memory, asynchronously; only the first `bytes` are read, the rest zero-filled.
KIVI_DEVICE void copy16(void* shared, const void* global, int bytes) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(global), "r"(bytes));
}
// 8 bytes from global to shared memory, asynchronously (a source aligned to 8 bytes only).
KIVI_DEVICE void copy8(void* shared, const void* global) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(to), "l"(global));
}
// Starts bringing the line at p into L2: a hint, nothing waits for it.
KIVI_DEVICE void prefetch_line(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
KIVI_DEVICE void copy_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most `pending` committed groups of this thread's copies are still in flight.
template <int pending>
KIVI_DEVICE void copy_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(pending));
}
KIVI_DEVICE void sync_warp() { __syncwarp(); }

// The block's dynamic shared memory (launched with the size the kernel asks for).
KIVI_DEVICE void* dynamic_shared() {
  extern __shared__ uint4 shared_words[];
  return shared_words;
}

// d += a (16x16, row-major) * b (16x8, column-major), fp16 operands, fp32 accumulators.
KIVI_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif
