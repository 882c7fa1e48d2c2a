// Fused KIVI decode attention in CUDA C++: one query token per sequence over a KIVI cache in the layout of
// kivi/quant.py (keys grouped along tokens, values along channels, int32 words, fp16 scales and zeros), one
// softmax over quantized and full-precision tokens. The GPU fast path of kivi/kernels/cuda_decode.py; the Triton
// kernel of kivi/kernels/decode_attention.py computes the same function and serves every case this one refuses.
//
// Work: a block of W warps (2 or 4, or 8 where shared memory holds their stages: short contexts of few sequences)
// per (sequence, KV head, split); each warp takes units of 2 key groups (64 tokens) in turn, keeps its own online
// softmax, and the block merges its warps at the end (splits > 1: partial results and log-sum-exps, merged by
// kivi.kernels._triton.merge_splits).
//
// Products on the tensor cores (mma m16n8k16, fp16 operands, fp32 accumulators), all query heads of a KV head
// (up to 8) in one product's N columns:
// - keys, S^T = K Q^T: rows are the 32 tokens of one key group (two products of 16), so one scale per channel
//   serves the whole product. The codes are the left operand, exact: each masked where it lies in its byte, read
//   as an fp16 subnormal (code * 2^(BITS * pos - 24)); the right operand is q * s (per channel) split into two
//   fp16 parts, hi and lo, in columns (head, part): near-fp32 logits (rounding q * s alone to fp16 errs by 2e-3 on
//   keys with outlier channels). The zero terms q . z of a unit's two groups are one product (zero points
//   in rows, exact, against -q), added once the codes' rows are scaled back. Full-precision keys are the left
//   operand as stored, against q (exact) in the hi columns.
//   Rows g and g + 8 of a group's product jj, which one lane holds, are tokens 4 g + 2 jj and the next: a lane's
//   four tokens of the group are one byte of each channel's word (two bytes at 4 bits), so a byte permute of two
//   words (two channels) serves both products, and one mask per register gives the operand.
// - values, O^T = V^T P^T: columns the heads, K the 16 tokens of one key product, in its row order, so the
//   probabilities move from the key products' accumulators to the value products' right operand by two shuffles.
//   Product 2 G + h holds 16 channels of value group G: row g is channel 32 G + 4 g + 2 h, row g + 8 the next one,
//   so a lane's 4 channels of a group are adjacent (at 2 bits the 4 codes of one byte). One scale per (token,
//   group) lets the right operand be p * s, and the codes stay in place as the keys' do (each row scaled back once,
//   at the end); the zero terms p . z of all groups are one more product per key product (rows: groups), kept
//   apart and added at the end. Full-precision values are the left operand as stored, against p.
// The query and the key products work in raw units (q . k); qk_scale (with log2 e) is applied in fp32 after.
// Probabilities and their sums carry a factor 2^bits (Softmax), the output and log-sum-exp do not.
// Each warp copies its next unit's codes, scales and zeros into shared memory (cp.async) while it computes the
// current one, so a unit waits for its loads once (with one split the first unit's copies start before the sequence's
// counts arrive); full-precision keys and values are read from global memory where they are used, a group's keys all
// at once (kRowsAhead), its values too where registers allow (kValuesAhead).
#include "warp.cuh"

#ifndef KIVI_EMULATE
#include <cuda_runtime.h>
#endif

#include <cmath>

// Mirrored by kivi/kernels/cuda_decode.py (_Args): same fields, same order. Outside the anonymous namespace:
// the entry point's parameter type must have external linkage for the symbol to be exported.
struct Args {
  const uint16_t* q;  // [B, Hq, D] fp16, strides stride_qb, stride_qh, 1
  void* out;          // splits == 1: [B, Hq, D] fp16 or fp32 (out_f32), strides stride_ob, stride_oh, 1
  float* part;        // splits > 1: fp32 [B, Hq, splits, D], each split normalized by its own sum
  float* lse;         // splits > 1: fp32 [B, Hq, splits], log2 of each split's sum of 2^logits (-inf: no token)
  const uint32_t* kc;  // [B, Hkv, kc_rows, D] key codes (tokens w * cpw .. of channel d in word (w, d))
  const uint16_t* ks;  // [B, Hkv, ks_rows, D] key scales, one per (group of 32 tokens, channel)
  const uint16_t* kz;
  const uint16_t* kr;  // [B, Hkv, kr_rows, D] key residual: position n_qk + i at row i
  const uint32_t* vc;  // [B, Hkv, vc_rows, D / cpw] value codes (channels w * cpw .. of token t in word (t, w))
  const uint16_t* vs;  // [B, Hkv, vc_rows, D / 32] value scales, one per (token, group of 32 channels)
  const uint16_t* vz;
  const uint16_t* vr;  // [B, Hkv, vr_rows, D] value residual: position n_qv + i at row i, or (ring) at row p % vr_rows
  const int32_t* counts;  // int32 [4, B]: sinks (0), quantized keys, quantized values, tokens
  int batch, kv_heads, q_heads, splits, warps;  // warps per block: 2, 4 or 8 (kivi_decode_shared_bytes)
  float qk_scale;  // softmax scale * log2(e)
  float cap;       // soft-capping threshold in log2 units; 0: none
  int64_t stride_qb, stride_qh, stride_ob, stride_oh;
  int kc_rows, ks_rows, kr_rows, vc_rows, vr_rows;
  int ring, out_f32;
};

