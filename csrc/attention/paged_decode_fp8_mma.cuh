// Paged decode attention over an FP8 (e4m3) KV cache on fp16 tensor cores: head size 128,
// fp16/bf16 queries, NVIDIA sm_80+ (paged_decode_fp8 picks it; other shapes and fp32
// queries take the CUDA-core kernel of paged_decode.cuh).
//
// Why. The CUDA-core kernel does per cached byte what the bf16 kernel does per two bytes:
// widen one element, then an fp32 FMA for each of the tile's query heads, twice (q.k, p.v).
// At Llama-3-8B's group of 4 that is ~9 instructions per byte, and the H200 ran it at 2.6-2.8
// TB/s of its bytes, instruction-bound (docs/benchmarks/kv_fp8.md). Here the products run as
// m16n8k16 mma.sync tiles, so per byte of cache what is left is half a pair conversion
// (e4m3x2 -> f16x2, exact) and a share of a shared-memory load.
//
// Work split, copies, partitions (v1/v2) and the merge are those of paged_decode.cuh: a CTA
// per (sequence, kv head, tile of up to 8 query heads[, partition]); 4 warps take units of 16
// tokens round-robin through their own 3-stage cp.async rings; one unit = 16 key rows then 16
// value rows of 128 bytes. In shared memory chunk c (16 bytes) of row r sits at chunk
// c ^ (r % 8) of that row, which makes both read patterns below conflict-free.
//
// One unit, per warp (lane = 4 g + t):
//   S = Q K^T as two tiles (tokens 0-7, 8-15): A = q, rows = query heads (0-7 used, 8-15 zero),
//     B = K^T, columns = tokens. The 128 dimensions are summed in an order of our choosing,
//     the same for both operands: k-step s, slot pair (2t, 2t+1) <-> dims 32t + 4s + {0, 1},
//     (2t+8, 2t+9) <-> 32t + 4s + {2, 3}. So lane (g, t) reads 32 contiguous bytes of token
//     row g (two 16-byte loads) and holds q of head g, dims 32t..32t+31, as 16 fp16 pairs.
//     q is kept unscaled in fp16 (bf16 -> fp16 is exact in range; it is clamped to +-65504)
//     and the fp32 scores are scaled after the product (the k scale is folded into it).
//   The score tile's layout (head g, tokens 2t, 2t+1 of each half) is exactly the B operand
//   of the next product, P^T with k = tokens, columns = heads, so p goes to fp16 in place.
//   O^T += V^T P^T: A = V^T, rows = dims, k = tokens. Lane (g, t) loads chunk g (dims
//   16g..16g+15) of value rows 2t, 2t+1, 2t+8, 2t+9 and pairs the rows' bytes with byte
//   permutes; m-tile i's rows g and g+8 are dims 16g + 2i and 16g + 2i + 1. The accumulators
//   (8 tiles x 4 floats) hold heads 2t, 2t+1.
// Online softmax: the 4 lanes of head g reduce its max with two shuffles; the running max
// moves lazily as in paged_decode.cuh (p <= 2^8, safe in fp16), and a rescale fetches each
// accumulator column's factor from the lane that owns that head.
// Rows outside [lo, end) (the tail of a partial unit, a window's start) get p = 0 and their
// value codes are zeroed before the product: an unwritten code can be a NaN pattern, and
// 0 x NaN would poison every dimension it meets in the tile.
#pragma once

#include "paged_decode.cuh"

namespace core_kernels {

#if CORE_HAS_FP8_KV

struct Fp8MmaShape {
  static constexpr int kHead = 128;
  static constexpr int kGroup = 8;                    // query heads per CTA: mma rows 0-7
  static constexpr int kUnitRows = 16;                // tokens per unit: the k of one P.V step
  static constexpr int kRowChunks = kHead / 16;       // 16-byte chunks per row
  static constexpr int kHalf = kUnitRows * kRowChunks;  // chunks of keys in a stage
  static constexpr int kUnitChunks = 2 * kHalf;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kStages = kCopyStages;
  static constexpr int kSmemBytes = kWarps * kStages * kUnitChunks * 16;
  static constexpr int kMergeBytes = kWarps * kGroup * (kHead + 2) * int(sizeof(float));
  static_assert(kMergeBytes <= kSmemBytes, "merge scratch reuses the stage buffers");
  static_assert(kRowChunks == 8 && kWarpSize == 32, "the swizzle and fragments assume 8 chunks, 32 lanes");

