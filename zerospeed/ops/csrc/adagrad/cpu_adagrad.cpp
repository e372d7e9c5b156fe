// Fused Adagrad over flat fp32 tensors (see includes/cpu_optimizer.h for the loop scheme).
//
// Follows torch.optim.Adagrad's single-tensor path (fma where torch's kernels fuse): `g += wd*p` (L2), `s = s + g*g`,
// `p += (-clr*g) / (sqrt(s) + eps)`, where `clr = lr / (1 + (t-1)*lr_decay)` comes from Python.
#include "cpu_optimizer.h"

namespace zerospeed {

template <typename Out>
void adagrad_chunk(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ sum,
                   Out* __restrict__ out, int64_t begin, int64_t end, float l2, float eps, float neg_clr) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float grad = std::fma(l2, p[i], g[i]);
    const float state_sum = std::fma(grad, grad, sum[i]);
    const float updated = p[i] + neg_clr * grad / (std::sqrt(state_sum) + eps);
    sum[i] = state_sum;
    p[i] = updated;
    store_copy(out, i, updated);
  }
}

void adagrad_update(at::Tensor param, at::Tensor grad, at::Tensor exp_avg_sq, double clr,
                    double eps, double weight_decay, std::optional<at::Tensor> copy_out) {
  check_fp32(param, param, "param");
  check_fp32(grad, param, "grad");
  check_fp32(exp_avg_sq, param, "exp_avg_sq");
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* sum = exp_avg_sq.data_ptr<float>();
  for_each_chunk(param, copy_out, [&](int64_t begin, int64_t end, auto* out) {
    adagrad_chunk(p, g, sum, out, begin, end, float(weight_decay), float(eps), float(-clr));
  });
}

}  // namespace zerospeed

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("adagrad_update", &zerospeed::adagrad_update, "Fused Adagrad step over flat fp32 tensors",
             py::arg("param"), py::arg("grad"), py::arg("exp_avg_sq"), py::arg("clr"), py::arg("eps"),
             py::arg("weight_decay"), py::arg("copy_out") = py::none());
}