namespace {

constexpr int kGroup = 32;       // tokens of a key group, channels of a value group
// Warps per block: 2 or 4 (every layout) or 8. 16 would cap a thread at 128 registers: the 2-bit head_dim 128 kernel of
// two column tiles spilled there.
constexpr int kMaxWarps = 8;
// The most dynamic shared memory any device gives a block (compute capability 9.0): no kernel beyond it is built;
// kivi/kernels/cuda_decode.py checks the device's own limit.
constexpr int kSharedLimit = 227 * 1024;
constexpr int kUnitGroups = 2;   // key groups a warp takes at a time (one softmax update where plain)
constexpr uint32_t kMinusOne = 0xBC00BC00u;  // -1, -1 as fp16
// The largest factor 2^bits the probabilities take (Softmax): 2^15 and p * s of fp16 scales below 1 stay in fp16.
constexpr int kMaxProbabilityBits = 15;

#ifdef KIVI_EMULATE
struct uint2 {
  uint32_t x, y;
};
struct uint4 {
  uint32_t x, y, z, w;
};
#endif

template <class T>
KIVI_DEVICE T load(const void* p) {
  return *reinterpret_cast<const T*>(p);
}

// code bits (keys and values), head size, key products' column tiles (heads / 4), warps per block
template <int BITS, int D, int NT, int W>
struct Decode {
  static constexpr int kCpw = 32 / BITS;                // codes per word
  static constexpr int kCodesPerByte = 8 / BITS;
  static constexpr int kRowsPerGroup = kGroup / kCpw;   // key word rows per key group
  static constexpr int kSteps = D / 16;                 // K steps of a key product
  static constexpr int kValueWords = D / kCpw;          // value words per token
  static constexpr int kValueTiles = D / 16;            // value products (16 channels each, 2 per value group)
  static constexpr int kValueGroups = D / kGroup;
  static constexpr int kGroupWords = kGroup / kCpw;     // value words per (token, value group)
  static constexpr int kUnitTokens = kUnitGroups * kGroup;
  // Key products of a group whose full-precision keys are loaded together, before any is used: both at head_dim
  // 128 (64 registers a lane: one wait where there were two), one at a time at 256.
  static constexpr int kRowsAhead = D <= 128 ? 2 : 1;
  // Full-precision values of both key products of a group loaded before the softmax, with the keys' wait behind
  // them, where a block of 8 warps (one block a multiprocessor) spares their 64 registers a lane; elsewhere 4 value
  // groups at a time, where they are used (loaded ahead at 4 warps, 2-bit MHA took 171 registers, not 126: a block
  // less a multiprocessor).
  static constexpr bool kValuesAhead = W == 8 && D <= 128;
  static constexpr int kValueChunk = kValueGroups < 4 ? kValueGroups : 4;
  static constexpr uint32_t kCodeMask = ((1u << BITS) - 1) * 0x10001u;
  static_assert(D % kGroup == 0 && kValueGroups <= 8 && kValueGroups % 2 == 0,
                "value groups in pairs of scales, and one row of the zero terms' product each");

  // One unit's quantized data in shared memory, laid out as in global memory: each warp copies the next unit's
  // (cp.async) while it computes this one, so a unit waits for its loads once, not at every product.
  struct Stage {
    uint32_t kc[kUnitGroups * kRowsPerGroup * D];
    uint16_t ks[kUnitGroups * D], kz[kUnitGroups * D];
    uint32_t vc[kUnitTokens * kValueWords];  // rows: value_row
    uint16_t vs[kUnitTokens * kValueGroups], vz[kUnitTokens * kValueGroups];
  };
  // The block's merge of its warps, in the same shared memory once every warp is done. o[w][head] holds channel c at
  // merge_column(head, c).
  struct Merge {
    float o[W][8][D], zero[W][8][kValueGroups], m[W][8], l[W][8];
  };
  // A warp's store of one accumulator register puts lane (g, t)'s value at channel 4 g + const of head 2 t (or
  // 2 t + 1): with rows of D floats the four t share a bank (a 4-way conflict). XOR with head / 2 % 4 (t) spreads
  // them over the 4 banks of each 4 g; the outputs' loop reads a head's 32 consecutive channels, permuted within
  // runs of 4: no conflict either.
  static KIVI_DEVICE int merge_column(int head, int c) { return c ^ (head / 2 % 4); }
  static constexpr int kSharedBytes =
      int(sizeof(Stage)) * 2 * W > int(sizeof(Merge)) ? int(sizeof(Stage)) * 2 * W : int(sizeof(Merge));

  // Token (within the sequence) of row r of key product jj of a group: rows g and g + 8 are tokens 4 g + 2 jj and
  // the next, so a lane's four tokens of a group are the four codes of one byte of each channel's word (2 bits; two
  // bytes at 4): one byte permute serves two products.
  static KIVI_DEVICE int token(int group, int jj, int r) { return kGroup * group + 4 * (r & 7) + 2 * jj + (r >> 3); }

  // Place of key product jj's row g (r = 0) or g + 8 (r = 1) in its byte, the mask of that code in both halves of
  // a byte pair, and what one unit of it reads as in fp16 (2^(BITS * pos - 24)).
  static KIVI_DEVICE constexpr int key_pos(int jj, int r) { return (2 * jj + r) % kCodesPerByte; }
  static KIVI_DEVICE constexpr uint32_t key_mask(int jj, int r) { return kCodeMask << (BITS * key_pos(jj, r)); }
  static KIVI_DEVICE constexpr float key_scale(int jj, int r) { return float(1u << (24 - BITS * key_pos(jj, r))); }

  // Row of a unit's token T in its stage's value codes, scales and zeros: a group's 32 rows transposed as 8 x 4. A
  // value product's four lanes t read tokens kGroup i + 8 t + c (token): rows 8 t apart (of 8 words, at 2 bits)
  // would share one bank, rows kGroup i + 4 c + t take four, and a lane's rows of a group lie at fixed distances.
  static KIVI_HOST_DEVICE constexpr int value_row(int T) { return T / kGroup * kGroup + 4 * (T % 8) + T / 8 % 4; }

  // Byte `byte` of x in the low half, of y in the high half (each duplicated in its half's upper byte). Masked to
  // one code, a pair is an operand register: the code stays where it lies in its byte, at bit BITS * pos, and
  // read as fp16 the pair is code * 2^(BITS * pos) * 2^-24 (a subnormal, exact; the tensor cores take subnormal
  // operands), so each row of a product is scaled by a power of two undone once (keys: per group; values: at the
  // end), with no shift, no magic-number subtraction and no dequantizing per pair.
  static KIVI_DEVICE uint32_t byte_pair(uint32_t x, uint32_t y, int byte) { return prmt(x, y, 0x4400u + 0x1111u * byte); }

  // The mask of code j of the lane's 4 adjacent value channels in their byte.
  static KIVI_DEVICE constexpr uint32_t value_mask(int j) { return kCodeMask << (BITS * (j % kCodesPerByte)); }
  // What one unit of code j's pair reads as in fp16 (2^(BITS * pos - 24)): the value rows' accumulators hold
  // code units until the end.
  static KIVI_DEVICE constexpr float code_unit(int j) { return 1.f / float(1u << (24 - BITS * (j % kCodesPerByte))); }

  // n 32-bit words at p into out (zeros unless `read`), in one shared-memory load.
  template <int n>
  static KIVI_DEVICE void load_words(uint32_t (&out)[n], const uint16_t* p, bool read) {
    static_assert(n == 2 || n == 4, "8 or 16 bytes");
    if constexpr (n == 2) {
      const uint2 x = read ? load<uint2>(p) : uint2{0, 0};
      out[0] = x.x, out[1] = x.y;
    } else {
      const uint4 x = read ? load<uint4>(p) : uint4{0, 0, 0, 0};
      out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
    }
  }

