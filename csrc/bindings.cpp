// torch.library bindings of the csrc core as custom ops in namespace `tabed_engine`
// (Python module tabed_engine._C). This file only checks tensors, allocates outputs
// and forwards raw pointers/strides (and the current CUDA stream) to the core.
//
//   verify_tree(Tensor tokens, Tensor parents, Tensor p, Tensor? q, Tensor? uniforms,
//               bool greedy) -> (Tensor path, Tensor num_accepted, Tensor next_token)
//   compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor lengths,
//              Tensor path, Tensor num_accepted) -> ()
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "compact_kv.h"
#include "verify_tree.h"

#ifdef TABED_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

namespace {

using at::Tensor;

void check_status(int rc, const char* op) {
  if (rc == tabed::kOk) return;
#ifdef TABED_WITH_CUDA
  if (rc >= tabed::kErrCudaBase)
    TORCH_CHECK(false, "tabed_engine::", op, ": CUDA error: ",
                cudaGetErrorString(static_cast<cudaError_t>(rc - tabed::kErrCudaBase)));
#endif
  TORCH_CHECK(false, "tabed_engine::", op, ": ", tabed::status_string(rc), " (code ", rc, ")");
}

tabed::DType to_core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return tabed::DType::kFloat32;
    case at::kDouble: return tabed::DType::kFloat64;
    case at::kHalf: return tabed::DType::kFloat16;
    case at::kBFloat16: return tabed::DType::kBFloat16;
    default: TORCH_CHECK(false, "tabed_engine::verify_tree: p must be float32/float64/float16/bfloat16, got ", t);
  }
}

// ------------------------------------------------------------------- verify_tree

struct VerifyInputs {
  Tensor tokens, parents, p, q, uniforms;
  int64_t B, N, V;
};

