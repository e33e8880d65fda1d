// One row of the fused sampler: penalties, temperature, top-k / top-p / min-p and the draw,
// with the raw logsumexp for logprobs, for one row of logits by one thread block.
//
// The algorithm is written once against a tiny block interface (tid, n, sync(), atomic_add)
// so that the same source runs on the GPU (sampling.cu: one CUDA block per row) and on the
// host, where tests/unit/test_sampler_kernel.py runs each "thread" as an OS thread with a
// barrier and checks it against the torch sampler on CPU-only CI. No warp-level code, no
// CUDA-only names (cuda_compat.h is not needed), no torch headers.
//
// Semantics (those of core/sampler on the CPU, up to float rounding):
//   z = raw / temperature, where edited tokens (min_tokens mask, logit_bias, repetition,
//   presence and frequency penalties; a host-built list per row, sorted by token) take
//   process(raw) / temperature; top-k keeps z >= the k-th largest value (ties kept), top-p
//   (over the top-k survivors) keeps a token while the mass strictly above it is below
//   top_p * total, min-p keeps z >= max + log(min_p); the token is drawn by inverse CDF in
//   vocabulary order from the row's uniform number u. Greedy rows (temperature 0) take the
//   argmax (of the raw logits when nothing edits the row).
//   Penalty state on the device (optional, per row): a row whose rowi[kPenaltyRow] is >= 0
//   reads the int32 word state[that row * state_ld + token] of every token: bits 0..29 count
//   the token in the row's output (presence/frequency), a nonzero word marks it seen in the
//   prompt or output (repetition); the row's edit list then holds only min_tokens / bias.
//
// Layout: thread t owns the contiguous chunk [t * L, (t + 1) * L) of the vocabulary (L a
// multiple of 4, so 16-byte loads), which keeps the per-thread partial sums in vocabulary
// order: the draw scans T partial sums, then walks one chunk.
//
// Split rows: a launch may give each row several blocks (SampleArgs::splits). Rows with nothing
// to filter or edit (greedy, or plain temperature: no top-k / top-p / min-p, no edits, no
// penalty state) are then shared: block g makes the first pass over the slice [g * S, (g + 1) * S)
// of the vocabulary, stores its statistics, and the row's last block to finish merges them (in
// a fixed order) and draws in two levels, the block whose mass interval holds u * total and,
// within its slice, the chunk and the token, as one block does over the whole row. A lone
// block is latency-bound (one SM walking 128k logits: ~0.1 ms on an H200 for one row), which
// dominates at small batches. Other rows are sampled by their block 0 alone. The interface of
// a block grows fence() (the GPU's __threadfence) and load_fresh(p) (a load from L2, past the
// SM's non-coherent L1) for the hand-over.
//
// Exact cut-offs without a sort of the row: a histogram pass over log2(1 + (max - z)) (exact
// counts, 2^-40 fixed-point masses, so the result does not depend on atomic order) finds the
// bin holding the top-k / top-p boundary; the tokens of that bin and above are collected
// (at most kCandidates), sorted in shared memory, and the cut-off read off exactly. Rows
// where they do not fit fall back to a bisection over the float order (32 counting passes)
// so the result stays exact, only slower.
#pragma once

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define CORE_SAMPLE_FN __device__ inline
#define CORE_SAMPLE_HD __host__ __device__ inline
#define CORE_SAMPLE_VEC4 1
#else
#define CORE_SAMPLE_FN inline
#define CORE_SAMPLE_HD inline
#define CORE_SAMPLE_VEC4 0
#endif

