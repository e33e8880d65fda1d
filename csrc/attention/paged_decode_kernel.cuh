// The decode kernels proper (v1/v2 main kernel, v2 reduce kernel) and their launcher.
// Included by paged_decode.cuh; see there for the design.
#pragma once

namespace core_kernels {

// Combines the W warp states that merge_warps_and_store (or the fp8 tensor-core kernel) left
// in shared memory -- red = acc [W][kGroup][D], then max [W][kGroup], then sum [W][kGroup] --
// and writes either the final output (`final_out`: v1, or a v2 sequence of one partition
// whose CTAs merge among themselves) or this partition's partial result (v2).
template <typename QT, int W, int kGroup, int D, int kThreads>
__device__ __forceinline__ void store_merged(const DecodeArgs& a, const float* red, int seq, int qh0,
                                             int n_heads, int part, bool final_out) {
  const float* red_acc = red;
  const float* red_max = red + W * kGroup * D;
  const float* red_sum = red_max + W * kGroup;
  for (int idx = threadIdx.x; idx < n_heads * D; idx += kThreads) {
    const int g = idx / D;
    const int d = idx % D;
    float m = kNegBig;
#pragma unroll
    for (int w = 0; w < W; ++w) m = fmaxf(m, red_max[w * kGroup + g]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float f = fast_exp2(red_max[w * kGroup + g] - m);
      l = fmaf(red_sum[w * kGroup + g], f, l);
      o = fmaf(red_acc[(w * kGroup + g) * D + d], f, o);
    }
    // l == 0: no token attended (empty range). v_scale: the FP8 cache's value scale, else 1.
    const float out = l > 0.f ? o / l * a.v_scale : 0.f;
    if (final_out) {
      auto* dst = static_cast<typename QT::Storage*>(a.out);
      dst[seq * a.o_stride_tok + (qh0 + g) * a.o_stride_head + d] = QT::from_float(out);
    } else {
      const int64_t slot = (int64_t(seq) * a.num_q_heads + qh0 + g) * a.max_parts + part;
      a.part_out[slot * D + d] = out;
      if (d == 0) {
        a.part_max[slot] = m;
        a.part_sum[slot] = l;
      }
    }
  }
}

// After every warp's lanes are merged: combines the kWarps warp states through shared memory
// and writes either the final output or this partition's partial result (see store_merged).
template <typename Sh, typename QT, int kGroup>
__device__ __forceinline__ void merge_warps_and_store(const DecodeArgs& a, float* red,
                                                      const LaneState<Sh, kGroup>& st, int seq,
                                                      int qh0, int n_heads, int part, bool final_out) {
  constexpr int W = Sh::kWarps;
  constexpr int D = Sh::kVec * Sh::kRowChunks;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  float* red_acc = red;                   // [W][kGroup][D]
  float* red_max = red + W * kGroup * D;  // [W][kGroup]
  float* red_sum = red_max + W * kGroup;  // [W][kGroup]
  if (lane < Sh::kLanesPerRow) {          // row group 0 holds the merged warp state
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int m = 0; m < Sh::kChunksPerLane; ++m) {
#pragma unroll
        for (int e = 0; e < Sh::kVec; ++e) {
          const int d = (lane + m * Sh::kLanesPerRow) * Sh::kVec + e;
          red_acc[(warp * kGroup + g) * D + d] = st.acc[g][m * Sh::kVec + e];
        }
      }
      if (lane == 0) {
        red_max[warp * kGroup + g] = st.max[g];
        red_sum[warp * kGroup + g] = st.sum[g];
      }
    }
  }
  __syncthreads();
  store_merged<QT, W, kGroup, D, Sh::kThreads>(a, red, seq, qh0, n_heads, part, final_out);
}

// Partitions of one sequence under a v2 launch with arrival counts (DecodeArgs::part_count).
__device__ __forceinline__ int partitions_of(const DecodeArgs& a, int len) {
  return max(1, min(a.max_parts, (len + a.partition - 1) / a.partition));
}

