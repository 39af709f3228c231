// CPU entry point of verify_tree: the shared walk (verify_tree.h) with SerialOps.
// Requests are processed one after another; the torch binding parallelises over
// requests by calling this on slices of the batch.
#include <cstddef>
#include <vector>

#include "verify_tree.h"

namespace tabed {

namespace {

template <class T>
void greedy_rows(const VerifyTreeParams& a) {
  SerialOps ops;
  for (int64_t b = 0; b < a.B; ++b) {
    const T* p = static_cast<const T*>(a.p) + b * a.p_sb;
    walk_greedy(ops, a.N, a.tokens + b * a.tokens_sb, a.tokens_sn, a.parents + b * a.parents_sb,
                a.parents_sn, [&](int64_t node) { return ops.argmax(p + node * a.p_sn, a.V); },
                a.path + b * a.N, a.num_accepted + b, a.next_token + b);
  }
}

void stochastic_rows(const VerifyTreeParams& a, float* ws) {
  SerialOps ops;
  const float* p = static_cast<const float*>(a.p);
  for (int64_t b = 0; b < a.B; ++b) {
    walk_stochastic(ops, a.N, a.V, a.tokens + b * a.tokens_sb, a.tokens_sn,
                    a.parents + b * a.parents_sb, a.parents_sn, p + b * a.p_sb, a.p_sn,
                    a.q + b * a.q_sb, a.q_sn, a.uniforms + b * a.u_sb, a.u_sn, ws, ws + a.V,
                    a.path + b * a.N, a.num_accepted + b, a.next_token + b);
  }
}

}  // namespace

int verify_tree_cpu(const VerifyTreeParams& a) {
  if (a.B < 0 || a.N < 1 || a.V < 1) return kErrInvalidArgument;
  if (a.B == 0) return kOk;
  if (!a.tokens || !a.parents || !a.p || !a.path || !a.num_accepted || !a.next_token)
    return kErrInvalidArgument;
  if (a.greedy) {
    switch (a.p_dtype) {
      case DType::kFloat32: greedy_rows<float>(a); return kOk;
      case DType::kFloat64: greedy_rows<double>(a); return kOk;
      case DType::kFloat16: greedy_rows<Half>(a); return kOk;
      case DType::kBFloat16: greedy_rows<BFloat16>(a); return kOk;
    }
    return kErrUnsupportedDtype;
  }
  if (a.p_dtype != DType::kFloat32) return kErrUnsupportedDtype;
  if (!a.q || !a.uniforms) return kErrInvalidArgument;
  // One request at a time, so one [2, V] scratch is enough.
  std::vector<float> own;
  float* ws = a.workspace;
  if (!ws) {
    own.resize(size_t(2 * a.V));
    ws = own.data();
  }
  stochastic_rows(a, ws);
  return kOk;
}

}  // namespace tabed