namespace core_sampling {

constexpr int kBins = 2048;            // histogram bins of log2(1 + d) * kBinsPerOctave
constexpr float kBinsPerOctave = 128.f;
constexpr int kCandidates = 2048;      // shared-memory candidate capacity (a power of 2)
constexpr float kMassOne = 1099511627776.f;  // 2^40: fixed-point unit of the masses

// Per-row parameters, packed by core/sampler/kernel.py (keep the indices in step).
enum RowF { kTemperature = 0, kTopP, kMinP, kRepetition, kFrequency, kPresence, kUniform, kRowF = 8 };
enum RowI { kTopK = 0, kEditBegin, kEditEnd, kPenaltyRow, kRowI = 4 };
// One edit: a (row, token) pair some processor changes; bias is a float's bits.
enum EditField { kEditToken = 0, kEditCount, kEditFlags, kEditBias, kEditFields = 4 };
enum EditFlag { kEditMask = 1, kEditRepeat = 2 };
constexpr int32_t kStateCount = (1 << 30) - 1;  // output-count bits of a penalty-state word

struct Stats;

struct SampleArgs {
  const float* logits;     // [rows, ld] float32, the first `vocab` columns are sampled
  int64_t ld;              // row stride in elements
  int rows, vocab;
  bool vec4;               // logits and ld allow 16-byte loads
  const double* rowf;      // [rows, kRowF]
  const int32_t* rowi;     // [rows, kRowI]
  const int32_t* edits;    // [edits, kEditFields], each row's slice sorted by token
  const int32_t* state;    // [state rows, state_ld] penalty state, or null (no row has one)
  int64_t state_ld;        // its row stride in elements (a multiple of 4 when vec4)
  int64_t* tokens;         // [rows] out
  float* logprobs;         // [rows] out: raw logprob of the token
  float* lse;              // [rows] out: logsumexp of the raw row
  int splits;              // blocks per row (>= 1, at most the block's threads; see above)
  Stats* part;             // [rows * splits] the blocks' first-pass statistics (splits > 1)
  unsigned* arrivals;      // [rows] the row's blocks done so far: zero before and after a launch
};

// Vocabulary entries of one split block's slice: a multiple of 4 (16-byte aligned slices).
CORE_SAMPLE_HD int split_len(int vocab, int splits) {
  return ((vocab + splits - 1) / splits + 3) / 4 * 4;
}

// ---- small helpers -----------------------------------------------------------------------
CORE_SAMPLE_FN int imin(int a, int b) { return a < b ? a : b; }

// Order-preserving map of a float to uint32 (ascending), and back.
CORE_SAMPLE_FN uint32_t fkey(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

CORE_SAMPLE_FN float fdecode(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

CORE_SAMPLE_FN float float_of_bits(int32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

// Histogram bin of a token at distance d = max - z >= 0 (kBins: beyond the histogram).
// Monotone in d, so z >= c implies bin(z) <= bin(c).
CORE_SAMPLE_FN int bin_of(float d) {
  const float f = log2f(1.f + d) * kBinsPerOctave;
  return f < static_cast<float>(kBins) ? static_cast<int>(f) : kBins;
}

// Weight exp(z - max) in 2^-40 fixed point: integer sums do not depend on their order.
CORE_SAMPLE_FN uint64_t fixed_mass(float z, float max) {
  return static_cast<uint64_t>(expf(z - max) * kMassOne);
}

// Online logsumexp state: s = sum exp(x - m) over the values seen (NaNs are skipped).
// The sum is a double: a chunk's mass then carries ~1e-16 relative error, not the ~1e-6 of
// float sums of hundreds of terms, so draws near a token boundary match the torch pipeline.
struct Online {
  float m;
  double s;
};

CORE_SAMPLE_FN void online_add(Online& o, float x) {
  if (x > o.m) {
    o.s = o.s * static_cast<double>(expf(o.m - x)) + 1.0;  // o.m = -inf: expf(-inf) = 0
    o.m = x;
  } else if (x > -INFINITY && o.m < INFINITY) {
    o.s += static_cast<double>(expf(x - o.m));
  }
}

CORE_SAMPLE_FN Online online_merge(Online a, Online b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) return Online{m, 0.0};
  const double sa = a.m == -INFINITY ? 0.0 : a.s * static_cast<double>(expf(a.m - m));
  const double sb = b.m == -INFINITY ? 0.0 : b.s * static_cast<double>(expf(b.m - m));
  return Online{m, sa + sb};
}

struct Best {
  float v;
  int i;
};

// The raw argmax follows torch.max: NaN counts as the largest value; ties take the first.
CORE_SAMPLE_FN bool raw_before(float v, int i, Best b) {
  const bool vn = v != v, bn = b.v != b.v;
  if (vn != bn) return vn;
  if (!vn && v != b.v) return v > b.v;
  return i < b.i;
}

CORE_SAMPLE_FN bool z_before(float v, int i, Best b) {
  return v > b.v || (v == b.v && i < b.i);
}

struct Stats {
  Online raw, z;
  Best braw, bz;
};

static_assert(sizeof(Stats) == 48, "the host sizes the split workspace (sampling.py, STATS_BYTES) with this");

CORE_SAMPLE_FN Stats stats_merge(Stats a, const Stats& b) {
  a.raw = online_merge(a.raw, b.raw);
  a.z = online_merge(a.z, b.z);
  if (raw_before(b.braw.v, b.braw.i, a.braw)) a.braw = b.braw;
  if (z_before(b.bz.v, b.bz.i, a.bz)) a.bz = b.bz;
  return a;
}

// ---- shared memory -----------------------------------------------------------------------
struct Broadcast {
  double base, target;
  int owner, bin, token;
  unsigned ncount;
};

CORE_SAMPLE_HD size_t round16(size_t n) { return (n + 15) & ~static_cast<size_t>(15); }

// Shared memory of one block, carved from one buffer (dynamic shared memory on the GPU).
struct Workspace {
  Broadcast* bc;
  double* scratch;        // [T] 8-byte scratch of the reductions and scans
  unsigned char* arena;   // the pass statistics, then histogram + candidates
  int* edit_start;        // [T] each thread's first edit
  float* chunk;           // [L] one chunk, copied for the final walk

  CORE_SAMPLE_HD static size_t arena_bytes(int threads) {
    const size_t stats = static_cast<size_t>(threads) * sizeof(Stats);
    const size_t hist = static_cast<size_t>(kBins) * 12 + static_cast<size_t>(kCandidates) * 8;
    return round16(stats > hist ? stats : hist);
  }
  CORE_SAMPLE_HD static size_t bytes(int threads, int chunk_len) {
    return round16(sizeof(Broadcast)) + round16(threads * 8) + arena_bytes(threads) +
           round16(threads * 4) + round16(chunk_len * 4);
  }
  CORE_SAMPLE_FN static Workspace carve(unsigned char* p, int threads) {
    Workspace w;
    w.bc = reinterpret_cast<Broadcast*>(p);
    p += round16(sizeof(Broadcast));
    w.scratch = reinterpret_cast<double*>(p);
    p += round16(threads * 8);
    w.arena = p;
    p += arena_bytes(threads);
    w.edit_start = reinterpret_cast<int*>(p);
    p += round16(threads * 4);
    w.chunk = reinterpret_cast<float*>(p);
    return w;
  }
  // The histogram and the candidates live in the arena after the first pass.
  CORE_SAMPLE_FN uint32_t* hist_count() const { return reinterpret_cast<uint32_t*>(arena); }
  CORE_SAMPLE_FN uint64_t* hist_mass() const {
    return reinterpret_cast<uint64_t*>(arena + kBins * 4);
  }
  // Candidate weights reuse the histogram once the boundary bin is known.
  CORE_SAMPLE_FN double* cand_weight() const { return reinterpret_cast<double*>(arena); }
  CORE_SAMPLE_FN uint64_t* cand() const {
    return reinterpret_cast<uint64_t*>(arena + kBins * 12);
  }
};

// ---- block collectives (every thread calls them, n is a power of 2) ------------------------
template <class Blk, class V, class Op>
CORE_SAMPLE_FN V block_reduce(Blk& b, V v, V* s, Op op) {
  s[b.tid] = v;
  b.sync();
  for (int half = b.n / 2; half > 0; half >>= 1) {
    if (b.tid < half) s[b.tid] = op(s[b.tid], s[b.tid + half]);
    b.sync();
  }
  const V r = s[0];
  b.sync();
  return r;
}

template <class Blk>
CORE_SAMPLE_FN uint64_t block_sum_u64(Blk& b, uint64_t v, double* scratch) {
  return block_reduce(b, v, reinterpret_cast<uint64_t*>(scratch),
                      [](uint64_t x, uint64_t y) { return x + y; });
}

template <class Blk>
CORE_SAMPLE_FN int block_max_int(Blk& b, int v, double* scratch) {
  return static_cast<int>(block_reduce(b, static_cast<int64_t>(v),
                                       reinterpret_cast<int64_t*>(scratch),
                                       [](int64_t x, int64_t y) { return x > y ? x : y; }));
}

// Inclusive scan of one value per thread (Hillis-Steele): excl of thread t + 1 is incl of
// thread t bit for bit, so the intervals [excl, incl) tile [0, total) without gaps.
template <class Blk, class V>
CORE_SAMPLE_FN void scan_values(Blk& b, V v, V* s, V& excl, V& incl, V& total) {
  s[b.tid] = v;
  b.sync();
  for (int off = 1; off < b.n; off <<= 1) {
    V x = s[b.tid];
    if (b.tid >= off) x += s[b.tid - off];
    b.sync();
    s[b.tid] = x;
    b.sync();
  }
  incl = s[b.tid];
  excl = b.tid ? s[b.tid - 1] : V(0);
  total = s[b.n - 1];
  b.sync();
}

// In-place exclusive scan of a[0, n); returns the total. Each thread scans a contiguous
// segment on top of the scanned segment sums.
template <class Blk, class V>
CORE_SAMPLE_FN V scan_array(Blk& b, V* a, int n, V* s) {
  const int per = (n + b.n - 1) / b.n;
  const int lo = imin(n, b.tid * per), hi = imin(n, lo + per);
  V sum = V(0);
  for (int i = lo; i < hi; ++i) sum += a[i];
  V excl, incl, total;
  scan_values(b, sum, s, excl, incl, total);
  V run = excl;
  for (int i = lo; i < hi; ++i) {
    const V x = a[i];
    a[i] = run;
    run += x;
  }
  b.sync();
  return total;
}

// Ascending bitonic sort of a[0, n), n a power of 2.
template <class Blk>
CORE_SAMPLE_FN void bitonic_sort(Blk& b, uint64_t* a, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = b.tid; i < n; i += b.n) {
        const int l = i ^ j;
        if (l > i) {
          const uint64_t x = a[i], y = a[l];
          if ((x > y) == ((i & k) == 0)) {
            a[i] = y;
            a[l] = x;
          }
        }
      }
      b.sync();
    }
  }
}