  __device__ __forceinline__ static int chunk_at(int row, int chunk) {
    return row * kRowChunks + (chunk ^ (row & 7));
  }
};

__device__ __forceinline__ float clamp_half(float x) { return fminf(fmaxf(x, -65504.f), 65504.f); }

template <typename QT>
__global__ void __launch_bounds__(Fp8MmaShape::kThreads, 4) paged_decode_fp8_mma_kernel(const DecodeArgs a) {
  using Sh = Fp8MmaShape;
  extern __shared__ uint4 smem[];
  const int group = a.num_q_heads / a.num_kv_heads;
  const int tiles = (group + Sh::kGroup - 1) / Sh::kGroup;
  const int seq = blockIdx.z, part = blockIdx.x;
  const int kv_head = blockIdx.y / tiles;
  const int qh0 = kv_head * group + (blockIdx.y % tiles) * Sh::kGroup;
  const int n_heads = min(Sh::kGroup, kv_head * group + group - qh0);
  const int len = a.seq_lens[seq];
  const int start = a.partition ? part * a.partition : 0;
  if (part > 0 && start >= len) return;  // past this sequence's last partition
  const int end = a.partition ? min(len, start + a.partition) : len;
  const int lo = a.sliding_window > 0 ? max(0, len - a.sliding_window) : 0;
  const int first_unit = max(start, lo) / Sh::kUnitRows;
  const int n_units = max(0, (end + Sh::kUnitRows - 1) / Sh::kUnitRows - first_unit);

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int n_mine = n_units > warp ? (n_units - warp + Sh::kWarps - 1) / Sh::kWarps : 0;

  const int64_t head_stride = int64_t(a.block_size) * Sh::kHead;
  const int64_t kv_stride = head_stride * a.num_kv_heads;
  const auto* cache = static_cast<const uint8_t*>(a.kv_cache) + kv_head * head_stride;
  const int32_t* table = a.block_tables + seq * a.bt_stride;
  uint4* ring = smem + warp * Sh::kStages * Sh::kUnitChunks;

  auto unit_token = [&](int i) { return (first_unit + warp + i * Sh::kWarps) * Sh::kUnitRows; };
  auto load_ids = [&](int i0) {
    return i0 + lane < n_mine ? table[unit_token(i0 + lane) >> a.block_shift] : 0;
  };
  int table_ids = load_ids(0);
  // Lane copies chunk lane % 8 of rows lane / 8 + 4c (keys, then values): rows of 128
  // contiguous bytes per 8 lanes.
  const int copy_chunk = lane % 8, copy_row = lane / 8;
  auto issue = [&](int i) {
    if (i < n_mine) {
      if (i % kWarpSize == 0 && i > 0) table_ids = load_ids(i);
      const int block = warp_shfl(table_ids, i % kWarpSize);
      const int tok = unit_token(i);
      const uint8_t* keys = cache + int64_t(block) * 2 * kv_stride + (tok & (a.block_size - 1)) * Sh::kHead;
      uint4* stage = ring + (i % Sh::kStages) * Sh::kUnitChunks;
#pragma unroll
      for (int c = 0; c < Sh::kUnitRows / 4; ++c) {
        const int row = copy_row + 4 * c;
        const int src = row * Sh::kHead + copy_chunk * 16;
        async_copy_16(stage + Sh::chunk_at(row, copy_chunk), keys + src);
        async_copy_16(stage + Sh::kHalf + Sh::chunk_at(row, copy_chunk), keys + kv_stride + src);
      }
    }
    async_copy_commit();  // one group per index, empty or not, keeps the wait count exact
  };
#pragma unroll
  for (int i = 0; i < Sh::kStages - 1; ++i) issue(i);

  // q of head g, dims 32t..32t+31, as fp16 pairs: qa[s] = dims 32t + 4s + {0,1}, {2,3}.
  uint32_t qa[8][2];
  {
    float qf[32];
    if (g < n_heads) {
      const auto* qp = static_cast<const typename QT::Storage*>(a.query) + seq * a.q_stride_tok +
                       (qh0 + g) * a.q_stride_head + 32 * t;
#pragma unroll
      for (int w = 0; w < 32 / QT::kVec; ++w) {
        float f[QT::kVec];
        QT::to_float(*reinterpret_cast<const uint4*>(qp + w * QT::kVec), f);
#pragma unroll
        for (int e = 0; e < QT::kVec; ++e) qf[w * QT::kVec + e] = clamp_half(f[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 32; ++e) qf[e] = 0.f;
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      qa[s][0] = float2_to_half2_bits(qf[4 * s], qf[4 * s + 1]);
      qa[s][1] = float2_to_half2_bits(qf[4 * s + 2], qf[4 * s + 3]);
    }
  }
  // Scores leave the tensor cores unscaled: scale (times log2(e) without a soft cap: the
  // kernel works in the log2 domain, see paged_decode.cuh).
  const bool capped = a.soft_cap > 0.f;
  const float score_scale = capped ? a.scale : a.scale * kLog2e;
  const float cap_inv = capped ? 1.f / a.soft_cap : 0.f, cap_out = a.soft_cap * kLog2e;

  float o[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run = kNegBig;  // head g's running max, the same on its four lanes
  float l_run = 0.f;      // this lane's share of head g's sum

  for (int i = 0; i < n_mine; ++i) {
    issue(i + Sh::kStages - 1);
    async_copy_wait<Sh::kStages - 1>();  // unit i's group is complete
    warp_sync();                         // ... and visible to every lane
    const uint4* keys = ring + (i % Sh::kStages) * Sh::kUnitChunks;
    const uint4* values = keys + Sh::kHalf;
    const int tok0 = unit_token(i);

    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      const int row = 8 * n + g;
      const uint4 k0 = keys[Sh::chunk_at(row, 2 * t)], k1 = keys[Sh::chunk_at(row, 2 * t + 1)];
      const uint32_t kw[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
#pragma unroll
      for (int step = 0; step < 8; ++step) {
        const uint32_t af[4] = {qa[step][0], 0u, qa[step][1], 0u};
        const uint32_t bf[2] = {fp8x2_e4m3_bits_to_half2_bits(kw[step] & 0xffffu),
                                fp8x2_e4m3_bits_to_half2_bits(kw[step] >> 16)};
        mma_f16_16x8x16(s[n], af, bf);
      }
    }

    // s[n][e]: head g, token tok0 + 8n + 2t + e (s[n][2..3] are the unused rows 8-15).
    bool valid[2][2];
    float m_new = m_run;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = tok0 + 8 * n + 2 * t + e;
        valid[n][e] = tok >= lo && tok < end && g < n_heads;
        float x = s[n][e] * score_scale;
        if (capped) x = cap_out * tanhf(x * cap_inv);
        s[n][e] = x;
        m_new = valid[n][e] ? fmaxf(m_new, x) : m_new;
      }
    }
    m_new = fmaxf(m_new, warp_shfl_xor(m_new, 1));
    m_new = fmaxf(m_new, warp_shfl_xor(m_new, 2));
    if (warp_any(m_new > m_run + kRescaleLog2)) {
      const float alpha = fast_exp2(m_run - m_new);
      m_run = m_new;
      l_run *= alpha;
      const float a0 = warp_shfl(alpha, 8 * t), a1 = warp_shfl(alpha, 8 * t + 4);  // heads 2t, 2t+1
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        o[m][0] *= a0;
        o[m][1] *= a1;
        o[m][2] *= a0;
        o[m][3] *= a1;
      }
    }
    float p[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[n][e] = valid[n][e] ? fast_exp2(s[n][e] - m_run) : 0.f;
        l_run += p[n][e];
      }
    }
    const uint32_t pb[2] = {float2_to_half2_bits(p[0][0], p[0][1]), float2_to_half2_bits(p[1][0], p[1][1])};

    // Value rows 2t, 2t+1, 2t+8, 2t+9, chunk g; rows outside [lo, end) read as zeros.
    uint32_t vw[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 2 * t + (r & 1) + 8 * (r >> 1);
      const int tok = tok0 + row;
      const uint4 v = values[Sh::chunk_at(row, g)];
      const bool keep = tok >= lo && tok < end;
      vw[r][0] = keep ? v.x : 0u;
      vw[r][1] = keep ? v.y : 0u;
      vw[r][2] = keep ? v.z : 0u;
      vw[r][3] = keep ? v.w : 0u;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t sel = h ? 0x7362u : 0x5140u;  // bytes 2h, 2h+1 of two rows, interleaved
        const uint32_t x = byte_perm(vw[0][j], vw[1][j], sel);  // tokens 2t, 2t+1
        const uint32_t y = byte_perm(vw[2][j], vw[3][j], sel);  // tokens 2t+8, 2t+9
        const uint32_t af[4] = {fp8x2_e4m3_bits_to_half2_bits(x & 0xffffu), fp8x2_e4m3_bits_to_half2_bits(x >> 16),
                                fp8x2_e4m3_bits_to_half2_bits(y & 0xffffu), fp8x2_e4m3_bits_to_half2_bits(y >> 16)};
        mma_f16_16x8x16(o[2 * j + h], af, pb);
      }
    }
    warp_sync();  // every lane is done with this stage before it is refilled
  }
  allow_dependent_launch();  // the v2 reduce kernel may be scheduled from here on
  async_copy_wait<0>();
  l_run += warp_shfl_xor(l_run, 1);
  l_run += warp_shfl_xor(l_run, 2);
  __syncthreads();  // all warps are done with their rings; reuse them as merge scratch
  float* red = reinterpret_cast<float*>(smem);
  constexpr int W = Sh::kWarps, G = Sh::kGroup, D = Sh::kHead;
  float* red_acc = red;                  // [W][G][D]
  float* red_max = red + W * G * D;      // [W][G]
  float* red_sum = red_max + W * G;      // [W][G]
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int d = 16 * g + 2 * m;
    red_acc[(warp * G + 2 * t) * D + d] = o[m][0];
    red_acc[(warp * G + 2 * t + 1) * D + d] = o[m][1];
    red_acc[(warp * G + 2 * t) * D + d + 1] = o[m][2];
    red_acc[(warp * G + 2 * t + 1) * D + d + 1] = o[m][3];
  }
  if (t == 0) {
    red_max[warp * G + g] = m_run;
    red_sum[warp * G + g] = l_run;
  }
  __syncthreads();
  store_merged<QT, W, G, D, Sh::kThreads>(a, red, seq, qh0, n_heads, part, a.partition == 0);
}

template <typename QT>
cudaError_t launch_paged_decode_fp8_mma(const DecodeArgs& a, cudaStream_t stream) {
  using Sh = Fp8MmaShape;
  auto* kernel = paged_decode_fp8_mma_kernel<QT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int tiles = (group + Sh::kGroup - 1) / Sh::kGroup;
  const dim3 grid(a.partition ? a.max_parts : 1, a.num_kv_heads * tiles, a.num_seqs);
  kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess || a.partition == 0) return err;
  const dim3 reduce_grid(a.num_q_heads, a.num_seqs);
  return launch_dependent(paged_decode_reduce_kernel<QT, Sh::kHead>, reduce_grid, dim3(128),
                          a.max_parts * sizeof(float), stream, a);
}

#endif  // CORE_HAS_FP8_KV

}  // namespace core_kernels
