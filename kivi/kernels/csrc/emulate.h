// A software warp for the CPU tests: the CUDA source of the decode kernel, compiled as C++ with KIVI_EMULATE,
// runs every thread of a block as a fiber (ucontext) and the collectives its warps use (shuffles, votes, the
// tensor-core product, barriers) as rendezvous of the 32 fibers of a warp. Blocks run one after another, so a
// kernel's `__shared__` arrays are function statics. Half-precision arithmetic is rounded as the GPU rounds it
// (one rounding of the exact result), the tensor-core product accumulates in double and rounds to float.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#include <algorithm>

using std::max;
using std::min;

#define KIVI_DEVICE inline
#define KIVI_HOST_DEVICE
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__

namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

constexpr int kWarp = 32;
constexpr size_t kStack = 256 * 1024;

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  bool done = false;
};

// A rendezvous of `size` fibers: each deposits its operand in the buffer of the current generation, arrives, and
// waits until all have arrived. Two buffers by generation parity: a fiber can only write one again after every
// fiber has passed the next rendezvous, so after it has read this one.
struct Rendezvous {
  int size = kWarp, arrived = 0;
  unsigned generation = 0;
  uint32_t words[2][kWarp][16];  // per generation parity, per lane: up to 16 words (an mma's fragments)
};

struct Block {
  Dim3 index, dim;
  std::vector<Fiber> fibers;
  std::vector<Rendezvous> warps;
  Rendezvous all;
  ucontext_t scheduler;
  int current = 0;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

inline int thread_id() { return block()->current; }

inline void yield() {
  Block* b = block();
  swapcontext(&b->fibers[b->current].context, &b->scheduler);
}

// Deposits n words at this thread's slot of rendezvous r, waits for the others; returns the generation's buffer.
inline uint32_t (*meet(Rendezvous& r, int slot, const uint32_t* words, int n))[16] {
  unsigned gen = r.generation;
  if (n) std::memcpy(r.words[gen & 1][slot], words, n * sizeof(uint32_t));  // a warp's lanes; barriers carry none
  if (++r.arrived == r.size) {
    r.arrived = 0;
    ++r.generation;
  } else {
    while (r.generation == gen) yield();
  }
  return r.words[gen & 1];
}

inline int lane() { return thread_id() % kWarp; }

inline uint32_t (*warp_meet(const uint32_t* words, int n))[16] {
  return meet(block()->warps[thread_id() / kWarp], lane(), words, n);
}

inline std::function<void()>*& launch_body() {
  static std::function<void()>* body = nullptr;
  return body;
}

inline void entry() {
  (*launch_body())();
  block()->fibers[block()->current].done = true;  // returning resumes the scheduler (uc_link)
}

// Runs `body` as a kernel: every block of `grid`, every thread of `dim` a fiber.
inline void launch(Dim3 grid, Dim3 dim, std::function<void()> body) {
  launch_body() = &body;
  int threads = dim.x * dim.y * dim.z;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.index = {x, y, z};
        b.dim = dim;
        b.fibers.resize(threads);
        b.warps.resize((threads + kWarp - 1) / kWarp);
        b.all.size = threads;
        block() = &b;
        for (int t = 0; t < threads; ++t) {
          Fiber& f = b.fibers[t];
          f.stack.resize(kStack);
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = f.stack.data();
          f.context.uc_stack.ss_size = f.stack.size();
          f.context.uc_link = &b.scheduler;
          makecontext(&f.context, entry, 0);
        }
        for (int running = threads; running;) {
          running = 0;
          for (int t = 0; t < threads; ++t) {
            if (b.fibers[t].done) continue;
            b.current = t;
            swapcontext(&b.scheduler, &b.fibers[t].context);
            running += !b.fibers[t].done;
          }
        }
        block() = nullptr;
      }
}

// IEEE half <-> double through the compiler's _Float16 (correctly rounded conversions).
inline uint16_t to_half(double x) {
  _Float16 h = static_cast<_Float16>(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

inline double from_half(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<double>(h);
}

template <class F>
inline uint32_t half2_map(uint32_t a, uint32_t b, uint32_t c, F f) {
  uint16_t lo = to_half(f(from_half(a & 0xFFFF), from_half(b & 0xFFFF), from_half(c & 0xFFFF)));
  uint16_t hi = to_half(f(from_half(a >> 16), from_half(b >> 16), from_half(c >> 16)));
  return lo | (uint32_t(hi) << 16);
}

}  // namespace emu

struct EmuIndex {
  unsigned x;
  unsigned y;
};

#define threadIdx (EmuIndex{unsigned(emu::thread_id()), 0u})
#define blockIdx (EmuIndex{emu::block()->index.x, emu::block()->index.y})

KIVI_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint8_t bytes[8];
  std::memcpy(bytes, &a, 4);
  std::memcpy(bytes + 4, &b, 4);
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) d |= uint32_t(bytes[(selector >> (4 * i)) & 7]) << (8 * i);
  return d;
}