// ---- one row -----------------------------------------------------------------------------
struct Row {
  const float* raw;
  int vocab, chunk;        // chunk: elements per thread, a multiple of 4
  bool vec4;
  bool scaled;             // temperature != 1: z = raw / temperature
  float temperature, rep, freq, pres;
  const int32_t* edits;    // this row's edits, sorted by token
  int nedits;
  const int32_t* state;    // this row's penalty-state words [vocab], or null
};

CORE_SAMPLE_FN float processed(const Row& r, int flags, int32_t bias_bits, int count, float x) {
  // The processors' order: min_tokens mask, logit bias, repetition, presence/frequency.
  float v = (flags & kEditMask) ? -INFINITY : x;
  v += float_of_bits(bias_bits);
  if (flags & kEditRepeat) v = v > 0.f ? v / r.rep : v * r.rep;
  if (count > 0) v -= r.freq * static_cast<float>(count) + r.pres;
  v = r.scaled ? v / r.temperature : v;
  // An extreme penalty's overflow stays the most likely token instead of poisoning the row.
  if (v != v) return -INFINITY;
  return v == INFINITY ? FLT_MAX : v;
}

CORE_SAMPLE_FN float plain(const Row& r, float x) {
  const float z = r.scaled ? x / r.temperature : x;
  return z != z ? -INFINITY : z;
}