// The v2 merge inside the main kernel: after writing its partial result, each CTA of a
// (sequence, kv head, head tile) with several partitions counts its arrival; the one that
// arrives last combines the n_parts partial results of its n_heads query heads, as the reduce
// kernel would (weights sum_p * 2^(max_p - max), normalised), and resets the count to zero for
// the next launch. The fences order every CTA's partial stores before its count and the last
// CTA's loads (L1-bypassing) after it. `scratch` (shared memory, free here) holds kGroup *
// (n_parts + 1) floats: the launcher checks that it fits.
template <typename QT, int kGroup, int D, int kThreads>
__device__ __forceinline__ void merge_if_last(const DecodeArgs& a, float* scratch, int seq, int qh0,
                                              int n_heads, int n_parts) {
  __threadfence();
  __syncthreads();  // every thread's partial stores are fenced; the stage buffers are free
  int last = 0;     // (a barrier's vote, not a __shared__ flag: no static shared memory, which
                    // would cost ROCm its second CTA per CU)
  if (threadIdx.x == 0) {
    int32_t* count = a.part_count + int64_t(seq) * gridDim.y + blockIdx.y;
    last = atomicAdd(count, 1) == n_parts - 1;
    if (last) *count = 0;  // every partition has arrived: nothing else touches it this launch
  }
  if (!__syncthreads_or(last)) return;
  __threadfence();
  float* weights = scratch;                  // [kGroup][n_parts]
  float* totals = scratch + kGroup * n_parts;  // [kGroup]
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  constexpr int kWarps = kThreads / kWarpSize;
  for (int g = warp; g < n_heads; g += kWarps) {
    const int64_t base = (int64_t(seq) * a.num_q_heads + qh0 + g) * a.max_parts;
    float m = kNegBig;
    for (int p = lane; p < n_parts; p += kWarpSize) m = fmaxf(m, load_cg(a.part_max + base + p));
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off >>= 1) m = fmaxf(m, warp_shfl_xor(m, off));
    float total = 0.f;
    for (int p = lane; p < n_parts; p += kWarpSize) {
      const float w = load_cg(a.part_sum + base + p) * fast_exp2(load_cg(a.part_max + base + p) - m);
      weights[g * n_parts + p] = w;
      total += w;
    }
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off >>= 1) total += warp_shfl_xor(total, off);
    if (lane == 0) totals[g] = total;
  }
  __syncthreads();
  auto* dst = static_cast<typename QT::Storage*>(a.out);
  for (int idx = threadIdx.x; idx < n_heads * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    const int64_t base = (int64_t(seq) * a.num_q_heads + qh0 + g) * a.max_parts;
    float o = 0.f;
    for (int p = 0; p < n_parts; ++p) o = fmaf(weights[g * n_parts + p], load_cg(a.part_out + (base + p) * D + d), o);
    const float total = totals[g];
    dst[seq * a.o_stride_tok + (qh0 + g) * a.o_stride_head + d] = QT::from_float(total > 0.f ? o / total : 0.f);
  }
}

// The newest token of sequence `seq` (DecodeArgs::new_key) into the cache at `slot`: the key and
// value rows of this CTA's kv head, one 16-byte chunk per thread. The barrier orders the
// stores before every copy this CTA issues afterwards (the copies read L2, where the stores
// land). CTAs of other query-head tiles of the same kv head store the same bytes.
template <typename Sh>
__device__ __forceinline__ void write_new_token(const DecodeArgs& a, int seq, int kv_head,
                                                int64_t slot) {
  constexpr int kChunks = Sh::kRowChunks;
  static_assert(2 * kChunks <= Sh::kThreads, "one chunk of the key or value row per thread");
  const int i = threadIdx.x;
  if (slot >= 0 && i < 2 * kChunks) {
    const bool value = i >= kChunks;
    const auto* src = static_cast<const typename Sh::S*>(value ? a.new_value : a.new_key) +
                      seq * (value ? a.nv_stride_tok : a.nk_stride_tok) +
                      kv_head * (value ? a.nv_stride_head : a.nk_stride_head);
    const int64_t row = int64_t(kChunks) * Sh::kVec;
    const int64_t head_stride = a.block_size * row;
    const int64_t kv_stride = head_stride * a.num_kv_heads;
    // The cache is the kernel's input everywhere else; this store is the op's declared write.
    auto* dst = static_cast<typename Sh::S*>(const_cast<void*>(a.kv_cache)) +
                (slot >> a.block_shift) * 2 * kv_stride + (value ? kv_stride : 0) +
                kv_head * head_stride + (slot & (a.block_size - 1)) * row;
    const int chunk = value ? i - kChunks : i;
    reinterpret_cast<uint4*>(dst)[chunk] = reinterpret_cast<const uint4*>(src)[chunk];
  }
  __syncthreads();
}

