// Paged decode attention: one query token per sequence against its paged KV cache.
//
// Work split. One CTA serves one (sequence, kv head, tile of up to G query heads of that
// kv head's group[, partition]). Every KV tile it streams is used by all G query heads, so
// with grouped-query attention each KV byte is read once per group, not once per query head.
// v1: a CTA covers the whole context and writes the output. v2: the context is cut into
// partitions of `partition` tokens, a CTA per partition writes a partial result (max, sum,
// normalised output), and a reduce kernel combines the partitions of each (sequence, head).
//
// Inside a CTA. kWarps warps take "units" of kUnitRows consecutive tokens (a unit never
// straddles a KV block: block sizes are multiples of 16) round-robin. Each warp streams its
// units through its own kStages-deep ring of shared-memory stages with 16-byte asynchronous
// copies (a unit's keys and values are each one contiguous span in the cache layout of
// launchers.h), so two units are in flight while it computes on a third; no CTA-wide barrier
// is needed until the final merge.
//
// Lanes. A row (one token's head_size elements) is split over kLanesPerRow lanes, each
// owning kDimsPerLane dimensions for all G heads; q.k partial sums are combined with
// kLanesPerRow-wide xor shuffles. Each lane keeps its own online-softmax state (running max,
// sum, output accumulator) over the rows it saw; lanes and warps are merged once at the end.
// Scores are kept in the log2 domain (q is pre-scaled by scale * log2(e); under a soft cap by
// scale alone, and log2(e) is applied after the tanh).
//
// Types. The cache type CT (its 16-byte chunks, kVec elements each) shapes the streaming; the
// query/output type QT only how q is loaded and the output stored. They are the same type
// except over an FP8 cache (CT = Fp8E4m3, 16 codes per chunk): there the host folds the key
// scale into `scale` and the kernel multiplies the normalised output by `v_scale`, so the
// inner loops only widen codes. An fp8 cache takes tiles of up to 4 query heads only: an
// 8-head tile over 16-element chunks would hold twice the q and accumulator registers. (Head
// size 128 with fp16/bf16 queries over an fp8 cache runs on tensor cores instead, on sm_80+:
// paged_decode_fp8_mma.cuh.)
#pragma once

#include <type_traits>

#include "../cuda_compat.h"
#include "../dtype_traits.cuh"
#include "../launchers.h"

namespace core_kernels {

constexpr float kNegBig = -1e30f;  // "no score yet": finite, so exp2(kNegBig - x) is 0, not NaN
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kRescaleLog2 = 8.f;  // see attend_unit

template <typename CT, int kHead, int kGroup>
struct DecodeShape {
  using S = typename CT::Storage;
  static constexpr int kVec = CT::kVec;            // elements per 16-byte chunk
  static constexpr int kRowChunks = kHead / kVec;  // chunks per token row
  static constexpr int kRowBytes = kHead * int(sizeof(S));
  static constexpr int kUnitRows = 4096 / kRowBytes < 16 ? 4096 / kRowBytes : 16;
  static constexpr int kLanesPerRow = kHead * kGroup / 64;  // -> 64 q.k products per lane/row
  static constexpr int kRowsPerPass = kWarpSize / kLanesPerRow;
  static constexpr int kRowsPerLane = kUnitRows / kRowsPerPass;
  static constexpr int kDimsPerLane = kHead / kLanesPerRow;
  static constexpr int kChunksPerLane = kDimsPerLane / kVec;
  static constexpr int kUnitChunks = 2 * kUnitRows * kRowChunks;  // keys, then values
  static constexpr int kCopiesPerLane = kUnitChunks / kWarpSize;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kStages = kCopyStages;
  static constexpr int kSmemBytes = kWarps * kStages * kUnitChunks * 16;
  static constexpr int kMergeBytes = kWarps * kGroup * (kHead + 2) * int(sizeof(float));