VerifyInputs check_verify(const Tensor& tokens, const Tensor& parents, const Tensor& p,
                          const c10::optional<Tensor>& q, const c10::optional<Tensor>& uniforms,
                          bool greedy) {
  TORCH_CHECK(tokens.dim() == 2, "verify_tree: tokens must be [B, N], got shape ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "verify_tree: tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK(parents.scalar_type() == at::kLong, "verify_tree: parents must be int64, got ", parents.scalar_type());
  TORCH_CHECK(parents.sizes() == tokens.sizes(), "verify_tree: parents shape ", parents.sizes(),
              " != tokens shape ", tokens.sizes());
  const int64_t B = tokens.size(0), N = tokens.size(1);
  TORCH_CHECK(N >= 1, "verify_tree: the tree needs at least the root node (N >= 1)");
  TORCH_CHECK(p.dim() == 3 && p.size(0) == B && p.size(1) == N,
              "verify_tree: p must be [B, N, V] = [", B, ", ", N, ", V], got ", p.sizes());
  const int64_t V = p.size(2);
  TORCH_CHECK(V >= 1, "verify_tree: empty vocabulary (V = 0)");
  TORCH_CHECK(tokens.device() == p.device() && parents.device() == p.device(),
              "verify_tree: tokens, parents and p must be on one device, got ", tokens.device(), ", ",
              parents.device(), ", ", p.device());
  VerifyInputs in{tokens, parents, p, Tensor(), Tensor(), B, N, V};
  if (p.stride(2) != 1) in.p = p.contiguous();
  if (greedy) {
    to_core_dtype(p.scalar_type());
    return in;
  }
  TORCH_CHECK(p.scalar_type() == at::kFloat,
              "verify_tree: sampling (greedy=False) needs p as float32 probabilities, got ", p.scalar_type());
  TORCH_CHECK(q.has_value() && q->defined() && q->numel() > 0,
              "verify_tree: sampling (greedy=False) needs the draft probabilities q [B, N, V]");
  TORCH_CHECK(q->sizes() == p.sizes(), "verify_tree: q shape ", q->sizes(), " != p shape ", p.sizes());
  TORCH_CHECK(q->scalar_type() == at::kFloat, "verify_tree: q must be float32, got ", q->scalar_type());
  TORCH_CHECK(q->device() == p.device(), "verify_tree: q is on ", q->device(), ", p on ", p.device());
  TORCH_CHECK(uniforms.has_value() && uniforms->defined(),
              "verify_tree: sampling (greedy=False) needs uniforms [B, N+1]");
  TORCH_CHECK(uniforms->dim() == 2 && uniforms->size(0) == B && uniforms->size(1) == N + 1,
              "verify_tree: uniforms must be [B, N+1] = [", B, ", ", N + 1, "], got ", uniforms->sizes());
  TORCH_CHECK(uniforms->scalar_type() == at::kFloat, "verify_tree: uniforms must be float32, got ",
              uniforms->scalar_type());
  TORCH_CHECK(uniforms->device() == p.device(), "verify_tree: uniforms is on ", uniforms->device(),
              ", p on ", p.device());
  in.q = q->stride(2) == 1 ? *q : q->contiguous();
  in.uniforms = *uniforms;
  return in;
}

tabed::VerifyTreeParams make_params(const VerifyInputs& in, bool greedy, Tensor& path, Tensor& nacc,
                                    Tensor& next) {
  tabed::VerifyTreeParams a;
  a.B = in.B; a.N = in.N; a.V = in.V;
  a.tokens = in.tokens.data_ptr<int64_t>(); a.tokens_sb = in.tokens.stride(0); a.tokens_sn = in.tokens.stride(1);
  a.parents = in.parents.data_ptr<int64_t>(); a.parents_sb = in.parents.stride(0); a.parents_sn = in.parents.stride(1);
  a.p = in.p.data_ptr(); a.p_sb = in.p.stride(0); a.p_sn = in.p.stride(1);
  a.p_dtype = to_core_dtype(in.p.scalar_type());
  a.greedy = greedy;
  if (!greedy) {
    a.q = in.q.data_ptr<float>(); a.q_sb = in.q.stride(0); a.q_sn = in.q.stride(1);
    a.uniforms = in.uniforms.data_ptr<float>(); a.u_sb = in.uniforms.stride(0); a.u_sn = in.uniforms.stride(1);
  }
  a.path = path.data_ptr<int64_t>();
  a.num_accepted = nacc.data_ptr<int64_t>();
  a.next_token = next.data_ptr<int64_t>();
  return a;
}

std::tuple<Tensor, Tensor, Tensor> alloc_outputs(const VerifyInputs& in) {
  const auto opts = in.tokens.options().dtype(at::kLong);
  return {at::empty({in.B, in.N}, opts), at::empty({in.B}, opts), at::empty({in.B}, opts)};
}

std::tuple<Tensor, Tensor, Tensor> verify_tree_cpu(const Tensor& tokens, const Tensor& parents,
                                                   const Tensor& p, const c10::optional<Tensor>& q,
                                                   const c10::optional<Tensor>& uniforms, bool greedy) {
  const VerifyInputs in = check_verify(tokens, parents, p, q, uniforms, greedy);
  TORCH_CHECK(p.device().is_cpu(), "verify_tree (CPU kernel): tensors must be on the CPU");
  auto [path, nacc, next] = alloc_outputs(in);
  const tabed::VerifyTreeParams a = make_params(in, greedy, path, nacc, next);
  std::atomic<int> rc{tabed::kOk};
  // Each request is independent: split the batch over threads, about 64K elements each.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (in.N * in.V));
  at::parallel_for(0, in.B, grain, [&](int64_t b0, int64_t b1) {
    tabed::VerifyTreeParams s = a;
    s.B = b1 - b0;
    s.tokens += b0 * a.tokens_sb;
    s.parents += b0 * a.parents_sb;
    s.p = static_cast<const char*>(a.p) + b0 * a.p_sb * int64_t(in.p.element_size());
    if (!greedy) {
      s.q += b0 * a.q_sb;
      s.uniforms += b0 * a.u_sb;
    }
    s.path += b0 * a.N;
    s.num_accepted += b0;
    s.next_token += b0;
    const int r = tabed::verify_tree_cpu(s);
    if (r != tabed::kOk) rc = r;
  });
  check_status(rc, "verify_tree");
  return {path, nacc, next};
}

std::tuple<Tensor, Tensor, Tensor> verify_tree_meta(const Tensor& tokens, const Tensor& parents,
                                                    const Tensor& p, const c10::optional<Tensor>& q,
                                                    const c10::optional<Tensor>& uniforms, bool greedy) {
  return alloc_outputs(check_verify(tokens, parents, p, q, uniforms, greedy));
}

// -------------------------------------------------------------------- compact_kv

void check_compact(const Tensor& k, const Tensor& v, const Tensor& table, const Tensor& lengths, const Tensor& path,
                   const Tensor& nacc) {
  TORCH_CHECK(k.dim() == 5, "compact_kv: k_cache must be a page pool [L, P, Hkv, PAGE, D], got shape ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "compact_kv: v_cache shape ", v.sizes(), " != k_cache shape ", k.sizes());
  TORCH_CHECK(k.is_floating_point() && v.scalar_type() == k.scalar_type(),
              "compact_kv: k_cache and v_cache must share one float dtype, got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(k.stride(4) == 1 && v.stride(4) == 1, "compact_kv: the head_dim axis of the caches must be contiguous");
  // One buffer holding both caches is fine; the same memory twice would move rows twice.
  const auto overlap = at::get_overlap_status(k, v);
  TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
              "compact_kv: k_cache and v_cache must not share memory");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.stride(1) == 1,
              "compact_kv: block_table must be int32 [R, W] with a contiguous last dimension, got ",
              table.scalar_type(), " ", table.sizes());
  const int64_t R = table.size(0);
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == R, "compact_kv: lengths must be [R] = [", R, "], got ",
              lengths.sizes());
  TORCH_CHECK(lengths.scalar_type() == at::kInt, "compact_kv: lengths must be int32, got ", lengths.scalar_type());
  TORCH_CHECK(path.dim() == 2 && path.size(0) == R && path.size(1) >= 1,
              "compact_kv: path must be [R, N] with R = ", R, ", got ", path.sizes());
  TORCH_CHECK(path.scalar_type() == at::kLong, "compact_kv: path must be int64, got ", path.scalar_type());
  TORCH_CHECK(nacc.dim() == 1 && nacc.size(0) == R, "compact_kv: num_accepted must be [R] = [", R, "], got ",
              nacc.sizes());
  TORCH_CHECK(nacc.scalar_type() == at::kLong, "compact_kv: num_accepted must be int64, got ", nacc.scalar_type());
  for (const Tensor* t : {&v, &table, &lengths, &path, &nacc})
    TORCH_CHECK(t->device() == k.device(), "compact_kv: all tensors must be on ", k.device(), ", got one on ",
                t->device());
}