template <typename QT, typename CT, int kHead, int kGroup>
__global__ void __launch_bounds__(DecodeShape<CT, kHead, kGroup>::kThreads, 2)
    paged_decode_kernel(const DecodeArgs a) {
  using Sh = DecodeShape<CT, kHead, kGroup>;
  extern __shared__ uint4 smem[];
  const int group = a.num_q_heads / a.num_kv_heads;
  const int tiles = (group + kGroup - 1) / kGroup;
  const int seq = blockIdx.z, part = blockIdx.x;
  const int kv_head = blockIdx.y / tiles;
  const int qh0 = kv_head * group + (blockIdx.y % tiles) * kGroup;
  const int n_heads = min(kGroup, kv_head * group + group - qh0);
  const int len = a.seq_lens[seq];
  const int start = a.partition ? part * a.partition : 0;
  if (part > 0 && start >= len) return;  // past this sequence's last partition
  const int end = a.partition ? min(len, start + a.partition) : len;
  const int lo = a.sliding_window > 0 ? max(0, len - a.sliding_window) : 0;
  const int first_unit = max(start, lo) / Sh::kUnitRows;
  const int n_units = max(0, (end + Sh::kUnitRows - 1) / Sh::kUnitRows - first_unit);

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row_group = lane / Sh::kLanesPerRow, lane_in_row = lane % Sh::kLanesPerRow;
  const int n_mine = n_units > warp ? (n_units - warp + Sh::kWarps - 1) / Sh::kWarps : 0;

  // Cache strides (elements): block -> 2 x kv heads x [block_size, head].
  const int64_t head_stride = int64_t(a.block_size) * kHead;
  const int64_t kv_stride = head_stride * a.num_kv_heads;
  const auto* cache = static_cast<const typename Sh::S*>(a.kv_cache) + kv_head * head_stride;
  const int32_t* table = a.block_tables + seq * a.bt_stride;
  uint4* ring = smem + warp * Sh::kStages * Sh::kUnitChunks;
  const CopyPlan<Sh> plan(lane);

  // Lane i holds the block id of this warp's unit (i mod warp size), refilled every
  // kWarpSize units.
  auto unit_token = [&](int i) { return (first_unit + warp + i * Sh::kWarps) * Sh::kUnitRows; };
  auto load_ids = [&](int i0) {
    return i0 + lane < n_mine ? table[unit_token(i0 + lane) >> a.block_shift] : 0;
  };
  // Start-up latency: the block ids and q are requested together, the first copies go out
  // as soon as the ids arrive, and q is converted while they are in flight. The ids (step
  // metadata) are requested before waiting for the previous kernel, which produced q and the
  // new token (a no-op wait unless DecodeArgs::overlap_previous).
  int table_ids = load_ids(0);
  const bool ends_context = len > 0 && end == len;  // this CTA's range holds the newest token
  const int64_t new_slot = a.new_key != nullptr && ends_context ? a.slot_mapping[seq] : -1;
  grid_dependency_wait();
  if constexpr (std::is_same<QT, CT>::value) {
    if (a.new_key != nullptr && ends_context) write_new_token<Sh>(a, seq, kv_head, new_slot);
  }
  uint4 q_raw[kGroup][Sh::kChunksPerLane][kQueryWords<Sh, QT>];
  load_query<Sh, QT, kGroup>(a, seq, qh0, n_heads, lane_in_row, q_raw);

  auto issue = [&](int i) {
    if (i < n_mine) {
      if (i % kWarpSize == 0 && i > 0) table_ids = load_ids(i);
      const int block = warp_shfl(table_ids, i % kWarpSize);
      const int tok = unit_token(i);
      plan.issue(ring + (i % Sh::kStages) * Sh::kUnitChunks,
                 cache + int64_t(block) * 2 * kv_stride + (tok & (a.block_size - 1)) * kHead,
                 kv_stride);
    }
    async_copy_commit();  // one group per index, empty or not, keeps the wait count exact
  };
#pragma unroll
  for (int i = 0; i < Sh::kStages - 1; ++i) issue(i);

  float q[kGroup][Sh::kDimsPerLane];
  convert_query<Sh, QT, kGroup>(q_raw, a.scale, a.soft_cap, q);
  LaneState<Sh, kGroup> st;
  st.init();
  for (int i = 0; i < n_mine; ++i) {
    issue(i + Sh::kStages - 1);
    async_copy_wait<Sh::kStages - 1>();  // unit i's group is complete
    warp_sync();                         // ... and visible to every lane
    attend_unit<Sh, CT, kGroup>(ring + (i % Sh::kStages) * Sh::kUnitChunks, unit_token(i), lo, end,
                                row_group, lane_in_row, q, a.soft_cap, st);
    warp_sync();  // every lane is done with this stage before it is refilled
  }
  allow_dependent_launch();  // the next kernel (v2's reduce kernel, or the projection) may be scheduled
  async_copy_wait<0>();
  merge_row_groups<Sh, kGroup>(st);
  __syncthreads();  // all warps are done with their rings; reuse them as merge scratch
  // With arrival counts, a sequence of one partition writes its output here; one of several
  // is merged by the partition that finishes last (merge_if_last). Else v2 leaves partials to
  // the reduce kernel.
  const int n_parts = a.partition && a.part_count != nullptr ? partitions_of(a, len) : 0;
  merge_warps_and_store<Sh, QT, kGroup>(a, reinterpret_cast<float*>(smem), st, seq, qh0, n_heads,
                                        part, a.partition == 0 || n_parts == 1);
  if (n_parts > 1) {
    merge_if_last<QT, kGroup, Sh::kVec * Sh::kRowChunks, Sh::kThreads>(
        a, reinterpret_cast<float*>(smem), seq, qh0, n_heads, n_parts);
  }
}