  // fp16 pair (q * s) as its hi or lo part: hi = fp16(q * s), lo = fp16(q * s - hi), exact for fp16 q and s.
  // lo: -1 in the lanes of lo parts, else 0 (q * s - 0 is hi). Three fp16 instructions and no select: a -q kept
  // per lane instead (two instructions) was rematerialized in the loop, one ALU instruction per register.
  static KIVI_DEVICE uint32_t part(uint32_t q, uint32_t lo, uint32_t s) { return hfma2(q, s, hmul2(hmul2(q, s), lo)); }

  // A warp's value accumulators: o[2 G + h] the value products' (code units, scaled back at the end), zero the
  // zero terms' (row g: group g; true units). Columns: heads 2t, 2t + 1.
  struct Output {
    float o[kValueTiles][4], zero[4];
  };

  // A warp's online softmax: m the running maximum of head 4 nt + t (log2 units), l its sum of probabilities, each
  // 2^(x - m + bits), not 2^(x - m): p * s (an fp16 operand) of small value scales would fall among fp16's
  // subnormals otherwise (tools.decode_precision, values 1e-4 as large: 2.4e-2 relative error without the factor,
  // 1.3e-4 with it). bits is lowered, never raised, so that p * s of the largest value scale yet seen stays below
  // 2^15 (a fixed factor overflows for large scales: 2^15 above 2).
  struct Softmax {
    float m[NT], l[NT];
    int bits;
  };

  // The query as the key products' right operand (see run), and lo (part): -1 in the lanes of lo parts, else 0.
  struct Query {
    uint32_t q[NT][kSteps][2], lo;
  };

  struct Sequence {
    const uint32_t* kc;
    const uint16_t *ks, *kz, *kr;
    const uint32_t* vc;
    const uint16_t *vs, *vz, *vr;
    int n_qk, n_qv, n_tok, vc_rows, vr_rows;
    bool ring;
  };

  // Token T's row in the key residual, and in the value residual (or its ring): T at or past n_qk, n_qv.
  static KIVI_DEVICE const uint16_t* full_key(const Sequence& s, int T) { return s.kr + int64_t(T - s.n_qk) * D; }
  static KIVI_DEVICE const uint16_t* full_value(const Sequence& s, int T) {
    return s.vr + int64_t(s.ring ? T % s.vr_rows : T - s.n_qv) * D;
  }
  // Token T's value is full precision (in the residual, and in the sequence).
  static KIVI_DEVICE bool value_is_full(const Sequence& s, int T) { return T >= s.n_qv && T < s.n_tok; }

  // Unit u holds no full-precision key or value: every unit of a sequence but its last two or three.
  static KIVI_DEVICE bool plain(const Sequence& s, int u) { return (u + 1) * kUnitTokens <= min(s.n_qk, s.n_qv); }

  // Start copying unit u's quantized data into `st`.
  static KIVI_DEVICE void stage(const Sequence& s, int u, Stage& st, int lane) {
    if (plain(s, u))
      stage_plain(s, u, st, lane);
    else
      stage_partial(s, u, st, lane);
  }

  // A plain unit's data is six contiguous runs of whole pieces: no bounds. The value scales and zeros go in
  // pieces of 8 bytes: a sequence's rows of them start at 8 * vc_rows bytes (head_dim 128), 16-byte aligned only
  // for even vc_rows (a cache of 895 quantized values holds 895 rows).
  static KIVI_DEVICE void stage_plain(const Sequence& s, int u, Stage& st, int lane) {
    copy_run<sizeof(st.kc), 16>(st.kc, s.kc, u, lane);
    copy_run<sizeof(st.ks), 16>(st.ks, s.ks, u, lane);
    copy_run<sizeof(st.kz), 16>(st.kz, s.kz, u, lane);
    copy_run<sizeof(st.vc), 16, kValueWords * 4>(st.vc, s.vc, u, lane);
    copy_run<sizeof(st.vs), 8, kValueGroups * 2>(st.vs, s.vs, u, lane);
    copy_run<sizeof(st.vz), 8, kValueGroups * 2>(st.vz, s.vz, u, lane);
  }

  // Unit u's run of kBytes (its stage's share, as laid out in global memory from `run`): kRowBytes, a unit's value
  // rows of that size, each copied to its value_row; 0, copied as it lies. A lane's pieces lie at fixed distances
  // from its first in both places, so each copy is the lane's two addresses plus constants: computed piece by piece
  // from element indices, the addresses took 137 instructions a plain unit (2-bit MHA), now 70.
  template <int kBytes, int kPiece, int kRowBytes = 0>
  static KIVI_DEVICE void copy_run(void* to, const void* run, int u, int lane) {
    static_assert(kBytes % (32 * kPiece) == 0, "whole pieces for every lane");
    static_assert(fixed_distances<kBytes, kPiece, kRowBytes>(), "a lane's pieces at fixed distances in the stage");
    char* shared = static_cast<char*>(to) + stage_offset<kRowBytes>(kPiece * lane);
    const char* global = static_cast<const char*>(run) + int64_t(u) * kBytes + kPiece * lane;
#pragma unroll
    for (int k = 0; k < kBytes / (32 * kPiece); ++k) {
      char* to_k = shared + stage_offset<kRowBytes>(32 * kPiece * k);
      if constexpr (kPiece == 16)
        copy16(to_k, global + 32 * kPiece * k, 16);
      else
        copy8(to_k, global + 32 * kPiece * k);
    }
  }

  // Where byte `at` of a run lies in its stage: in a unit's value rows of kRowBytes, at its value_row; else (0) as
  // it lies.
  template <int kRowBytes>
  static KIVI_HOST_DEVICE constexpr int stage_offset(int at) {
    if constexpr (kRowBytes == 0)
      return at;
    else
      return value_row(at / kRowBytes) * kRowBytes + at % kRowBytes;
  }

  // Whether every lane's k-th piece of a run lies at its first plus the k-th piece of lane 0, in the stage as in
  // global memory.
  template <int kBytes, int kPiece, int kRowBytes>
  static KIVI_HOST_DEVICE constexpr bool fixed_distances() {
    for (int lane = 0; lane < 32; ++lane)
      for (int k = 0; k < kBytes / (32 * kPiece); ++k)
        if (stage_offset<kRowBytes>(kPiece * (32 * k + lane)) !=
            stage_offset<kRowBytes>(kPiece * lane) + stage_offset<kRowBytes>(32 * kPiece * k))
          return false;
    return true;
  }

