// Shared definitions of the framework-agnostic csrc core: execution-space macro,
// error codes, half/bfloat16 storage types with host+device conversion.
//
// No torch, no CUDA headers needed: plain g++ compiles this; nvcc sees the same code
// with __host__ __device__ markers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TABED_HD __host__ __device__ __forceinline__
#else
#define TABED_HD inline
#endif

namespace tabed {

// Return codes of every core entry point. Values >= kErrCudaBase encode a
// cudaError_t as kErrCudaBase + err (the binding turns it into cudaGetErrorString).
enum Status : int {
  kOk = 0,
  kErrInvalidArgument = 1,  // a size or pointer that cannot be right (N < 1, V < 1, null)
  kErrUnsupportedDtype = 2,
  kErrTooLarge = 3,         // a launch that does not fit the device limits
  kErrCudaBase = 1000,
};

inline const char* status_string(int code) {
  switch (code) {
    case kOk: return "ok";
    case kErrInvalidArgument: return "invalid argument (size or null pointer)";
    case kErrUnsupportedDtype: return "unsupported dtype";
    case kErrTooLarge: return "problem too large for one launch (shared memory)";
    default: return code >= kErrCudaBase ? "CUDA error" : "unknown error";
  }
}

// Floating dtypes of the p rows (greedy accepts any of them).
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Raw 16-bit storage; conversion to float is exact for both formats.
struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

TABED_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  union { uint32_t u; float f; } c;
  c.u = u;
  return c.f;
#endif
}

// Value of an element widened to its accumulation type (float, or double for double).
TABED_HD float to_acc(float x) { return x; }
TABED_HD double to_acc(double x) { return x; }
TABED_HD float to_acc(BFloat16 x) { return bits_to_float(uint32_t(x.bits) << 16); }
TABED_HD float to_acc(Half x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float mag = float(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

template <class T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

// NaN-aware "a beats b" for argmax, matching torch.argmax: NaN is the maximum and
// the lowest index wins among equals (callers only replace on a strict win when
// scanning in increasing index order).
template <class A>
TABED_HD bool is_nan(A x) { return x != x; }

template <class A>
TABED_HD bool argmax_better(A va, int64_t ia, A vb, int64_t ib) {
  const bool na = is_nan(va), nb = is_nan(vb);
  if (na || nb) return na && (!nb || ia < ib);
  return va > vb || (va == vb && ia < ib);
}

}  // namespace tabed