  static_assert(kHead % kVec == 0 && kDimsPerLane % kVec == 0, "head size / lane split");
  static_assert(kRowsPerPass >= 1 && kUnitRows % kRowsPerPass == 0, "rows per lane");
  static_assert(kUnitChunks % kWarpSize == 0, "unit copy split");
  static_assert(16 % kUnitRows == 0, "a unit must not straddle a block of 16 or 32");
  static_assert(kMergeBytes <= kSmemBytes, "merge scratch reuses the stage buffers");

  // Bank-conflict-free reads when fewer than 8 lanes share a row of at least 128 bytes: lanes
  // of the next row read the other half of the 128-byte bank window. (Rows of 64 bytes, fp8
  // head 64, already put two rows side by side in one window.)
  static constexpr bool kSwizzle = kLanesPerRow < 8 && kRowChunks >= 8;
  static constexpr int kSwizzlePeriod = kSwizzle ? 8 / kLanesPerRow : 1;
  __device__ __forceinline__ static int swizzle(int row, int chunk) {
    if constexpr (kSwizzle) {
      return chunk ^ ((row % (8 / kLanesPerRow)) * kLanesPerRow);
    } else {
      return chunk;
    }
  }
};

// 16-byte words of query (type QT) per cache chunk: 1 when QT is the cache type.
template <typename Sh, typename QT>
constexpr int kQueryWords = Sh::kVec * int(sizeof(typename QT::Storage)) / 16;

// This lane's q chunks of heads [qh0, qh0 + n_heads), as raw 16-byte vectors (issued early,
// converted once the first KV copies are in flight); heads past n_heads (a partial tile)
// are zero and never written out.
template <typename Sh, typename QT, int kGroup>
__device__ __forceinline__ void load_query(
    const DecodeArgs& a, int seq, int qh0, int n_heads, int lane_in_row,
    uint4 (&raw)[kGroup][Sh::kChunksPerLane][kQueryWords<Sh, QT>]) {
  const auto* base = static_cast<const typename QT::Storage*>(a.query) + seq * a.q_stride_tok;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int m = 0; m < Sh::kChunksPerLane; ++m) {
      const int chunk = lane_in_row + m * Sh::kLanesPerRow;
#pragma unroll
      for (int w = 0; w < kQueryWords<Sh, QT>; ++w) {
        raw[g][m][w] = g < n_heads ? *reinterpret_cast<const uint4*>(
                                         base + (qh0 + g) * a.q_stride_head + chunk * Sh::kVec +
                                         w * QT::kVec)
                                   : make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// q in floats, scaled into the log2 domain (scale * log2(e)); with a soft cap only by scale,
// because tanh must see the natural-domain score (soft_capped moves it into log2 after).
template <typename Sh, typename QT, int kGroup>
__device__ __forceinline__ void convert_query(
    const uint4 (&raw)[kGroup][Sh::kChunksPerLane][kQueryWords<Sh, QT>], float scale,
    float soft_cap, float (&q)[kGroup][Sh::kDimsPerLane]) {
  const float s = soft_cap > 0.f ? scale : scale * kLog2e;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int m = 0; m < Sh::kChunksPerLane; ++m) {
#pragma unroll
      for (int w = 0; w < kQueryWords<Sh, QT>; ++w) {
        float f[QT::kVec];
        QT::to_float(raw[g][m][w], f);
#pragma unroll
        for (int e = 0; e < QT::kVec; ++e) q[g][m * Sh::kVec + w * QT::kVec + e] = f[e] * s;
      }
    }
  }
}

// A unit copy, per lane: chunk (lane % kRowChunks) of rows lane / kRowChunks + c * kRowStep
// (c < kSteps), keys then values. Only the unit's base address changes between units, so
// every copy of a lane is a fixed offset from two base pointers.
template <typename Sh>
struct CopyPlan {
  static constexpr int kRowStep = kWarpSize / Sh::kRowChunks;
  static constexpr int kSteps = Sh::kUnitRows / kRowStep;
  static constexpr int kHalf = Sh::kUnitRows * Sh::kRowChunks;  // chunks of keys in a stage
  static_assert(kWarpSize % Sh::kRowChunks == 0 && Sh::kUnitRows % kRowStep == 0, "copy split");
  static constexpr int kSwizzlePeriod = Sh::kSwizzlePeriod;
  static_assert(kRowStep % kSwizzlePeriod == 0,
                "the swizzle of a lane's rows must not depend on the step");
  int src;  // elements from the unit's first key to this lane's first chunk
  int dst;  // 16-byte chunks from the stage start to this lane's first chunk