  // A unit with full-precision rows: the key groups that are quantized, the values of tokens below n_qv (codes in
  // 16-byte pieces, scales and zeros in 8-byte ones; what lies past n_qv, or past the buffer, is not read); its
  // full-precision rows, read where they are used, start towards L2.
  static KIVI_DEVICE void stage_partial(const Sequence& s, int u, Stage& st, int lane) {
    prefetch_full(s, u, lane);
#pragma unroll
    for (int i = 0; i < kUnitGroups; ++i) {
      const int group = kUnitGroups * u + i;
      if ((group + 1) * kGroup > s.n_qk) continue;
      const uint32_t* words = s.kc + int64_t(kRowsPerGroup * group) * D;
      for (int c = lane; c < kRowsPerGroup * D / 4; c += 32) copy16(st.kc + i * kRowsPerGroup * D + 4 * c, words + 4 * c, 16);
      for (int c = lane; c < D / 8; c += 32) {
        copy16(st.ks + i * D + 8 * c, s.ks + int64_t(group) * D + 8 * c, 16);
        copy16(st.kz + i * D + 8 * c, s.kz + int64_t(group) * D + 8 * c, 16);
      }
    }
    const int first = kUnitTokens * u;
    if (first >= s.n_qv) return;
    const int64_t words = int64_t(first) * kValueWords, words_end = int64_t(s.vc_rows) * kValueWords;
    for (int c = lane; c < kUnitTokens * kValueWords / 4; c += 32) {
      const bool quantized = first + 4 * c / kValueWords < s.n_qv;
      copy16(reinterpret_cast<char*>(st.vc) + stage_offset<kValueWords * 4>(16 * c), s.vc + (quantized ? words + 4 * c : 0),
             quantized ? piece(words + 4 * c, words_end, 4) : 0);
    }
    const int64_t stats = int64_t(first) * kValueGroups;
    for (int c = lane; c < kUnitTokens * kValueGroups / 4; c += 32) {  // pieces of 8 bytes (see stage_plain)
      if (first + 4 * c / kValueGroups >= s.n_qv) continue;  // not read: the values' selects skip those tokens
      const int at = stage_offset<kValueGroups * 2>(8 * c);
      copy8(reinterpret_cast<char*>(st.vs) + at, s.vs + stats + 4 * c);
      copy8(reinterpret_cast<char*>(st.vz) + at, s.vz + stats + 4 * c);
    }
  }

  // Starts unit u's full-precision keys and values towards L2 while the unit before is computed: they are read where
  // they are used, not staged, and would otherwise come from memory at that point.
  static KIVI_DEVICE void prefetch_full(const Sequence& s, int u, int lane) {
    const int end = min(kUnitTokens * (u + 1), s.n_tok);
#pragma unroll 1
    for (int T = kUnitTokens * u + lane; T < end; T += 32) {
      const uint16_t *key = full_key(s, T), *value = full_value(s, T);
#pragma unroll
      for (int line = 0; line < D; line += 64) {  // 64 elements: a 128-byte line
        if (T >= s.n_qk) prefetch_line(key + line);
        if (T >= s.n_qv) prefetch_line(value + line);
      }
    }
  }

  // Bytes of the 16-byte piece at element `at` that lie before element `end` (elements of `size` bytes).
  static KIVI_DEVICE int piece(int64_t at, int64_t end, int size) {
    const int64_t bytes = (end - at) * size;
    return bytes >= 16 ? 16 : bytes > 0 ? int(bytes) : 0;
  }

  // Raw logits q . k of the group's 32 tokens: out[jj][nt][r] for rows g (r = 0) and g + 8 (r = 1) of product jj,
  // head 4 nt + t, where lane = 4 g + t. kPlain: the group is quantized (no test, no full-precision path).
  template <bool kPlain>
  static KIVI_DEVICE void group_logits(const Sequence& s, const Stage& st, const Query& q, const float (&zero)[NT][4],
                                       int u, int i, int g, int t, float (&out)[2][NT][2]) {
    const int group = kUnitGroups * u + i;
    if (kPlain || (group + 1) * kGroup <= s.n_qk) {  // a quantized key group, staged
      float acc[2][NT][4] = {};
      // The lane's tokens 4 g .. 4 g + 3 (token): one word row, and in it byte `first` (2 bits), or `first` and the
      // next (4 bits: product jj's two tokens in byte first + jj).
      const uint32_t* words = st.kc + (kRowsPerGroup * i + 4 * g / kCpw) * D + 4 * t;
      const uint16_t* scale = st.ks + i * D + 4 * t;
      const int first = 4 * g % kCpw / kCodesPerByte;
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        const uint4 w = load<uint4>(words + 16 * k);
        const uint2 sc = load<uint2>(scale + 16 * k);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          // rows g and g + 8 of channels 4t, 4t+1 (registers 0, 1) and 4t+2, 4t+3 (2, 3)
          const int byte = first + 2 * jj / kCodesPerByte;
          const uint32_t xy = byte_pair(w.x, w.y, byte), zw = byte_pair(w.z, w.w, byte);
          const uint32_t a[4] = {xy & key_mask(jj, 0), xy & key_mask(jj, 1), zw & key_mask(jj, 0), zw & key_mask(jj, 1)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint32_t bs[2] = {part(q.q[nt][k][0], q.lo, sc.x), part(q.q[nt][k][1], q.lo, sc.y)};
            mma_16816(acc[jj][nt], a, bs);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float zero_term = shfl(zero[nt][1], 4 * i + t);  // q . z of the group, from row i of `zero`
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {  // each row's scale undoes its codes' place and the subnormal's 2^-24
          out[jj][nt][0] = (acc[jj][nt][0] + acc[jj][nt][1]) * key_scale(jj, 0) + zero_term;
          out[jj][nt][1] = (acc[jj][nt][2] + acc[jj][nt][3]) * key_scale(jj, 1) + zero_term;
        }
      }
      return;
    }
    if constexpr (!kPlain) {  // full-precision keys: the residual (tokens past n_tok read nothing)
      float acc[2][NT][4] = {};
#pragma unroll
      for (int first = 0; first < 2; first += kRowsAhead) {
        uint2 x[kRowsAhead][2][kSteps];  // rows g and g + 8: every load first, one wait for kRowsAhead products
#pragma unroll
        for (int j = 0; j < kRowsAhead; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int T = token(group, first + j, g + 8 * r);
            const uint16_t* row = full_key(s, T) + 4 * t;
#pragma unroll
            for (int k = 0; k < kSteps; ++k) x[j][r][k] = T < s.n_tok ? load<uint2>(row + 16 * k) : uint2{0, 0};
          }
#pragma unroll
        for (int j = 0; j < kRowsAhead; ++j)
#pragma unroll
          for (int k = 0; k < kSteps; ++k) {
            const uint32_t a[4] = {x[j][0][k].x, x[j][1][k].x, x[j][0][k].y, x[j][1][k].y};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint32_t bq[2] = {g & 1 ? 0u : q.q[nt][k][0], g & 1 ? 0u : q.q[nt][k][1]};
              mma_16816(acc[first + j][nt], a, bq);
            }
          }
      }
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          out[jj][nt][0] = acc[jj][nt][0] + acc[jj][nt][1];
          out[jj][nt][1] = acc[jj][nt][2] + acc[jj][nt][3];
        }
    }
  }

  // The full-precision values of the lane's four K columns of key product jj of a group (tokens value_token),
  // channels 4 g .. 4 g + 3 of n value groups; zeros for tokens quantized or past the sequence.
  template <int n>
  struct ValueRows {
    uint2 x[4][n];
  };

  // Token of the lane's K column e of key product jj (rows 2t + d of the key product, d = 0, 1, 8, 9).
  static KIVI_DEVICE int value_token(int group, int jj, int t, int e) {
    constexpr int kColumns[4] = {0, 1, 8, 9};
    return token(group, jj, 2 * t + kColumns[e]);
  }

  // Starts loading ValueRows of value groups first .. first + n - 1: every load before any use, one wait.
  template <int n>
  static KIVI_DEVICE void load_value_rows(const Sequence& s, int group, int jj, int g, int t, int first,
                                          ValueRows<n>& rows) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int T = value_token(group, jj, t, e);
      const bool full = value_is_full(s, T);
      const uint16_t* v = full_value(s, T) + 4 * g + kGroup * first;