// Visits f(index, raw, z) over thread t's chunk in vocabulary order. src holds the chunk's
// raw values (the row in global memory at t * chunk, or its shared-memory copy).
template <class F>
CORE_SAMPLE_FN void walk(const Row& r, int t, int edit, const float* src, bool vec4, F&& f) {
  const int begin = t * r.chunk;
  if (begin >= r.vocab) return;
  const int end = imin(begin + r.chunk, r.vocab);
  int next = edit < r.nedits ? r.edits[edit * kEditFields + kEditToken] : INT_MAX;
  // One vocabulary entry: its raw logit x and penalty-state word sw (0 without a state).
  auto one = [&](int idx, float x, int32_t sw) {
    // A state word adds the repetition flag (seen) and the output count.
    const int sflags = sw ? kEditRepeat : 0;
    const int scount = sw & kStateCount;
    float z;
    if (idx == next) {
      const int32_t* e = r.edits + edit * kEditFields;
      z = processed(r, e[kEditFlags] | sflags, e[kEditBias], e[kEditCount] + scount, x);
      ++edit;
      next = edit < r.nedits ? r.edits[edit * kEditFields + kEditToken] : INT_MAX;
    } else if (sflags) {
      z = processed(r, sflags, 0, scount, x);
    } else {
      z = plain(r, x);
    }
    f(idx, x, z);
  };
  // Four entries per pass in scalars, not arrays: arrays indexed by a loop bounded by n
  // (the row's tail) stayed in scratch memory on CDNA (tests/compile/test_hip_compiles.py).
  for (int i = begin; i < end; i += 4) {
    const int n = imin(4, end - i);
    float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    const float* p = src + (i - begin);
#if CORE_SAMPLE_VEC4
    if (vec4 && n == 4) {
      const float4 q = *reinterpret_cast<const float4*>(p);
      v0 = q.x, v1 = q.y, v2 = q.z, v3 = q.w;
      if (r.state) {
        const int4 c = *reinterpret_cast<const int4*>(r.state + i);
        s0 = c.x, s1 = c.y, s2 = c.z, s3 = c.w;
      }
    } else
#endif
    {
      v0 = p[0];
      if (n > 1) v1 = p[1];
      if (n > 2) v2 = p[2];
      if (n > 3) v3 = p[3];
      if (r.state) {
        s0 = r.state[i];
        if (n > 1) s1 = r.state[i + 1];
        if (n > 2) s2 = r.state[i + 2];
        if (n > 3) s3 = r.state[i + 3];
      }
    }
    one(i, v0, s0);
    if (n > 1) one(i + 1, v1, s1);
    if (n > 2) one(i + 2, v2, s2);
    if (n > 3) one(i + 3, v3, s3);
  }
}

template <class Blk>
struct RowSampler {
  Blk& b;
  const Workspace& w;
  const Row& r;
  float zmax;     // max of z over the row
  double u;       // the row's uniform number in [0, 1)

  CORE_SAMPLE_FN const float* mine() const { return r.raw + static_cast<int64_t>(b.tid) * r.chunk; }
  CORE_SAMPLE_FN int my_edit() const { return w.edit_start[b.tid]; }

  // The thread whose interval of the weights' running sum (thread order) holds the target
  // (given, or u times the weights' total, returned in target); base: that interval's start.
  // Where rounding put the target past the end, the last thread with weight.
  CORE_SAMPLE_FN int pick(double weight, bool given, double& target, double& base) {
    double excl, incl, total;
    scan_values(b, weight, w.scratch, excl, incl, total);
    if (!given) target = u * total;
    // A reduction, so ties cannot race.
    int owner = block_max_int(b, weight > 0.0 && excl <= target && target < incl ? b.tid : -1,
                              w.scratch);
    if (owner < 0) owner = block_max_int(b, weight > 0.0 ? b.tid : -1, w.scratch);
    if (owner < 0) owner = 0;
    if (b.tid == owner) w.bc->base = excl;
    b.sync();
    base = w.bc->base;
    b.sync();
    return owner;
  }

