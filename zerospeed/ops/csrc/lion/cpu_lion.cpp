// Fused Lion over flat fp32 tensors (see includes/cpu_optimizer.h for the loop scheme).
//
// The update rule (Chen et al., 2023): `c = b1*m + (1-b1)*g`; `p = p*(1 - lr*wd) - lr*sign(c)`;
// `m = b2*m + (1-b2)*g`, with sign(0) = 0 as in torch.sign. The `x*a + y` terms are fused
// multiply-adds, as torch's `add(..., alpha=)` computes them.
#include "cpu_optimizer.h"

namespace zerospeed {

template <typename Out>
void lion_chunk(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                Out* __restrict__ out, int64_t begin, int64_t end, float decay, float lr, float beta1,
                float beta2) {
  const float one_minus_beta1 = 1.0f - beta1;
  const float one_minus_beta2 = 1.0f - beta2;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float mix = std::fma(one_minus_beta1, g[i], m[i] * beta1);
    const float sign = float(mix > 0.0f) - float(mix < 0.0f);
    const float updated = std::fma(-lr, sign, p[i] * decay);
    m[i] = std::fma(one_minus_beta2, g[i], m[i] * beta2);
    p[i] = updated;
    store_copy(out, i, updated);
  }
}

void lion_update(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, double lr, double beta1,
                 double beta2, double weight_decay, std::optional<at::Tensor> copy_out) {
  check_fp32(param, param, "param");
  check_fp32(grad, param, "grad");
  check_fp32(exp_avg, param, "exp_avg");
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  const float decay = float(1.0 - lr * weight_decay);
  for_each_chunk(param, copy_out, [&](int64_t begin, int64_t end, auto* out) {
    lion_chunk(p, g, m, out, begin, end, decay, float(lr), float(beta1), float(beta2));
  });
}

}  // namespace zerospeed

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("lion_update", &zerospeed::lion_update, "Fused Lion step over flat fp32 tensors",
             py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("lr"), py::arg("beta1"),
             py::arg("beta2"), py::arg("weight_decay"), py::arg("copy_out") = py::none());
}