#pragma unroll
      for (int c = 0; c < n; ++c) rows.x[e][c] = full ? load<uint2>(v + kGroup * c) : uint2{0, 0};
    }
  }

  // acc += the products of ValueRows of value groups first .. first + n - 1 against bp (p of the key product's
  // tokens, as group_values takes it), in units of their own, each result scaled to the codes' units.
  template <int n>
  static KIVI_DEVICE void add_value_rows(const ValueRows<n>& rows, int first, const uint32_t (&bp)[2], Output& acc) {
#pragma unroll
    for (int c = 0; c < n; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2(&x)[4][n] = rows.x;
        const uint32_t y[4] = {h ? x[0][c].y : x[0][c].x, h ? x[1][c].y : x[1][c].x, h ? x[2][c].y : x[2][c].x,
                               h ? x[3][c].y : x[3][c].x};
        const uint32_t a[4] = {prmt(y[0], y[1], 0x5410), prmt(y[0], y[1], 0x7632), prmt(y[2], y[3], 0x5410),
                               prmt(y[2], y[3], 0x7632)};
        float f[4] = {};
        mma_16816(f, a, bp);
        float(&o)[4] = acc.o[2 * (first + c) + h];
        o[0] += f[0] * code_unit(2 * h), o[1] += f[1] * code_unit(2 * h);
        o[2] += f[2] * code_unit(2 * h + 1), o[3] += f[3] * code_unit(2 * h + 1);
      }
  }

  // acc += V^T P^T over the 16 tokens of key product jj of a group; p: the probabilities of the lane's rows g and
  // g + 8 for head 4 nt + t, as fp16 pairs. kPlain: every value of the unit is quantized.
  template <bool kPlain>
  static KIVI_DEVICE void group_values(const Sequence& s, const Stage& st, const uint32_t (&p)[NT], int u, int group,
                                       int jj, int g, int t, const ValueRows<kValueGroups>& ahead, Output& acc) {
    // Right operand: P^T rows (tokens) 2t, 2t+1, 2t+8, 2t+9, column g (head g): from the lanes holding those key
    // rows (4 (2t) + head % 4 and the next group) for head g's column tile.
    const int src = 8 * t + g % 4;
    uint32_t pa = 0, pb = 0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint32_t xa = shfl(p[nt], src), xb = shfl(p[nt], src + 4);
      if (g / 4 == nt) pa = xa, pb = xb;
    }
    const uint32_t bp[2] = {prmt(pa, pb, 0x5410), prmt(pa, pb, 0x7632)};

    // The lane's K columns are rows 2t + d of the key product, d = 0, 1 (pair 0) and 8, 9 (pair 1): tokens
    // kGroup group + 8 t + c, c = value_token(0, jj, 0, e) < 8. Their stage rows (value_row) written out, one base
    // and constants: the compiler cannot see that (T / 8) % 4 is t.
    const int base = kGroup * (group % kUnitGroups) + t;
    int tok[4], row[4];
    bool quant[4], full[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      tok[e] = value_token(group, jj, t, e);
      row[e] = base + 4 * value_token(0, jj, 0, e);
      quant[e] = kPlain || tok[e] < s.n_qv;
      full[e] = value_is_full(s, tok[e]);
    }
    if (kPlain || warp_any(quant[0] || quant[1] || quant[2] || quant[3])) {
      // Quantized tokens (the others read as zero codes, scales and zeros): per value group, p * s as the right
      // operand and the codes in place as the left.
      uint32_t scales[4][kValueGroups / 2], zeros[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        load_words(scales[e], st.vs + row[e] * kValueGroups, quant[e]);
        zeros[e] = quant[e] ? st.vz[row[e] * kValueGroups + g % kValueGroups] : 0u;
      }
      const uint32_t az[4] = {prmt(zeros[0], zeros[1], 0x5410), 0u, prmt(zeros[2], zeros[3], 0x5410), 0u};
      mma_16816(acc.zero, az, bp);  // row g: group g's zero points
#pragma unroll
      for (int vg = 0; vg < kValueGroups; ++vg) {
        const uint32_t sel = vg % 2 ? 0x7632 : 0x5410;
        const uint32_t b[2] = {hmul2(bp[0], prmt(scales[0][vg / 2], scales[1][vg / 2], sel)),
                               hmul2(bp[1], prmt(scales[2][vg / 2], scales[3][vg / 2], sel))};
        uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          w[e] = quant[e] ? st.vc[row[e] * kValueWords + kGroupWords * vg + 4 * g / kCpw] : 0u;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // product 2 vg + h: the lane's channels 2h (row g) and 2h + 1 (row g + 8)
          const int byte = (4 * g + 2 * h) % kCpw * BITS / 8;
          const uint32_t lo = byte_pair(w[0], w[1], byte), hi = byte_pair(w[2], w[3], byte);
          const uint32_t a[4] = {lo & value_mask(2 * h), lo & value_mask(2 * h + 1), hi & value_mask(2 * h),
                                 hi & value_mask(2 * h + 1)};
          mma_16816(acc.o[2 * vg + h], a, b);
        }
      }
    }
    if (!kPlain && warp_any(full[0] || full[1] || full[2] || full[3])) {  // full-precision values against p
      if constexpr (kValuesAhead) {
        add_value_rows(ahead, 0, bp, acc);
      } else {
#pragma unroll
        for (int first = 0; first < kValueGroups; first += kValueChunk) {
          ValueRows<kValueChunk> rows;
          load_value_rows(s, group, jj, g, t, first, rows);
          add_value_rows(rows, first, bp, acc);
        }
      }
    }
  }

  // cap * tanh(x / cap) in log2 units (soft-capping). The reciprocal approximate: an IEEE division's slow path
  // (a call) and the branch around it made the capped logits four branches a group, capped or not.
  static KIVI_DEVICE float soft_cap(float x, float cap) {
    return cap - 2.f * cap * fast_rcp(1.f + fast_exp2(x * (2.f * 1.4426950408889634f / cap)));
  }

  // f(logit, jj, r) for each of a group's logits (group_logits' out).
  template <class F>
  static KIVI_DEVICE void for_logits(float (&x)[2][NT][2], F&& f) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) f(x[jj][nt][r], jj, r);
  }

  // A key group's logits: x[jj][nt][r] for rows g (r = 0) and g + 8 (r = 1) of product jj, head 4 nt + t.
  struct Logits {
    float x[2][NT][2];
  };
  // A key group's probabilities, the values' operand (group_values' p): p[jj][nt] the fp16 pair of rows g and g + 8
  // of product jj, head 4 nt + t.
  struct Probabilities {
    uint32_t p[2][NT];
  };

  // Unit u (its quantized data staged in st) into the warp's online softmax m, l and accumulators o. kPlain: every
  // key and value of the unit is quantized (so every token is in the sequence): the common case, with no test per
  // token and no full-precision path in its code, and one softmax update for both key groups (their logits, the
  // update, their values), not one a group: a unit's maximum, rescaling and sums once, not twice (Qwen2.5-1.5B's
  // shape at B = 256 18% faster on the H100, BENCHMARKS.md). A unit with full-precision rows (the last two or three
  // of a sequence) goes a key group at a time: its full-precision values, loaded ahead of the softmax, overlap it,
  // and the registers of a second group's logits would spill its two-tile head_dim-256 kernels. Both loops over the
  // groups stay rolled, so the code a warp runs is a group's products, not a unit's (a unit unrolled was fetched
  // from further than the instruction cache): a group's logits and probabilities move along as the next group's
  // are made.
  template <bool kPlain>
  static KIVI_DEVICE void unit(const Args& a, const Sequence& s, const Stage& st, const Query& q,
                               int u, int g, int t, Softmax& sm, Output& acc) {
    static_assert(kUnitGroups == 2, "a unit's key groups: the first and the last");
    float zero[NT][4] = {};
    zero_terms(st, q, g, t, zero);
    const int bits = min(sm.bits, probability_bits<kPlain>(s, st, u, 4 * g + t));
    if constexpr (kPlain) {
      Logits first, last;
#pragma unroll 1
      for (int i = 0; i < kUnitGroups; ++i) {
        first = last;
        group_logits<true>(s, st, q, zero, u, i, g, t, last.x);
      }
      Probabilities p_first, p_last;
      update<true, 2>(a, s, kUnitGroups * u, g, t, bits, {&first, &last}, {&p_first, &p_last}, sm, acc);
      ValueRows<kValueGroups> no_rows;  // not read: a plain unit has no full-precision values
#pragma unroll 1
      for (int i = 0; i < kUnitGroups; ++i) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
          group_values<true>(s, st, p_first.p[jj], u, kUnitGroups * u + i, jj, g, t, no_rows, acc);
        p_first = p_last;
      }
    } else {
#pragma unroll 1
      for (int i = 0; i < kUnitGroups; ++i) {
        const int group = kUnitGroups * u + i;
        Logits x;
        group_logits<false>(s, st, q, zero, u, i, g, t, x.x);
        ValueRows<kValueGroups> ahead[2];  // kValuesAhead: both key products' full-precision values
        if constexpr (kValuesAhead)
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) load_value_rows(s, group, jj, g, t, 0, ahead[jj]);
        Probabilities p;
        update<false, 1>(a, s, group, g, t, bits, {&x}, {&p}, sm, acc);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
          group_values<false>(s, st, p.p[jj], u, group, jj, g, t, ahead[jj], acc);
      }
    }
  }

  // The largest factor 2^bits (Softmax) for which p * s < 2^15 for every scale of unit u's quantized values: a
  // scale below 2^(e - 14), e its biased exponent (fp16 scales are >= 0: their bits order as integers).
  template <bool kPlain>
  static KIVI_DEVICE int probability_bits(const Sequence& s, const Stage& st, int u, int lane) {
    uint32_t top = 0;
#pragma unroll
    for (int r = lane; r < kUnitTokens; r += 32) {
      uint32_t w[kValueGroups / 2];
      load_words(w, st.vs + value_row(r) * kValueGroups, kPlain || kUnitTokens * u + r < s.n_qv);
#pragma unroll
      for (int i = 0; i < kValueGroups / 2; ++i) top = max_u16x2(top, w[i]);
    }
    const uint32_t largest = warp_max(max(top & 0xFFFFu, top >> 16));
    return min(kMaxProbabilityBits, 29 - int(largest >> 10));
  }

  // Adds the zero terms q . z of the unit's key groups to `zero`, one product per column tile: the zero points of
  // group g % 2 in row g (exact fp16, no parts) against q as it is (both parts' columns hold it: no product per
  // unit); so zero[nt][1] of the lanes of row i is group i's term for head 4 nt + t (rows past the unit's groups
  // repeat them, unread).
  static KIVI_DEVICE void zero_terms(const Stage& st, const Query& q, int g, int t, float (&zero)[NT][4]) {
    const uint16_t* z = st.kz + (g % kUnitGroups) * D + 4 * t;
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const uint2 x = load<uint2>(z + 16 * k);
      const uint32_t a[4] = {x.x, 0u, x.y, 0u};  // rows g + 8: nothing
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_16816(zero[nt], a, q.q[nt][k]);
    }
  }

  // One softmax update over the raw logits of N key groups, groups first .. first + N - 1 (group_logits' out, scaled
  // in place): scaled, capped (one branch: the launch's cap) and masked past the sequence; the running maximum, sum
  // and accumulators moved to the new maximum; each group's probabilities into p.
  template <bool kPlain, int N>
  static KIVI_DEVICE void update(const Args& a, const Sequence& s, int first, int g, int t, int bits,
                                 Logits* const (&x)[N], Probabilities* const (&p)[N], Softmax& sm, Output& acc) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      for_logits(x[i]->x, [&](float& y, int, int) { y *= a.qk_scale; });
      if (a.cap > 0.f) for_logits(x[i]->x, [&](float& y, int, int) { y = soft_cap(y, a.cap); });
      if constexpr (!kPlain)
        for_logits(x[i]->x, [&](float& y, int jj, int r) {
          if (token(first + i, jj, g + 8 * r) >= s.n_tok) y = -INFINITY;
        });
    }
    const auto group_top = [&](int i, int nt) {
      const float(&y)[2][NT][2] = x[i]->x;
      return fmaxf(fmaxf(y[0][nt][0], y[0][nt][1]), fmaxf(y[1][nt][0], y[1][nt][1]));
    };
    float top[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      top[nt] = group_top(0, nt);
#pragma unroll
      for (int i = 1; i < N; ++i) top[nt] = fmaxf(top[nt], group_top(i, nt));
    }
    float alpha[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      top[nt] = fmaxf(top[nt], shfl_xor(top[nt], 4));
      top[nt] = fmaxf(top[nt], shfl_xor(top[nt], 8));
      top[nt] = fmaxf(top[nt], shfl_xor(top[nt], 16));
      const float m_new = fmaxf(sm.m[nt], top[nt]);
      alpha[nt] = fast_exp2(sm.m[nt] - m_new - float(sm.bits - bits));
      sm.m[nt] = m_new;
      sm.l[nt] *= alpha[nt];
    }
    sm.bits = bits;
    // The accumulators' columns are heads 2t and 2t + 1: their factors come from lanes t' = head % 4. Past the
    // first units the maximum seldom moves: then there is nothing to rescale.
    bool moved = false;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) moved |= alpha[nt] != 1.f;
    if (warp_any(moved)) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int head = 2 * t + e;
        float factor = 1.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float y = shfl(alpha[nt], head % 4);
          if (head / 4 == nt) factor = y;
        }