  // Thread 0 walks chunk `owner` of row rr (copied to shared memory first) with weights
  // exp(z - zmax) for z >= cut, from the running sum base, to the token at target (an index
  // into rr).
  CORE_SAMPLE_FN int walk_owner(const Row& rr, int owner, double base, double target, float cut) {
    const int begin = owner * rr.chunk;
    const int len = imin(rr.chunk, rr.vocab - begin);
    for (int j = b.tid; j < len; j += b.n) w.chunk[j] = rr.raw[begin + j];
    b.sync();
    if (b.tid == 0) {
      double cum = base;
      int pick = -1, last = -1;
      walk(rr, owner, w.edit_start[owner], w.chunk, true, [&](int i, float, float z) {
        const float wz = z >= cut ? expf(z - zmax) : 0.f;
        if (pick >= 0 || wz <= 0.f) return;
        last = i;
        cum += wz;
        if (cum > target) pick = i;
      });
      w.bc->token = pick >= 0 ? pick : last;
    }
    b.sync();
    return w.bc->token;
  }

  // Draws by inverse CDF from per-thread chunk weights (vocabulary order); the owner
  // chunk is walked again with weights exp(z - zmax) for z >= cut.
  CORE_SAMPLE_FN int draw_chunks(double weight, float cut) {
    double target = 0.0, base = 0.0;
    const int owner = pick(weight, false, target, base);
    return walk_owner(r, owner, base, target, cut);
  }

  // A pass summing exp(z - zmax) over z >= cut per chunk, then the draw.
  CORE_SAMPLE_FN int draw_dense(float cut) {
    double s = 0.0;
    walk(r, b.tid, my_edit(), mine(), r.vec4, [&](int, float, float z) {
      if (z >= cut) s += static_cast<double>(expf(z - zmax));
    });
    return draw_chunks(s, cut);
  }

  // sum over tokens with fkey(z) > t and z >= floor of 1 (count) or fixed_mass (mass).
  CORE_SAMPLE_FN uint64_t above(uint32_t t, float floor, bool mass) {
    uint64_t acc = 0;
    walk(r, b.tid, my_edit(), mine(), r.vec4, [&](int, float, float z) {
      if (fkey(z) > t && z >= floor) acc += mass ? fixed_mass(z, zmax) : 1;
    });
    return block_sum_u64(b, acc, w.scratch);
  }