// Block-wide max or sum of one float per thread; `scratch` holds >= warps + 1 floats.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    const float o = warp_shfl_xor(v, off);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = scratch[0];
    for (int w = 1; w < warps; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
    scratch[warps] = r;
  }
  __syncthreads();
  return scratch[warps];
}

// v2 second pass: for one (query head, sequence), weights each partition by
// sum_p * 2^(max_p - max) and writes the normalised combination.
template <typename DT, int kHead>
__global__ void __launch_bounds__(128) paged_decode_reduce_kernel(const DecodeArgs a) {
  extern __shared__ float weights[];  // [max_parts]
  __shared__ float scratch[64];
  grid_dependency_wait();  // launched to overlap the main kernel's tail: wait for its results
  allow_dependent_launch();  // the output projection's GEMV may request its weights from here on
  const int qh = blockIdx.x, seq = blockIdx.y;
  const int len = a.seq_lens[seq];
  const int n_parts = min(a.max_parts, (len + a.partition - 1) / a.partition);
  const int64_t base = (int64_t(seq) * a.num_q_heads + qh) * a.max_parts;
  float m = kNegBig;
  for (int p = threadIdx.x; p < n_parts; p += blockDim.x) m = fmaxf(m, a.part_max[base + p]);
  m = block_reduce<true>(m, scratch);
  float total = 0.f;
  for (int p = threadIdx.x; p < n_parts; p += blockDim.x) {
    const float w = a.part_sum[base + p] * fast_exp2(a.part_max[base + p] - m);
    weights[p] = w;
    total += w;
  }
  total = block_reduce<false>(total, scratch);  // its barriers also publish weights[]
  auto* out =
      static_cast<typename DT::Storage*>(a.out) + seq * a.o_stride_tok + qh * a.o_stride_head;
  for (int d = threadIdx.x; d < kHead; d += blockDim.x) {
    float o = 0.f;
    for (int p = 0; p < n_parts; ++p) o = fmaf(weights[p], a.part_out[(base + p) * kHead + d], o);
    out[d] = DT::from_float(total > 0.f ? o / total : 0.f);
  }
}