#pragma unroll
        for (int mi = 0; mi < kValueTiles; ++mi) acc.o[mi][e] *= factor, acc.o[mi][2 + e] *= factor;
        acc.zero[e] *= factor;
      }
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float base = sm.m[nt] - float(bits);
          const float p0 = fast_exp2(x[i]->x[jj][nt][0] - base), p1 = fast_exp2(x[i]->x[jj][nt][1] - base);
          sm.l[nt] += p0 + p1;
          p[i]->p[jj][nt] = pack_half2(p0, p1);
        }
  }

  static KIVI_DEVICE void run(const Args& a) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.x, split = blockIdx.y;
    const int b = bh / a.kv_heads, h = bh % a.kv_heads, hg = a.q_heads / a.kv_heads;
    const int64_t bh64 = bh;
    Sequence s;
    s.kc = a.kc + bh64 * a.kc_rows * D;
    s.ks = a.ks + bh64 * a.ks_rows * D;
    s.kz = a.kz + bh64 * a.ks_rows * D;
    s.kr = a.kr + bh64 * a.kr_rows * D;
    s.vc = a.vc + bh64 * a.vc_rows * kValueWords;
    s.vs = a.vs + bh64 * a.vc_rows * kValueGroups;
    s.vz = a.vz + bh64 * a.vc_rows * kValueGroups;
    s.vr = a.vr + bh64 * a.vr_rows * D;
    // With one split a warp's first unit is unit `warp`, known before the counts arrive: it is staged as a plain one
    // at once where the buffers hold it (the counts' latency and the copies' then overlap), and again below where
    // the counts show it is not plain.
    Stage* stages = static_cast<Stage*>(dynamic_shared()) + 2 * warp;
    const bool early = a.splits == 1 && kUnitGroups * kRowsPerGroup * (warp + 1) <= a.kc_rows &&
                       kUnitGroups * (warp + 1) <= a.ks_rows && kUnitTokens * (warp + 1) <= a.vc_rows;
    if (early) stage_plain(s, warp, stages[0], lane);
    s.n_qk = a.counts[a.batch + b];
    s.n_qv = a.counts[2 * a.batch + b];
    s.n_tok = a.counts[3 * a.batch + b];
    s.vc_rows = a.vc_rows;
    s.vr_rows = a.vr_rows;
    s.ring = a.ring;

    // The query as the key products' right operand: lane (g, t) holds column g = (head 4 nt + g / 2, part g % 2)
    // at channels 16 k + 4 t .. + 3, the k-th product's rows 2t, 2t+1 (pair 0) and 2t+8, 2t+9 (pair 1).
    Query q;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int head = 4 * nt + g / 2;
      const uint16_t* row = a.q + b * a.stride_qb + (h * hg + head) * a.stride_qh + 4 * t;
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        const uint2 x = head < hg ? load<uint2>(row + 16 * k) : uint2{0, 0};
        q.q[nt][k][0] = x.x, q.q[nt][k][1] = x.y;
      }
    }
    q.lo = g & 1 ? kMinusOne : 0u;

    Softmax sm;
    sm.bits = kMaxProbabilityBits;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) sm.m[nt] = -INFINITY, sm.l[nt] = 0.f;
    Output acc = {};

    const int units = (s.n_tok + kUnitGroups * kGroup - 1) / (kUnitGroups * kGroup);
    const int per_split = (units + a.splits - 1) / a.splits;
    const int first = split * per_split + warp, last = min(split * per_split + per_split, units);
    copy_commit();
    if (first < last && !(early && plain(s, first))) {  // first == warp where early
      copy_wait<0>();  // the early copies land before the stage is written again
      stage(s, first, stages[0], lane);
    }
    copy_commit();
    for (int u = first, n = 0; u < last; u += W, ++n) {
      if (u + W < last) stage(s, u + W, stages[(n + 1) & 1], lane);
      copy_commit();
      copy_wait<1>();  // unit u's copies have landed (the next unit's may still be in flight)
      sync_warp();
      if (plain(s, u))  // warp-uniform
        unit<true>(a, s, stages[n & 1], q, u, g, t, sm, acc);
      else
        unit<false>(a, s, stages[n & 1], q, u, g, t, sm, acc);
      sync_warp();  // every lane is done with this stage before it is refilled
    }

    // Merge the block's warps.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      sm.l[nt] += shfl_xor(sm.l[nt], 4);
      sm.l[nt] += shfl_xor(sm.l[nt], 8);
      sm.l[nt] += shfl_xor(sm.l[nt], 16);
    }
    copy_wait<0>();
    sync_block();  // the stages become the merge's memory
    Merge& merge = *static_cast<Merge*>(dynamic_shared());
    auto& warp_o = merge.o;
    auto& warp_z = merge.zero;
    auto& warp_m = merge.m;
    auto& warp_l = merge.l;
    if (g == 0) {  // each warp's sums carry its own factor: m - bits, its base, weighs them
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) warp_m[warp][4 * nt + t] = sm.m[nt] - float(sm.bits), warp_l[warp][4 * nt + t] = sm.l[nt];
    }
    if (g < kValueGroups) warp_z[warp][2 * t][g] = acc.zero[0], warp_z[warp][2 * t + 1][g] = acc.zero[1];