  // Smallest float order key t with above(t) < target (a present value, see header).
  CORE_SAMPLE_FN float bisect(double target, float floor, bool mass) {
    uint32_t lo = 0, hi = 0xffffffffu;
    while (lo < hi) {
      const uint32_t mid = lo + ((hi - lo) >> 1);
      if (static_cast<double>(above(mid, floor, mass)) < target) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return fdecode(lo);
  }

  // Exact top-k / top-p cut-offs by bisection (rows whose boundary did not fit).
  CORE_SAMPLE_FN float exact_cut(int k, float top_p) {
    float ck = -INFINITY, cp = -INFINITY;
    if (k > 0) ck = bisect(static_cast<double>(k), -INFINITY, false);
    if (top_p < 1.f) {
      const uint64_t total = above(0, ck, true);
      const double target = static_cast<double>(top_p) * static_cast<double>(total);
      cp = target > 0.0 ? bisect(target, ck, true) : zmax;
    }
    return ck > cp ? ck : cp;
  }

  // Histogram pass: returns the boundary bin of top-k (k > 0) or top-p, or -1 when the
  // boundary lies beyond the histogram; *ncand: tokens in that bin and above.
  CORE_SAMPLE_FN int boundary_bin(int k, float top_p, int* ncand) {
    uint32_t* hc = w.hist_count();
    uint64_t* hm = w.hist_mass();
    for (int j = b.tid; j < kBins; j += b.n) {
      hc[j] = 0;
      hm[j] = 0;
    }
    if (b.tid == 0) w.bc->bin = -1;
    b.sync();
    uint64_t spill = 0;  // mass beyond the histogram
    walk(r, b.tid, my_edit(), mine(), r.vec4, [&](int, float, float z) {
      const int bin = bin_of(zmax - z);
      const uint64_t q = fixed_mass(z, zmax);
      if (bin < kBins) {
        b.atomic_add(&hc[bin], 1u);
        b.atomic_add(&hm[bin], q);
      } else {
        spill += q;
      }
    });
    b.sync();
    const uint64_t spilled = block_sum_u64(b, spill, w.scratch);
    const uint32_t count_total = scan_array(b, hc, kBins, reinterpret_cast<uint32_t*>(w.scratch));
    const uint64_t mass_total = scan_array(b, hm, kBins, reinterpret_cast<uint64_t*>(w.scratch));
    const double target = static_cast<double>(top_p) * static_cast<double>(mass_total + spilled);
    for (int j = b.tid; j < kBins; j += b.n) {
      bool hit;
      if (k > 0) {
        const uint32_t incl = j + 1 < kBins ? hc[j + 1] : count_total;
        hit = hc[j] < static_cast<uint32_t>(k) && incl >= static_cast<uint32_t>(k);
      } else {
        const uint64_t incl = j + 1 < kBins ? hm[j + 1] : mass_total;
        hit = (j == 0 || static_cast<double>(hm[j]) < target) &&
              static_cast<double>(incl) >= target;
      }
      if (hit) w.bc->bin = j;
    }
    b.sync();
    const int bin = w.bc->bin;
    *ncand = bin < 0 ? 0 : static_cast<int>(bin + 1 < kBins ? hc[bin + 1] : count_total);
    b.sync();
    return bin;
  }

  // Collects the tokens of bins <= bin as (value descending, index ascending) keys, sorted;
  // returns how many (-1 when more than kCandidates arrived).
  CORE_SAMPLE_FN int collect(int bin, int* padded) {
    uint64_t* c = w.cand();
    if (b.tid == 0) w.bc->ncount = 0;
    b.sync();
    walk(r, b.tid, my_edit(), mine(), r.vec4, [&](int i, float, float z) {
      if (bin_of(zmax - z) > bin) return;
      const unsigned slot = b.atomic_add(&w.bc->ncount, 1u);
      if (slot < static_cast<unsigned>(kCandidates)) {
        c[slot] = (static_cast<uint64_t>(~fkey(z)) << 32) | static_cast<uint32_t>(i);
      }
    });
    b.sync();
    const unsigned got = w.bc->ncount;
    if (got > static_cast<unsigned>(kCandidates)) return -1;
    const int n = static_cast<int>(got);
    int np = 1;
    while (np < n) np <<= 1;
    for (int j = n + b.tid; j < np; j += b.n) c[j] = ~0ull;
    b.sync();
    bitonic_sort(b, c, np);
    *padded = np;
    return n;
  }

  CORE_SAMPLE_FN static float cand_value(uint64_t key) {
    return fdecode(~static_cast<uint32_t>(key >> 32));
  }

  // top-k / top-p cut-off from the sorted candidates, or NAN when the top-p boundary lies
  // past them (then the caller bisects).
  CORE_SAMPLE_FN float candidate_cut(int n, int k, float top_p, double zsum) {
    const uint64_t* c = w.cand();
    const float ck = k > 0 ? cand_value(c[k - 1]) : -INFINITY;
    if (top_p >= 1.f) return ck;
    double* q = w.cand_weight();
    for (int j = b.tid; j < n; j += b.n) {
      const float v = cand_value(c[j]);
      q[j] = v >= ck ? static_cast<double>(expf(v - zmax)) : 0.0;
    }
    b.sync();
    const double cand_total = scan_array(b, q, n, w.scratch);
    const double total = k > 0 ? cand_total : zsum;
    const double target = static_cast<double>(top_p) * total;
    uint64_t kept = 0;
    for (int j = b.tid; j < n; j += b.n) kept += q[j] < target ? 1 : 0;
    kept = block_sum_u64(b, kept, w.scratch);
    if (k == 0 && n < r.vocab && cand_total < target) return NAN;  // nucleus goes on
    const int last = kept > 0 ? static_cast<int>(kept) - 1 : 0;
    const float cp = cand_value(c[last]);
    return ck > cp ? ck : cp;
  }

  // Draw among the candidates with z >= cut (all survivors), in vocabulary order.
  CORE_SAMPLE_FN int draw_candidates(int n, int np, float cut) {
    uint64_t* c = w.cand();
    b.sync();  // every thread has read its cut-off from the sorted keys rewritten here
    for (int j = b.tid; j < np; j += b.n) {
      uint64_t key = ~0ull;
      if (j < n) {
        const uint32_t vk = ~static_cast<uint32_t>(c[j] >> 32);
        if (fdecode(vk) >= cut) key = (static_cast<uint64_t>(static_cast<uint32_t>(c[j])) << 32) | vk;
      }
      c[j] = key;
    }
    b.sync();
    bitonic_sort(b, c, np);
    double* q = w.cand_weight();
    for (int j = b.tid; j < n; j += b.n) {
      q[j] = c[j] == ~0ull ? 0.0 : static_cast<double>(expf(fdecode(static_cast<uint32_t>(c[j])) - zmax));
    }
    b.sync();
    // q is overwritten by its exclusive scan; weights are recomputed from the keys.
    const double total = scan_array(b, q, n, w.scratch);
    const double target = u * total;
    int hit = -1, fallback = -1;
    for (int j = b.tid; j < n; j += b.n) {
      if (c[j] == ~0ull) continue;
      const double next = j + 1 < n ? q[j + 1] : total;
      if (next <= q[j]) continue;  // no weight
      if (q[j] <= target && target < next) hit = j;
      if (q[j] <= target) fallback = j;  // the last weighted candidate at or below target
    }
    const int h = block_max_int(b, hit, w.scratch);
    const int j = h >= 0 ? h : block_max_int(b, fallback, w.scratch);
    return static_cast<int>(c[j >= 0 ? j : 0] >> 32);
  }
};

// Pass 1 over thread t's chunk of r: raw logsumexp and argmax, max and mass of z (token
// indices shifted by `offset`, where r is a slice of the row).
template <class Blk>
CORE_SAMPLE_FN Stats first_pass(Blk& b, const Row& r, int edit, int offset) {
  const bool z_is_raw = !r.scaled && r.nedits == 0 && !r.state;
  Stats mine{{-INFINITY, 0.0}, {-INFINITY, 0.0}, {-INFINITY, INT_MAX}, {-INFINITY, INT_MAX}};
  walk(r, b.tid, edit, r.raw + static_cast<int64_t>(b.tid) * r.chunk, r.vec4,
       [&](int i, float x, float z) {
         i += offset;
         online_add(mine.raw, x);
         if (raw_before(x, i, mine.braw)) mine.braw = Best{x, i};
         if (z_is_raw) return;
         online_add(mine.z, z);
         if (z_before(z, i, mine.bz)) mine.bz = Best{z, i};
       });
  if (z_is_raw) mine.z = mine.raw;
  return mine;
}

template <class Blk>
CORE_SAMPLE_FN Stats block_stats(Blk& b, const Workspace& w, const Stats& mine) {
  return block_reduce(b, mine, reinterpret_cast<Stats*>(w.arena),
                      [](Stats x, const Stats& y) { return stats_merge(x, y); });
}

CORE_SAMPLE_FN float lse_of(const Stats& all) {
  return all.raw.m == -INFINITY ? -INFINITY : all.raw.m + static_cast<float>(log(all.raw.s));
}

// Whether z has usable weights (no infinite logit, some mass).
CORE_SAMPLE_FN bool drawable(const Stats& all) {
  return all.z.m > -INFINITY && all.z.m < INFINITY && all.z.s > 0.0 && all.z.s < INFINITY;
}

// Slice g of a split row: S entries from g * S (fewer, or none, at the end), chunked over the
// block's threads like a row. Only rows without edits or penalty state are split, so neither
// is shifted here (widening the split to such rows would have to).
CORE_SAMPLE_FN Row slice_of(const Row& r, int g, int len, int threads) {
  Row s = r;
  const int lo = imin(g * len, r.vocab);
  s.raw = r.raw + lo;
  s.vocab = imin(len, r.vocab - lo);
  s.chunk = ((len + threads - 1) / threads + 3) / 4 * 4;
  return s;
}

// Block g of a split row (greedy or plain temperature; see the header). Every thread of the
// block calls it; all but the row's last block return after storing their statistics.
template <class Blk>
CORE_SAMPLE_FN void split_row(Blk& b, const SampleArgs& a, int row, int g, const Workspace& w,
                              const Row& r, bool greedy, double u) {
  const int len = split_len(a.vocab, a.splits);
  const Row mine_slice = slice_of(r, g, len, b.n);
  const Stats blk = block_stats(b, w, first_pass(b, mine_slice, 0, imin(g * len, r.vocab)));
  Stats* part = a.part + static_cast<int64_t>(row) * a.splits;
  if (b.tid == 0) {
    part[g] = blk;
    b.fence();  // the statistics are visible before the arrival is counted
    w.bc->owner = b.atomic_add(&a.arrivals[row], 1u) == static_cast<unsigned>(a.splits - 1);
  }
  b.sync();
  const bool last = w.bc->owner != 0;
  b.sync();
  if (!last) return;
  b.fence();  // the other blocks' statistics, counted before this block's arrival
  // Thread t < splits holds block t's statistics; the reduction's order is fixed.
  const Stats none{{-INFINITY, 0.0}, {-INFINITY, 0.0}, {-INFINITY, INT_MAX}, {-INFINITY, INT_MAX}};
  const Stats held = b.tid < a.splits ? b.load_fresh(part + b.tid) : none;
  const Stats all = block_stats(b, w, held);
  if (b.tid == 0) a.arrivals[row] = 0;  // for the next launch
  const float lse = lse_of(all);
  int token;
  if (greedy || !drawable(all)) {
    token = all.braw.i;  // nothing edits the row: the raw argmax
  } else {
    const float zmax = all.z.m;
    RowSampler<Blk> s{b, w, r, zmax, u};
    // Level 1: the block whose share of the mass holds u * total.
    const double share = held.z.m == -INFINITY ? 0.0 : held.z.s * static_cast<double>(expf(held.z.m - zmax));
    double target = 0.0, base = 0.0;
    const int owner_block = s.pick(share, false, target, base);
    // Level 2: within that block's slice, the chunk, then the token.
    const Row sl = slice_of(r, owner_block, len, b.n);
    double weight = 0.0;
    walk(sl, b.tid, 0, sl.raw + static_cast<int64_t>(b.tid) * sl.chunk, sl.vec4,
         [&](int, float, float z) { weight += static_cast<double>(expf(z - zmax)); });
    double rest = target - base, chunk_base = 0.0;
    const int owner = s.pick(weight, true, rest, chunk_base);
    token = imin(owner_block * len, r.vocab) + s.walk_owner(sl, owner, chunk_base, rest, -INFINITY);
  }
  if (b.tid == 0) {
    a.tokens[row] = token;
    a.logprobs[row] = r.raw[token] - lse;
    a.lse[row] = lse;
  }
}

// The whole row; every thread of the block calls it. `smem` has Workspace::bytes(). kSplit:
// the launch gives each row a.splits blocks and `part` is this one's index (see split_row);
// a separate instantiation, so the one-block kernel keeps its registers.
template <bool kSplit, class Blk>
CORE_SAMPLE_FN void sample_row(Blk& b, const SampleArgs& a, int row, unsigned char* smem, int part) {
  const Workspace w = Workspace::carve(smem, b.n);
  const double* f = a.rowf + static_cast<int64_t>(row) * kRowF;
  const int32_t* ip = a.rowi + static_cast<int64_t>(row) * kRowI;
  Row r;
  r.raw = a.logits + static_cast<int64_t>(row) * a.ld;
  r.vocab = a.vocab;
  r.chunk = ((a.vocab + b.n - 1) / b.n + 3) / 4 * 4;
  r.vec4 = a.vec4;
  const bool greedy = f[kTemperature] <= 0.0;
  r.temperature = greedy ? 1.f : static_cast<float>(f[kTemperature]);
  r.scaled = r.temperature != 1.f;
  r.rep = static_cast<float>(f[kRepetition]);
  r.freq = static_cast<float>(f[kFrequency]);
  r.pres = static_cast<float>(f[kPresence]);
  r.edits = a.edits + static_cast<int64_t>(ip[kEditBegin]) * kEditFields;
  r.nedits = ip[kEditEnd] - ip[kEditBegin];
  r.state = a.state && ip[kPenaltyRow] >= 0
                ? a.state + static_cast<int64_t>(ip[kPenaltyRow]) * a.state_ld : nullptr;
  const int k = ip[kTopK];
  const float top_p = static_cast<float>(f[kTopP]);
  const float min_p = static_cast<float>(f[kMinP]);

  if constexpr (kSplit) {  // uniform per block: every thread reads the same row parameters
    const bool plain = r.nedits == 0 && !r.state && (greedy || (k <= 0 && top_p >= 1.f && !(min_p > 0.f)));
    if (plain) {
      w.edit_start[b.tid] = 0;
      b.sync();
      split_row(b, a, row, part, w, r, greedy, f[kUniform]);
      return;
    }
    if (part != 0) return;  // block 0 samples the row alone
  }

  // Each thread's first edit: binary search of the row's sorted tokens.
  {
    int lo = 0, hi = r.nedits;
    const int first = b.tid * r.chunk;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (r.edits[mid * kEditFields + kEditToken] < first) lo = mid + 1; else hi = mid;
    }
    w.edit_start[b.tid] = lo;
  }
  b.sync();