tabed::CompactKVParams make_compact_params(const Tensor& k, const Tensor& v, const Tensor& table,
                                           const Tensor& lengths, const Tensor& path, const Tensor& nacc) {
  check_compact(k, v, table, lengths, path, nacc);
  tabed::CompactKVParams a;
  a.L = k.size(0); a.R = table.size(0); a.H = k.size(2); a.page = k.size(3); a.D = k.size(4);
  a.S = table.size(1) * a.page;
  a.elem_size = int64_t(k.element_size());
  a.k = k.data_ptr(); a.k_sl = k.stride(0); a.k_sp = k.stride(1); a.k_sh = k.stride(2); a.k_ss = k.stride(3);
  a.v = v.data_ptr(); a.v_sl = v.stride(0); a.v_sp = v.stride(1); a.v_sh = v.stride(2); a.v_ss = v.stride(3);
  a.table = table.data_ptr<int32_t>(); a.table_sr = table.stride(0);
  a.lengths = lengths.data_ptr<int32_t>(); a.lengths_s = lengths.stride(0);
  a.path = path.data_ptr<int64_t>(); a.path_sr = path.stride(0); a.path_sn = path.stride(1);
  a.N = path.size(1);
  a.num_accepted = nacc.data_ptr<int64_t>(); a.num_accepted_s = nacc.stride(0);
  return a;
}

