// Which instruction-set path the CPU kernels take, decided once per process from the running
// CPU's features (never from the build machine's), and forceable to a lower path for tests.
//
// One build holds every path this architecture has: the AVX2 / NEON kernels carry
// per-function target attributes, so they compile whatever -march the library is built with
// and run only when the CPU reports the instructions. The AVX-512 kernels are compiled where
// the build targets AVX-512 (-march=native on such a CPU) and likewise gated at run time.
// Plain C++: no torch headers, so tests/cpu_isa's standalone driver links it too.
#pragma once

#include <string>
#include <vector>

namespace core_cpu {

// Ordered within an architecture: a higher value on x86 implies every lower x86 path runs.
enum class Isa : int {
  kGeneric = 0,  // portable C++ (auto-vectorised for the build target)
  kAvx2 = 1,     // x86-64: AVX2 + FMA + F16C
  kAvx512 = 2,   // x86-64: AVX-512 F/BW/VL (+ BF16 where the CPU has it)
  kNeonDot = 3,  // AArch64: Advanced SIMD with the dot-product extension (sdot)
};

const char* isa_name(Isa isa);

// Paths the running CPU and this build can both execute, best first.
std::vector<Isa> runnable_isas();

// The path in force: the best runnable one unless set_isa chose another.
Isa active_isa();

// Forces `name` ("generic", "avx2", "avx512", "neon_dot" or "auto"); returns the path now in
// force. Throws std::invalid_argument naming what this CPU runs when it cannot take `name`.
Isa set_isa(const std::string& name);

}  // namespace core_cpu
