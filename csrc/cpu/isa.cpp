// Run-time choice of the kernels' instruction-set path (see isa.h).
#include "isa.h"

#include <atomic>
#include <stdexcept>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace core_cpu {

namespace {

std::vector<Isa> detect() {
  std::vector<Isa> found;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // Compiled only when the build targets AVX-512, so both the build and the CPU must have it.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    found.push_back(Isa::kAvx512);
#endif
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    found.push_back(Isa::kAvx2);
#elif defined(__aarch64__) && defined(__linux__)
  if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) found.push_back(Isa::kNeonDot);
#endif
  found.push_back(Isa::kGeneric);
  return found;
}

const std::vector<Isa>& runnable() {
  static const std::vector<Isa> isas = detect();  // once per process, thread-safe
  return isas;
}

std::atomic<int>& active() {
  static std::atomic<int> isa{static_cast<int>(runnable().front())};
  return isa;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kNeonDot: return "neon_dot";
    default: return "generic";
  }
}

std::vector<Isa> runnable_isas() { return runnable(); }

Isa active_isa() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

Isa set_isa(const std::string& name) {
  if (name == "auto") {
    active().store(static_cast<int>(runnable().front()));
    return active_isa();
  }
  std::string names;
  for (Isa isa : runnable()) {
    if (name == isa_name(isa)) {
      active().store(static_cast<int>(isa));
      return isa;
    }
    names += std::string(names.empty() ? "" : ", ") + isa_name(isa);
  }
  throw std::invalid_argument("CPU kernel path '" + name + "' cannot run on this CPU/build; it runs: " + names +
                              " (or 'auto' for the best of them)");
}

}  // namespace core_cpu
