// CPU entry point of compact_kv: per (cache, layer, row, head) gather the moved slots
// into a scratch buffer, then write them, so overlapping source/destination slots are
// safe. The torch binding parallelises over layers by calling this on slices.
#include <cstring>
#include <cstddef>
#include <vector>

#include "compact_kv.h"

namespace tabed {

int compact_kv_cpu(const CompactKVParams& a) {
  if (a.L < 0 || a.R < 0 || a.H < 0 || a.S < 0 || a.D < 1 || a.N < 1 || a.elem_size < 1 || a.page < 1)
    return kErrInvalidArgument;
  if (a.L == 0 || a.R == 0 || a.H == 0 || a.S == 0) return kOk;
  if (!a.k || !a.v || !a.table || !a.lengths || !a.path || !a.num_accepted) return kErrInvalidArgument;
  const int64_t row_bytes = a.D * a.elem_size;
  std::vector<unsigned char> buf(size_t(a.N * row_bytes));
  std::vector<int64_t> src(size_t(a.N));
  for (int64_t r = 0; r < a.R; ++r) {
    const int64_t len = a.lengths[r * a.lengths_s];
    const int64_t n = compact_num_entries(a.num_accepted[r * a.num_accepted_s], a.N);
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      src[i] = compact_src_slot(len, a.path[r * a.path_sr + i * a.path_sn], i, a.S);
      any = any || src[i] >= 0;
    }
    if (!any) continue;
    const int32_t* tab = a.table + r * a.table_sr;
    for (int cache = 0; cache < 2; ++cache) {
      unsigned char* base = static_cast<unsigned char*>(cache ? a.v : a.k);
      const int64_t sl = cache ? a.v_sl : a.k_sl, sp = cache ? a.v_sp : a.k_sp;
      const int64_t sh = cache ? a.v_sh : a.k_sh, ss = cache ? a.v_ss : a.k_ss;
      for (int64_t l = 0; l < a.L; ++l) {
        for (int64_t h = 0; h < a.H; ++h) {
          unsigned char* head = base + (l * sl + h * sh) * a.elem_size;
          auto at = [&](int64_t s) { return head + compact_slot_offset(tab, s, a.page, sp, ss) * a.elem_size; };
          for (int64_t i = 0; i < n; ++i)
            if (src[i] >= 0) std::memcpy(&buf[size_t(i * row_bytes)], at(src[i]), size_t(row_bytes));
          for (int64_t i = 0; i < n; ++i)
            if (src[i] >= 0) std::memcpy(at(len + i), &buf[size_t(i * row_bytes)], size_t(row_bytes));
        }
      }
    }
  }
  return kOk;
}

}  // namespace tabed