  // Pass 1: raw logsumexp and argmax, max and mass of z, per thread and for the row.
  const Stats mine = first_pass(b, r, w.edit_start[b.tid], 0);
  const Stats all = block_stats(b, w, mine);
  const float lse = lse_of(all);

  int token;
  const float zmax = all.z.m;
  const double zsum = all.z.s;
  if (greedy) {
    token = (r.nedits || r.state) ? all.bz.i : all.braw.i;
  } else if (!drawable(all)) {
    token = all.braw.i;  // no usable weights (an infinite logit): the raw argmax, where it sits
  } else {
    RowSampler<Blk> s{b, w, r, zmax, f[kUniform]};
    float cut = min_p > 0.f ? zmax + logf(min_p) : -INFINITY;
    if (k <= 0 && top_p >= 1.f) {
      if (min_p > 0.f) {
        token = s.draw_dense(cut);
      } else {  // plain temperature: the first pass already holds each chunk's weight
        const double weight =
            mine.z.m == -INFINITY ? 0.0 : mine.z.s * static_cast<double>(expf(mine.z.m - zmax));
        token = s.draw_chunks(weight, cut);
      }
    } else {
      int ncand = 0, np = 0, n = -1;
      const int bin = s.boundary_bin(k, top_p, &ncand);
      if (bin >= 0 && ncand <= kCandidates) n = s.collect(bin, &np);
      if (n != ncand) n = -1;  // (the two passes bin alike; this only guards the invariant)
      const float kp = n >= 0 ? s.candidate_cut(n, k, top_p, zsum) : NAN;
      if (kp == kp) {
        cut = cut > kp ? cut : kp;
        token = s.draw_candidates(n, np, cut);
      } else {
        const float exact = s.exact_cut(k, top_p);
        cut = cut > exact ? cut : exact;
        token = s.draw_dense(cut);
      }
    }
  }
  if (b.tid == 0) {
    a.tokens[row] = token;
    a.logprobs[row] = r.raw[token] - lse;
    a.lse[row] = lse;
  }
}

}  // namespace core_sampling