KIVI_DEVICE uint32_t hsub2(uint32_t a, uint32_t b) {
  return emu::half2_map(a, b, 0, [](double x, double y, double) { return x - y; });
}

KIVI_DEVICE uint32_t hadd2(uint32_t a, uint32_t b) {
  return emu::half2_map(a, b, 0, [](double x, double y, double) { return x + y; });
}

KIVI_DEVICE uint32_t hmul2(uint32_t a, uint32_t b) {
  return emu::half2_map(a, b, 0, [](double x, double y, double) { return x * y; });
}

KIVI_DEVICE uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  return emu::half2_map(a, b, c, [](double x, double y, double z) { return x * y + z; });
}

KIVI_DEVICE uint32_t pack_half2(float lo, float hi) { return emu::to_half(lo) | (uint32_t(emu::to_half(hi)) << 16); }

KIVI_DEVICE uint16_t float_to_half(float x) { return emu::to_half(x); }

KIVI_DEVICE int opaque(int x) { return x; }

KIVI_DEVICE uint32_t max_u16x2(uint32_t a, uint32_t b) {
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | (std::max(a >> 16, b >> 16) << 16);
}

KIVI_DEVICE float fast_exp2(float x) { return std::exp2(x); }
KIVI_DEVICE float fast_log2(float x) { return std::log2(x); }
KIVI_DEVICE float fast_rcp(float x) { return 1.f / x; }

KIVI_DEVICE uint32_t shfl(uint32_t v, int src) { return emu::warp_meet(&v, 1)[src & 31][0]; }

KIVI_DEVICE float shfl(float v, int src) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = shfl(u, src);
  std::memcpy(&v, &u, 4);
  return v;
}

KIVI_DEVICE float shfl_xor(float v, int mask) { return shfl(v, emu::lane() ^ mask); }

KIVI_DEVICE bool warp_any(bool p) {
  uint32_t v = p;
  auto all = emu::warp_meet(&v, 1);
  for (int i = 0; i < emu::kWarp; ++i)
    if (all[i][0]) return true;
  return false;
}

KIVI_DEVICE uint32_t warp_max(uint32_t v) {
  auto all = emu::warp_meet(&v, 1);
  uint32_t top = 0;
  for (int i = 0; i < emu::kWarp; ++i) top = std::max(top, all[i][0]);
  return top;
}

KIVI_DEVICE void sync_block() {
  uint32_t none = 0;
  emu::meet(emu::block()->all, emu::thread_id(), &none, 0);
}

// Asynchronous copies complete at once here. Their addresses must be aligned to their size, as on the GPU
// (which faults with "misaligned address"): here the test process stops with the copy's addresses.
inline void check_aligned(const void* shared, const void* global, unsigned size) {
  if ((reinterpret_cast<uintptr_t>(shared) | reinterpret_cast<uintptr_t>(global)) % size) {
    std::fprintf(stderr, "misaligned %u-byte copy: shared %p, global %p\n", size, shared, global);
    std::abort();
  }
}
KIVI_DEVICE void copy16(void* shared, const void* global, int bytes) {
  check_aligned(shared, global, 16);
  std::memset(shared, 0, 16);
  if (bytes) std::memcpy(shared, global, bytes);
}
KIVI_DEVICE void copy8(void* shared, const void* global) {
  check_aligned(shared, global, 8);
  std::memcpy(shared, global, 8);
}
KIVI_DEVICE void prefetch_line(const void*) {}
KIVI_DEVICE void copy_commit() {}
template <int pending>
KIVI_DEVICE void copy_wait() {}
KIVI_DEVICE void sync_warp() {
  uint32_t none = 0;
  emu::warp_meet(&none, 0);
}

KIVI_DEVICE void* dynamic_shared() {
  alignas(16) static char memory[256 * 1024];
  return memory;
}

// d += a (16x16, row) * b (16x8, col): fragments as mma.sync.m16n8k16.row.col.f32.f16.f16.f32 lays them out.
KIVI_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  uint32_t words[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  auto frags = emu::warp_meet(words, 6);
  auto half_of = [](uint32_t w, int hi) { return emu::from_half(hi ? w >> 16 : w & 0xFFFF); };
  auto A = [&](int row, int k) { return half_of(frags[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2); };
  auto B = [&](int k, int col) { return half_of(frags[col * 4 + (k % 8) / 2][4 + k / 8], k % 2); };
  int g = emu::lane() / 4, t = emu::lane() % 4;
  for (int i = 0; i < 4; ++i) {
    int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    double sum = d[i];
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    d[i] = float(sum);
  }
}
