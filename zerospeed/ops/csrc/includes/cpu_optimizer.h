// Shared plumbing of the fused CPU optimizers (cpu_adam, cpu_adagrad, cpu_lion).
//
// Every kernel walks flat, contiguous fp32 tensors (param, grad, states) once. The element loop
// is written as plain scalar code under `#pragma omp simd`: the compiler vectorises it for the
// SIMD flags the builder chose (-mavx512f / -mavx2 / NEON), the tail included, and OpenMP
// threads (through at::parallel_for, so torch.set_num_threads applies) split the range into
// chunks aligned to 64 elements. When a low-precision copy-out tensor is given, the updated
// parameter is also written as bf16 / fp16 in the same pass, rounded to nearest-even exactly as
// `tensor.to(dtype)` does.
#pragma once

// Only the headers needed: <torch/extension.h> would triple the build time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>

#include <cstdint>
#include <cstring>
#include <optional>

namespace zerospeed {

// [Note: fp16 type] GCC >= 12 and clang >= 15 give x86 a native `_Float16` whose conversion
// from float vectorises (vcvtps2ph); aarch64 has `__fp16`. Elsewhere c10::Half does it in scalar.
#if defined(__aarch64__)
using half_t = __fp16;
#elif defined(__FLT16_MAX__)
using half_t = _Float16;
#else
using half_t = c10::Half;
#endif

// No copy-out: the kernel template is instantiated with this tag and the store compiles away.
struct NoCopy {};

inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // nearest-even
  return value != value ? uint16_t(0x7FC0) : uint16_t(rounded);           // NaN stays a NaN
}

inline void store_copy(NoCopy*, int64_t, float) {}
inline void store_copy(uint16_t* out, int64_t i, float value) { out[i] = float_to_bf16_bits(value); }
inline void store_copy(half_t* out, int64_t i, float value) { out[i] = static_cast<half_t>(value); }

// Chunks of at least this many elements per thread: smaller ones cost more to schedule than
// they take to update. A multiple of 64 keeps every chunk start aligned for 512-bit loads.
constexpr int64_t kGrainElements = 1 << 16;

inline void check_fp32(const at::Tensor& tensor, const at::Tensor& param, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(tensor.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(tensor.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(tensor.numel() == param.numel(), name, " has ", tensor.numel(),
              " elements, the parameter ", param.numel());
}

// Calls `kernel(begin, end, out_ptr)` over [0, numel) in parallel chunks; `out_ptr` is typed by
// the copy-out tensor's dtype (NoCopy* when there is none).
template <typename Kernel>
void for_each_chunk(const at::Tensor& param, const std::optional<at::Tensor>& copy_out,
                    Kernel&& kernel) {
  const int64_t numel = param.numel();
  auto run = [&](auto* out) {
    at::parallel_for(0, numel, kGrainElements, [&](int64_t begin, int64_t end) {
      kernel(begin, end, out);
    });
  };
  if (!copy_out.has_value()) {
    run(static_cast<NoCopy*>(nullptr));
    return;
  }
  const at::Tensor& out = *copy_out;
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "copy-out must be a contiguous CPU tensor");
  TORCH_CHECK(out.numel() == numel, "copy-out has ", out.numel(), " elements, the parameter ", numel);
  if (out.scalar_type() == at::kBFloat16) {
    run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else if (out.scalar_type() == at::kHalf) {
    run(reinterpret_cast<half_t*>(out.data_ptr()));
  } else {
    TORCH_CHECK(false, "copy-out must be bfloat16 or float16, got ", out.scalar_type());
  }
}

}  // namespace zerospeed