  __device__ __forceinline__ explicit CopyPlan(int lane) {
    const int row = lane / Sh::kRowChunks, chunk = lane % Sh::kRowChunks;
    src = row * (Sh::kRowChunks * Sh::kVec) + chunk * Sh::kVec;
    dst = row * Sh::kRowChunks + Sh::swizzle(row, chunk);
  }

  // Issues the asynchronous copy of one unit; `keys` points at its first key row in the cache.
  __device__ __forceinline__ void issue(uint4* stage, const typename Sh::S* keys,
                                        int64_t kv_stride) const {
    // One 64-bit base per half; every copy is then base + a compile-time byte offset.
    const uint4* k = reinterpret_cast<const uint4*>(keys + src);
    const uint4* v = reinterpret_cast<const uint4*>(keys + kv_stride + src);
    uint4* to = stage + dst;
#pragma unroll
    for (int c = 0; c < kSteps; ++c) {
      async_copy_16(to + c * kRowStep * Sh::kRowChunks, k + c * kRowStep * Sh::kRowChunks);
    }
#pragma unroll
    for (int c = 0; c < kSteps; ++c) {
      async_copy_16(to + kHalf + c * kRowStep * Sh::kRowChunks, v + c * kRowStep * Sh::kRowChunks);
    }
  }
};

// Per-lane online-softmax state over the rows this lane has seen.
template <typename Sh, int kGroup>
struct LaneState {
  float acc[kGroup][Sh::kDimsPerLane];
  float max[kGroup];
  float sum[kGroup];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      max[g] = kNegBig;
      sum[g] = 0.f;
#pragma unroll
      for (int d = 0; d < Sh::kDimsPerLane; ++d) acc[g][d] = 0.f;
    }
  }
};

// q.k for this lane's rows of a unit, summed over the lanes that share each row.
template <typename Sh, typename CT, int kGroup>
__device__ __forceinline__ void unit_scores(const uint4* keys, int row_group, int lane_in_row,
                                            const float (&q)[kGroup][Sh::kDimsPerLane],
                                            float (&s)[Sh::kRowsPerLane][kGroup]) {
#pragma unroll
  for (int j = 0; j < Sh::kRowsPerLane; ++j) {
    const int row = row_group + j * Sh::kRowsPerPass;
#pragma unroll
    for (int g = 0; g < kGroup; ++g) s[j][g] = 0.f;
#pragma unroll
    for (int m = 0; m < Sh::kChunksPerLane; ++m) {
      const int chunk = lane_in_row + m * Sh::kLanesPerRow;
      float k[Sh::kVec];
      CT::to_float(keys[row * Sh::kRowChunks + Sh::swizzle(row, chunk)], k);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
#pragma unroll
        for (int e = 0; e < Sh::kVec; ++e) s[j][g] = fmaf(q[g][m * Sh::kVec + e], k[e], s[j][g]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < Sh::kRowsPerLane; ++j) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int off = Sh::kLanesPerRow / 2; off > 0; off >>= 1) {
        s[j][g] += warp_shfl_xor(s[j][g], off);
      }
    }
  }
}

// Gemma 2's attention-logit soft cap: natural-domain scores s (q pre-scaled by scale only)
// become soft_cap * tanh(s / soft_cap), returned in the log2 domain. soft_cap is uniform
// across the grid, so the branch never diverges.
template <typename Sh, int kGroup>
__device__ __forceinline__ void soft_capped(float soft_cap, float (&s)[Sh::kRowsPerLane][kGroup]) {
  const float inv = 1.f / soft_cap, out = soft_cap * kLog2e;
#pragma unroll
  for (int j = 0; j < Sh::kRowsPerLane; ++j) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) s[j][g] = out * tanhf(s[j][g] * inv);
  }
}

