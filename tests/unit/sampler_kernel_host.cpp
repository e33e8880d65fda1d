// Runs csrc/sampling/sample_row.cuh on the host for tests/unit/test_sampler_kernel.py, so
// the GPU kernel's own source (the same template) is checked on CPU-only machines.
//
// Each thread of a block is a fiber (ucontext) on one OS thread; sync() returns to a
// scheduler that starts the next phase once every fiber has reached the barrier, running
// the fibers of each phase in a fresh pseudo-random order (an order-dependent read of
// another thread's shared-memory write then shows up as a wrong or varying result). A
// fiber that finishes while others wait at a barrier is a divergent barrier: reported as
// an error, as it would deadlock or misbehave on the GPU. Plain C ABI (loaded with ctypes),
// so it builds in seconds without torch headers. Slow by design: a harness, not a sampler.
#include <ucontext.h>

#include <cstdint>
#include <vector>

#include "sampling/sample_row.cuh"

namespace {

struct Fibers;

struct HostBlock {
  int tid, n;
  Fibers* f;
  void sync();
  unsigned atomic_add(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
  }
  uint64_t atomic_add(uint64_t* p, uint64_t v) {
    const uint64_t old = *p;
    *p = old + v;
    return old;
  }
  void fence() {}  // one OS thread: every store is already visible
  template <class T>
  T load_fresh(const T* p) { return *p; }
};

struct Fibers {
  ucontext_t main;
  std::vector<ucontext_t> ctx;
  std::vector<std::vector<char>> stacks;
  std::vector<char> finished;
  const core_sampling::SampleArgs* args;
  int row, n, part;
  unsigned char* smem;
};

void HostBlock::sync() { swapcontext(&f->ctx[tid], &f->main); }

Fibers* g_fibers;  // makecontext passes int arguments only

void fiber_main(int tid) {
  Fibers* f = g_fibers;
  HostBlock b{tid, f->n, f};
  if (f->args->splits > 1) {
    core_sampling::sample_row<true>(b, *f->args, f->row, f->smem, f->part);
  } else {
    core_sampling::sample_row<false>(b, *f->args, f->row, f->smem, 0);
  }
  f->finished[tid] = 1;  // then uc_link returns to the scheduler
}

// Runs block `part` of row `row`. Returns 0, or 2 when the fibers disagreed about a barrier.
int run_block(const core_sampling::SampleArgs& a, int row, int part, int n, unsigned char* smem,
              uint64_t seed) {
  Fibers f;
  f.args = &a;
  f.row = row;
  f.part = part;
  f.n = n;
  f.smem = smem;
  f.ctx.resize(n);
  f.stacks.assign(n, std::vector<char>(1 << 18));
  f.finished.assign(n, 0);
  g_fibers = &f;
  for (int t = 0; t < n; ++t) {
    getcontext(&f.ctx[t]);
    f.ctx[t].uc_stack.ss_sp = f.stacks[t].data();
    f.ctx[t].uc_stack.ss_size = f.stacks[t].size();
    f.ctx[t].uc_link = &f.main;
    makecontext(&f.ctx[t], reinterpret_cast<void (*)()>(fiber_main), 1, t);
  }
  std::vector<int> order(n);
  for (;;) {
    for (int t = 0; t < n; ++t) order[t] = t;
    for (int t = n - 1; t > 0; --t) {  // Fisher-Yates with a 64-bit LCG
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      const int j = static_cast<int>((seed >> 33) % static_cast<uint64_t>(t + 1));
      const int x = order[t];
      order[t] = order[j];
      order[j] = x;
    }
    for (int t : order) swapcontext(&f.main, &f.ctx[t]);
    int done = 0;
    for (int t = 0; t < n; ++t) done += f.finished[t];
    if (done == n) return 0;
    if (done != 0) return 2;
  }
}

uint64_t lcg(uint64_t& seed) {
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return seed >> 33;
}

}  // namespace

// splits > 1: each row's blocks run one after another in a shuffled order (the GPU finishes
// them in any order; whichever runs last merges). Returns 0; 1 bad arguments; 2 a divergent
// barrier; 3 an arrival count not left at zero.
extern "C" int sample_rows_host(const float* logits, int64_t ld, int rows, int vocab,
                                const double* rowf, const int32_t* rowi, const int32_t* edits,
                                const int32_t* state, int64_t state_ld, int64_t* tokens, float* logprobs, float* lse, int threads,
                                uint64_t seed, int splits) {
  if (threads <= 0 || (threads & (threads - 1)) != 0 || splits < 1 || splits > threads) return 1;
  core_sampling::SampleArgs a{};
  a.logits = logits;
  a.ld = ld;
  a.rows = rows;
  a.vocab = vocab;
  a.vec4 = false;
  a.rowf = rowf;
  a.rowi = rowi;
  a.edits = edits;
  a.state = state;
  a.state_ld = state_ld;
  a.tokens = tokens;
  a.logprobs = logprobs;
  a.lse = lse;
  std::vector<core_sampling::Stats> part(static_cast<size_t>(rows) * splits);
  std::vector<unsigned> arrivals(rows, 0u);
  a.splits = splits;
  a.part = part.data();
  a.arrivals = arrivals.data();
  const int chunk = ((vocab + threads - 1) / threads + 3) / 4 * 4;
  // 8-byte aligned (the workspace's widest field), like dynamic shared memory.
  std::vector<double> smem((core_sampling::Workspace::bytes(threads, chunk) + 7) / 8);
  std::vector<int> order(splits);
  for (int row = 0; row < rows; ++row) {
    uint64_t s = seed + static_cast<uint64_t>(row);
    for (int g = 0; g < splits; ++g) order[g] = g;
    for (int g = splits - 1; g > 0; --g) {
      const int j = static_cast<int>(lcg(s) % static_cast<uint64_t>(g + 1));
      const int x = order[g];
      order[g] = order[j];
      order[j] = x;
    }
    for (int g : order) {
      const int rc = run_block(a, row, g, threads, reinterpret_cast<unsigned char*>(smem.data()),
                               s + static_cast<uint64_t>(g));
      if (rc) return rc;
    }
    if (arrivals[row] != 0) return 3;
  }
  return 0;
}