void compact_kv_cpu(Tensor& k, Tensor& v, const Tensor& table, const Tensor& lengths, const Tensor& path,
                    const Tensor& nacc) {
  TORCH_CHECK(k.device().is_cpu(), "compact_kv (CPU kernel): tensors must be on the CPU");
  const tabed::CompactKVParams a = make_compact_params(k, v, table, lengths, path, nacc);
  std::atomic<int> rc{tabed::kOk};
  at::parallel_for(0, a.L, 1, [&](int64_t l0, int64_t l1) {
    tabed::CompactKVParams s = a;
    s.L = l1 - l0;
    s.k = static_cast<char*>(a.k) + l0 * a.k_sl * a.elem_size;
    s.v = static_cast<char*>(a.v) + l0 * a.v_sl * a.elem_size;
    const int r = tabed::compact_kv_cpu(s);
    if (r != tabed::kOk) rc = r;
  });
  check_status(rc, "compact_kv");
}

void compact_kv_meta(Tensor& k, Tensor& v, const Tensor& table, const Tensor& lengths, const Tensor& path,
                     const Tensor& nacc) {
  check_compact(k, v, table, lengths, path, nacc);
}

#ifdef TABED_WITH_CUDA

std::tuple<Tensor, Tensor, Tensor> verify_tree_cuda(const Tensor& tokens, const Tensor& parents,
                                                    const Tensor& p, const c10::optional<Tensor>& q,
                                                    const c10::optional<Tensor>& uniforms, bool greedy) {
  const VerifyInputs in = check_verify(tokens, parents, p, q, uniforms, greedy);
  TORCH_CHECK(p.is_cuda(), "verify_tree (CUDA kernel): tensors must be on a CUDA device");
  const c10::cuda::CUDAGuard guard(p.device());
  auto [path, nacc, next] = alloc_outputs(in);
  tabed::VerifyTreeParams a = make_params(in, greedy, path, nacc, next);
  Tensor ws;
  if (!greedy) {
    ws = at::empty({in.B, 2, in.V}, p.options().dtype(at::kFloat));
    a.workspace = ws.data_ptr<float>();
  }
  check_status(tabed::verify_tree_cuda(a, c10::cuda::getCurrentCUDAStream().stream()), "verify_tree");
  return {path, nacc, next};
}

void compact_kv_cuda(Tensor& k, Tensor& v, const Tensor& table, const Tensor& lengths, const Tensor& path,
                     const Tensor& nacc) {
  TORCH_CHECK(k.is_cuda(), "compact_kv (CUDA kernel): tensors must be on a CUDA device");
  const tabed::CompactKVParams a = make_compact_params(k, v, table, lengths, path, nacc);
  const c10::cuda::CUDAGuard guard(k.device());
  check_status(tabed::compact_kv_cuda(a, c10::cuda::getCurrentCUDAStream().stream()), "compact_kv");
}

#endif  // TABED_WITH_CUDA

}  // namespace

TORCH_LIBRARY(tabed_engine, m) {
  m.def("verify_tree(Tensor tokens, Tensor parents, Tensor p, Tensor? q, Tensor? uniforms, bool greedy) "
        "-> (Tensor path, Tensor num_accepted, Tensor next_token)");
  m.def("compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor lengths, Tensor path, "
        "Tensor num_accepted) -> ()");
}

TORCH_LIBRARY_IMPL(tabed_engine, CPU, m) {
  m.impl("verify_tree", &verify_tree_cpu);
  m.impl("compact_kv", &compact_kv_cpu);
}

// Shape-only kernels so torch.compile / FakeTensor can trace through the ops.
TORCH_LIBRARY_IMPL(tabed_engine, Meta, m) {
  m.impl("verify_tree", &verify_tree_meta);
  m.impl("compact_kv", &compact_kv_meta);
}

#ifdef TABED_WITH_CUDA
TORCH_LIBRARY_IMPL(tabed_engine, CUDA, m) {
  m.impl("verify_tree", &verify_tree_cuda);
  m.impl("compact_kv", &compact_kv_cuda);
}
#endif

// The ops register when the shared library loads; `import tabed_engine._C` only needs
// an (empty) Python module to exist.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "tabed_engine custom ops (torch.ops.tabed_engine)",
                                          -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