// One unit: scores, online-softmax update, and p.V. Rows outside [lo, hi) are masked: their
// scores never count and their (possibly garbage) values are never touched.
template <typename Sh, typename CT, int kGroup>
__device__ __forceinline__ void attend_unit(const uint4* stage, int first_token, int lo, int hi,
                                            int row_group, int lane_in_row,
                                            const float (&q)[kGroup][Sh::kDimsPerLane],
                                            float soft_cap, LaneState<Sh, kGroup>& st) {
  float s[Sh::kRowsPerLane][kGroup];
  unit_scores<Sh, CT, kGroup>(stage, row_group, lane_in_row, q, s);
  if (soft_cap > 0.f) soft_capped<Sh, kGroup>(soft_cap, s);
  bool valid[Sh::kRowsPerLane];
#pragma unroll
  for (int j = 0; j < Sh::kRowsPerLane; ++j) {
    const int t = first_token + row_group + j * Sh::kRowsPerPass;
    valid[j] = t >= lo && t < hi;
  }
  // The running max only moves when some lane's new rows exceed it by kRescaleLog2: until
  // then p = 2^(s - max) stays below 2^kRescaleLog2, harmless in fp32, and the accumulators
  // need no rescaling (one vote per unit instead of a multiply per accumulator).
  float m_new[kGroup];
  bool grow = false;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m_new[g] = st.max[g];
#pragma unroll
    for (int j = 0; j < Sh::kRowsPerLane; ++j)
      m_new[g] = valid[j] ? fmaxf(m_new[g], s[j][g]) : m_new[g];
    grow |= m_new[g] > st.max[g] + kRescaleLog2;
  }
  if (warp_any(grow)) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const float alpha = fast_exp2(st.max[g] - m_new[g]);
      st.max[g] = m_new[g];
      st.sum[g] *= alpha;
#pragma unroll
      for (int d = 0; d < Sh::kDimsPerLane; ++d) st.acc[g][d] *= alpha;
    }
  }
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int j = 0; j < Sh::kRowsPerLane; ++j) {
      s[j][g] = valid[j] ? fast_exp2(s[j][g] - st.max[g]) : 0.f;  // s now holds p
      st.sum[g] += s[j][g];
    }
  }
  const uint4* values = stage + Sh::kUnitRows * Sh::kRowChunks;
#pragma unroll
  for (int j = 0; j < Sh::kRowsPerLane; ++j) {
    if (!valid[j]) continue;
    const int row = row_group + j * Sh::kRowsPerPass;
#pragma unroll
    for (int m = 0; m < Sh::kChunksPerLane; ++m) {
      const int chunk = lane_in_row + m * Sh::kLanesPerRow;
      float v[Sh::kVec];
      CT::to_float(values[row * Sh::kRowChunks + Sh::swizzle(row, chunk)], v);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
#pragma unroll
        for (int e = 0; e < Sh::kVec; ++e) {
          st.acc[g][m * Sh::kVec + e] = fmaf(s[j][g], v[e], st.acc[g][m * Sh::kVec + e]);
        }
      }
    }
  }
}

// Folds the states of the lanes that own the same dimensions (different row groups) into
// every lane, with xor shuffles over the row-group bits of the lane id.
template <typename Sh, int kGroup>
__device__ __forceinline__ void merge_row_groups(LaneState<Sh, kGroup>& st) {
#pragma unroll
  for (int off = Sh::kLanesPerRow; off < kWarpSize; off <<= 1) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const float m_other = warp_shfl_xor(st.max[g], off);
      const float s_other = warp_shfl_xor(st.sum[g], off);
      const float m = fmaxf(st.max[g], m_other);
      const float a = fast_exp2(st.max[g] - m);
      const float b = fast_exp2(m_other - m);
      st.sum[g] = st.sum[g] * a + s_other * b;
      st.max[g] = m;
#pragma unroll
      for (int d = 0; d < Sh::kDimsPerLane; ++d) {
        st.acc[g][d] = st.acc[g][d] * a + warp_shfl_xor(st.acc[g][d], off) * b;
      }
    }
  }
}

}  // namespace core_kernels

#include "paged_decode_kernel.cuh"