#pragma unroll
    for (int mi = 0; mi < kValueTiles; ++mi) {  // in true units: channel 32 G + 4 g + 2 h (row g), + 1 (row g + 8)
      const int channel = kGroup * (mi / 2) + 4 * g + 2 * (mi % 2);
      const float row = 1.f / code_unit(2 * (mi % 2)), next = 1.f / code_unit(2 * (mi % 2) + 1);
      warp_o[warp][2 * t][merge_column(2 * t, channel)] = acc.o[mi][0] * row;
      warp_o[warp][2 * t + 1][merge_column(2 * t + 1, channel)] = acc.o[mi][1] * row;
      warp_o[warp][2 * t][merge_column(2 * t, channel + 1)] = acc.o[mi][2] * next;
      warp_o[warp][2 * t + 1][merge_column(2 * t + 1, channel + 1)] = acc.o[mi][3] * next;
    }
    sync_block();
    // The block's place, derived again: kept from the start, two of its registers were spilled across the loop.
    const int kv_heads = opaque(a.kv_heads), b_out = bh / kv_heads, h_out = bh % kv_heads;
    const int hg_out = a.q_heads / kv_heads;
    for (int i = threadIdx.x; i < hg_out * D; i += W * 32) {
      const int head = i / D, c = i % D;
      float top = -INFINITY;
#pragma unroll
      for (int w = 0; w < W; ++w) top = fmaxf(top, warp_m[w][head]);
      float sum = 0.f, out = 0.f;
      if (top != -INFINITY) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const float f = fast_exp2(warp_m[w][head] - top);
          sum += f * warp_l[w][head];
          out += f * (warp_o[w][head][merge_column(head, c)] + warp_z[w][head][c / kGroup]);
        }
      }
      const int qh = h_out * hg_out + head;
      if (a.splits == 1) {
        const int64_t at = b_out * a.stride_ob + qh * a.stride_oh + c;
        if (a.out_f32)
          static_cast<float*>(a.out)[at] = out / sum;
        else
          static_cast<uint16_t*>(a.out)[at] = float_to_half(out / sum);
      } else {
        const int64_t row = (int64_t(b_out) * a.q_heads + qh) * a.splits + split;
        a.part[row * D + c] = sum > 0.f ? out / sum : 0.f;
        if (c == 0) a.lse[row] = sum > 0.f ? top + fast_log2(sum) : -INFINITY;
      }
    }
  }
};

