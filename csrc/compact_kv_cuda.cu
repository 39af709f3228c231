// CUDA entry point of compact_kv: one launch for all layers and both caches.
// Block (l, r, h) x cache: threads stage the moved rows of that head in shared memory
// (all loads, barrier, all stores), so overlapping source/destination slots are safe.
// Rows are moved in the widest unit (16, 8, 4, 2 or 1 bytes) that the pointers,
// strides and row size allow.
#include <cuda_runtime.h>

#include <cstdint>

#include "compact_kv.h"

namespace tabed {

namespace {

constexpr int kThreads = 128;

TABED_HD int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

template <class U>
__global__ void __launch_bounds__(kThreads) compact_kv_kernel(CompactKVParams a, int upr) {
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* src = reinterpret_cast<int64_t*>(smem);
  U* buf = reinterpret_cast<U*>(smem + align_up(a.N * int64_t(sizeof(int64_t)), 16));

  int64_t blk = blockIdx.x;
  const int64_t h = blk % a.H;
  blk /= a.H;
  const int64_t r = blk % a.R;
  const int64_t l = blk / a.R;
  const bool is_v = blockIdx.y != 0;

  const int64_t len = a.lengths[r * a.lengths_s];
  const int64_t n = compact_num_entries(a.num_accepted[r * a.num_accepted_s], a.N);
  for (int64_t i = threadIdx.x; i < n; i += kThreads)
    src[i] = compact_src_slot(len, a.path[r * a.path_sr + i * a.path_sn], i, a.S);
  __syncthreads();

  unsigned char* head = static_cast<unsigned char*>(is_v ? a.v : a.k) +
                        (l * (is_v ? a.v_sl : a.k_sl) + h * (is_v ? a.v_sh : a.k_sh)) * a.elem_size;
  const int64_t sp = is_v ? a.v_sp : a.k_sp, ss = is_v ? a.v_ss : a.k_ss;  // elements between pages, slots
  const int32_t* tab = a.table + r * a.table_sr;
  const int total = int(n) * upr;
  for (int e = threadIdx.x; e < total; e += kThreads) {
    const int64_t s = src[e / upr];
    if (s >= 0)
      buf[e] = reinterpret_cast<const U*>(head + compact_slot_offset(tab, s, a.page, sp, ss) * a.elem_size)[e % upr];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < total; e += kThreads) {
    const int i = e / upr;
    if (src[i] >= 0)
      reinterpret_cast<U*>(head + compact_slot_offset(tab, len + i, a.page, sp, ss) * a.elem_size)[e % upr] = buf[e];
  }
}

template <class U>
int launch(const CompactKVParams& a, cudaStream_t s) {
  const int64_t row_bytes = a.D * a.elem_size;
  const int upr = int(row_bytes / int64_t(sizeof(U)));
  const int64_t smem = align_up(a.N * int64_t(sizeof(int64_t)), 16) + a.N * row_bytes;
  if (smem > 48 * 1024) {
    int dev = 0, max_optin = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (smem > max_optin) return kErrTooLarge;
    const cudaError_t e = cudaFuncSetAttribute(compact_kv_kernel<U>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return kErrCudaBase + int(e);
  }
  const dim3 grid(unsigned(a.L * a.R * a.H), 2);
  compact_kv_kernel<U><<<grid, kThreads, size_t(smem), s>>>(a, upr);
  return kOk;
}

// Largest power of two <= 16 dividing every byte offset the kernel forms.
int64_t unit_bytes(const CompactKVParams& a) {
  uint64_t bits = uint64_t(a.D * a.elem_size) | reinterpret_cast<uintptr_t>(a.k) |
                  reinterpret_cast<uintptr_t>(a.v);
  const int64_t strides[] = {a.k_sl, a.k_sp, a.k_sh, a.k_ss, a.v_sl, a.v_sp, a.v_sh, a.v_ss};
  for (int64_t st : strides) bits |= uint64_t(st * a.elem_size);
  int64_t u = 16;
  while (u > 1 && (bits & uint64_t(u - 1))) u >>= 1;
  return u;
}

}  // namespace

int compact_kv_cuda(const CompactKVParams& a, void* stream) {
  if (a.L < 0 || a.R < 0 || a.H < 0 || a.S < 0 || a.D < 1 || a.N < 1 || a.elem_size < 1 || a.page < 1)
    return kErrInvalidArgument;
  if (a.L == 0 || a.R == 0 || a.H == 0 || a.S == 0) return kOk;
  if (!a.k || !a.v || !a.table || !a.lengths || !a.path || !a.num_accepted) return kErrInvalidArgument;
  if (a.L * a.R * a.H > int64_t(0x7fffffff)) return kErrTooLarge;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int rc = kOk;
  switch (unit_bytes(a)) {
    case 16: rc = launch<uint4>(a, s); break;
    case 8: rc = launch<uint2>(a, s); break;
    case 4: rc = launch<uint32_t>(a, s); break;
    case 2: rc = launch<uint16_t>(a, s); break;
    default: rc = launch<uint8_t>(a, s); break;
  }
  if (rc != kOk) return rc;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? kOk : kErrCudaBase + int(err);
}

}  // namespace tabed