template <typename QT, typename CT, int kHead, int kGroup>
cudaError_t launch_paged_decode(const DecodeArgs& a, cudaStream_t stream) {
  using Sh = DecodeShape<CT, kHead, kGroup>;
  auto* kernel = paged_decode_kernel<QT, CT, kHead, kGroup>;
  // Set on every launch: the attribute is per device, and it is not a stream operation, so
  // it is also allowed while a CUDA graph is being captured.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int tiles = (group + kGroup - 1) / kGroup;
  const dim3 grid(a.partition ? a.max_parts : 1, a.num_kv_heads * tiles, a.num_seqs);
  // The merge in the main kernel needs its weights in the stage buffers (and is not built for
  // ROCm); otherwise the reduce kernel merges.
  DecodeArgs b = a;
#ifdef USE_ROCM
  b.part_count = nullptr;
#else
  if (int64_t(kGroup) * (a.max_parts + 1) * int(sizeof(float)) > Sh::kSmemBytes) b.part_count = nullptr;
#endif
  if (a.overlap_previous) {
    err = launch_dependent(kernel, grid, dim3(Sh::kThreads), Sh::kSmemBytes, stream, b);
  } else {
    kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(b);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess || a.partition == 0 || b.part_count != nullptr) return err;
  const dim3 reduce_grid(a.num_q_heads, a.num_seqs);
  return launch_dependent(paged_decode_reduce_kernel<QT, kHead>, reduce_grid, dim3(128),
                          a.max_parts * sizeof(float), stream, a);
}

// Query heads per CTA for one head size: 4 for groups up to 4 (MHA and small GQA groups pad
// with idle heads), else 8 (larger groups are served in tiles of 8); an fp8 cache always 4
// (see paged_decode.cuh).
template <typename QT, typename CT, int kHead>
cudaError_t launch_for_head(const DecodeArgs& a, cudaStream_t stream) {
  if constexpr (sizeof(typename CT::Storage) > 1) {
    if (a.num_q_heads / a.num_kv_heads > 4) return launch_paged_decode<QT, CT, kHead, 8>(a, stream);
  }
  return launch_paged_decode<QT, CT, kHead, 4>(a, stream);
}

// Picks the compile-time shape for the query type QT over the cache type CT.
// Head size 256 (Gemma 2/3) exists for caches of 16-bit or 8-bit elements only: an fp32 row is
// 64 16-byte chunks, more than a warp's lanes, which the unit copy plan needs to cover. On ROCm
// its 8-head tile would need more merge scratch than the single copy stage holds, so groups
// above 4 (no released Gemma has one) are refused there.
template <typename QT, typename CT = QT>
cudaError_t paged_decode_typed(const DecodeArgs& a, cudaStream_t stream) {
  if (a.head_size == 64) return launch_for_head<QT, CT, 64>(a, stream);
  if (a.head_size == 128) return launch_for_head<QT, CT, 128>(a, stream);
  if constexpr (sizeof(typename CT::Storage) <= 2) {
    if (a.head_size == 256) {
#ifdef USE_ROCM
      if (a.num_q_heads / a.num_kv_heads > 4) return cudaErrorInvalidValue;
      return launch_paged_decode<QT, CT, 256, 4>(a, stream);
#else
      return launch_for_head<QT, CT, 256>(a, stream);
#endif
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace core_kernels