// 4-bit codes declare at least one block per multiprocessor: left free, ptxas held the 4-bit kernel of two column
// tiles at head_dim 128 to 168 registers and spilled; so bounded it takes 176. 0 (none declared) elsewhere.
template <int BITS, int D, int NT, int W>
__global__ void __launch_bounds__(W * 32, BITS == 4 ? 1 : 0) decode_kernel(const Args a) {
  Decode<BITS, D, NT, W>::run(a);
}

template <int BITS, int D, int NT, int W>
int launch(Decode<BITS, D, NT, W>, const Args& a, void* stream) {
#ifdef KIVI_EMULATE
  (void)stream;
  emu::launch({unsigned(a.batch * a.kv_heads), unsigned(a.splits), 1}, {W * 32, 1, 1},
              [&] { decode_kernel<BITS, D, NT, W>(a); });
  return 0;
#else
  constexpr int bytes = Decode<BITS, D, NT, W>::kSharedBytes;
  static const cudaError_t attribute =
      cudaFuncSetAttribute(decode_kernel<BITS, D, NT, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (attribute != cudaSuccess) return int(attribute);
  decode_kernel<BITS, D, NT, W><<<dim3(a.batch * a.kv_heads, a.splits), W * 32, bytes, cudaStream_t(stream)>>>(a);
  return int(cudaGetLastError());
#endif
}

// The largest warps per block (2, 4, 8) whose stages fit in a block's shared memory; instantiated up to it only.
template <int BITS, int D, int NT, int W = 2>
constexpr int max_warps() {
  if constexpr (2 * W > kMaxWarps)
    return W;
  else if constexpr (Decode<BITS, D, NT, 2 * W>::kSharedBytes > kSharedLimit)
    return W;
  else
    return max_warps<BITS, D, NT, 2 * W>();
}

// f(Decode<BITS, D, NT, W>{}) for the kernel of `warps` warps per block; -1 where none is built.
template <int BITS, int D, int NT, int W = 2, class F>
int with_warps(int warps, F&& f) {
  if constexpr (W < max_warps<BITS, D, NT>())
    if (warps > W) return with_warps<BITS, D, NT, 2 * W>(warps, f);
  return warps == W ? f(Decode<BITS, D, NT, W>{}) : -1;
}

// f(Decode<...>{}) for the kernel of this layout (hg: query heads per KV head) and block size; -1 where none is built.
template <class F>
int dispatch(int bits, int head_dim, int hg, int warps, F&& f) {
  if (hg < 1 || hg > 8) return -1;
  const bool two_tiles = hg > 4;
  if (bits == 2 && head_dim == 128) return two_tiles ? with_warps<2, 128, 2>(warps, f) : with_warps<2, 128, 1>(warps, f);
  if (bits == 2 && head_dim == 256) return two_tiles ? with_warps<2, 256, 2>(warps, f) : with_warps<2, 256, 1>(warps, f);
  if (bits == 4 && head_dim == 128) return two_tiles ? with_warps<4, 128, 2>(warps, f) : with_warps<4, 128, 1>(warps, f);
  if (bits == 4 && head_dim == 256) return two_tiles ? with_warps<4, 256, 2>(warps, f) : with_warps<4, 256, 1>(warps, f);
  return -1;
}

}  // namespace

extern "C" {

// 0: launched; -1: a shape it does not serve (kivi/kernels/cuda_decode.py checks first); else a cudaError_t.
int kivi_decode(const Args* a, int bits, int head_dim, void* stream) {
  if (a->q_heads % a->kv_heads) return -1;
  return dispatch(bits, head_dim, a->q_heads / a->kv_heads, a->warps,
                  [&](auto decode) { return launch(decode, *a, stream); });
}

// The dynamic shared memory of kivi_decode's block of `warps` warps for this layout (hg: query heads per KV head);
// 0: no such kernel.
int kivi_decode_shared_bytes(int bits, int head_dim, int hg, int warps) {
  const int bytes = dispatch(bits, head_dim, hg, warps, [](auto decode) { return decltype(decode)::kSharedBytes; });
  return bytes > 0 ? bytes : 0;
}

const char* kivi_decode_error(int code) {
#ifdef KIVI_EMULATE
  return code ? "emulation error" : "no error";
#else
  return cudaGetErrorString(cudaError_t(code));
#endif
}

}  // extern "C"
