// Fused Adam / AdamW over flat fp32 tensors (see includes/cpu_optimizer.h for the loop scheme).
//
// The arithmetic follows torch.optim.Adam/AdamW's single-tensor path operation by operation,
// fused multiply-adds where torch's kernels use them (add with alpha, lerp, addcmul) and none
// elsewhere, so results agree with torch bit for bit: decoupled decay `p *= 1 - lr*wd` (AdamW)
// or L2 `g += wd*p` (Adam); `m = lerp(m, g, 1-b1)`; `v = v*b2 + (1-b2)*g*g`;
// `p += (-step_size*m) / (sqrt(v)/bc2_sqrt + eps)`. The bias-correction scalars `step_size`
// (lr / (1-b1^t)) and `bc2_sqrt` (sqrt(1-b2^t)) come from Python in double precision.
#include "cpu_optimizer.h"

namespace zerospeed {

struct AdamScalars {
  float decay;        // 1 - lr*wd in AdamW mode, else 1
  float l2;           // wd in Adam (L2) mode, else 0
  float lerp_weight;  // 1 - b1
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;
  float eps;
  float neg_step_size;
};

template <typename Out>
void adam_chunk(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                float* __restrict__ v, Out* __restrict__ out, int64_t begin, int64_t end,
                const AdamScalars s) {
  const bool small_weight = s.lerp_weight < 0.5f;
  const float weight_minus_one = s.lerp_weight - 1.0f;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float param = p[i] * s.decay;
    const float grad = std::fma(s.l2, p[i], g[i]);
    const float diff = grad - m[i];
    const float exp_avg = small_weight ? std::fma(s.lerp_weight, diff, m[i]) : std::fma(weight_minus_one, diff, grad);
    const float exp_avg_sq = std::fma(s.one_minus_beta2 * grad, grad, v[i] * s.beta2);
    const float denom = std::sqrt(exp_avg_sq) / s.bc2_sqrt + s.eps;
    const float updated = param + s.neg_step_size * exp_avg / denom;
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    p[i] = updated;
    store_copy(out, i, updated);
  }
}

void adam_update(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                 double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                 double step_size, double bc2_sqrt, std::optional<at::Tensor> copy_out) {
  check_fp32(param, param, "param");
  check_fp32(grad, param, "grad");
  check_fp32(exp_avg, param, "exp_avg");
  check_fp32(exp_avg_sq, param, "exp_avg_sq");
  const AdamScalars s{
      adamw_mode ? float(1.0 - lr * weight_decay) : 1.0f,
      adamw_mode ? 0.0f : float(weight_decay),
      float(1.0 - beta1),
      float(beta2),
      float(1.0 - beta2),
      float(bc2_sqrt),
      float(eps),
      float(-step_size),
  };
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  for_each_chunk(param, copy_out, [&](int64_t begin, int64_t end, auto* out) {
    adam_chunk(p, g, m, v, out, begin, end, s);
  });
}

}  // namespace zerospeed

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("adam_update", &zerospeed::adam_update, "Fused Adam/AdamW step over flat fp32 tensors",
             py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
             py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
             py::arg("adamw_mode"), py::arg("step_size"), py::arg("bc2_sqrt"),
             py::arg("copy_out") = py::none());
  module.def("simd_width", [] {
#if defined(__AVX512__)
    return 16;
#elif defined(__AVX256__)
    return 8;
#elif defined(__NEON__)
    return 4;
#else
    return 1;
#endif
  });
}
