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
};

struct Fibers {
  ucontext_t main;
  std::vector<ucontext_t> ctx;
  std::vector<std::vector<char>> stacks;
  std::vector<char> finished;
  const core_sampling::SampleArgs* args;
  int row, n;
  unsigned char* smem;
};

void HostBlock::sync() { swapcontext(&f->ctx[tid], &f->main); }

Fibers* g_fibers;  // makecontext passes int arguments only

void fiber_main(int tid) {
  Fibers* f = g_fibers;
  HostBlock b{tid, f->n, f};
  core_sampling::sample_row(b, *f->args, f->row, f->smem);
  f->finished[tid] = 1;  // then uc_link returns to the scheduler
}

// Returns 0, or 2 when the fibers disagreed about a barrier.
int run_row(const core_sampling::SampleArgs& a, int row, int n, unsigned char* smem,
            uint64_t seed) {
  Fibers f;
  f.args = &a;
  f.row = row;
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

}  // namespace

extern "C" int sample_rows_host(const float* logits, int64_t ld, int rows, int vocab,
                                const double* rowf, const int32_t* rowi, const int32_t* edits,
                                const int32_t* state, int64_t state_ld, int64_t* tokens, float* logprobs, float* lse, int threads,
                                uint64_t seed) {
  if (threads <= 0 || (threads & (threads - 1)) != 0) return 1;
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
  const int chunk = ((vocab + threads - 1) / threads + 3) / 4 * 4;
  // 8-byte aligned (the workspace's widest field), like dynamic shared memory.
  std::vector<double> smem((core_sampling::Workspace::bytes(threads, chunk) + 7) / 8);
  for (int row = 0; row < rows; ++row) {
    const int rc = run_row(a, row, threads, reinterpret_cast<unsigned char*>(smem.data()),
                           seed + static_cast<uint64_t>(row));
    if (rc) return rc;
  }
  return 0;
}
