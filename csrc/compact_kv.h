// compact_kv: after tree verification, move the accepted path's KV entries of every
// layer into contiguous slots right after each row's committed prefix.
//
// Caches are paged: pools [L, P, H, PAGE, D] (D contiguous, other strides free) and a block
// table [R, W] int32; row r's slot s lives in page table[r, s / PAGE] at offset s % PAGE, and a
// row spans S = W * PAGE slots. For row r with
// committed length len = lengths[r] and n = num_accepted[r] + 1 entries (root plus
// accepted nodes), entry i in [0, n) moves slot len + path[r, i] to slot len + i, in
// both caches, for every layer and head. Gather semantics: all sources of a
// (cache, layer, row, head) are read before any destination is written, so a
// destination that is also a later source (path [0, 2, 3]) is safe.
//
// Entries are skipped (no write, never out of bounds) when path[r, i] == i (already in
// place), path[r, i] < 0, len < 0, or a source/destination slot falls outside [0, S).
// num_accepted is clamped to [0, N-1]. lengths are not modified.
//
// The op moves bytes, so it is dtype-agnostic: callers pass the element size.
#pragma once

#include <cstdint>

#include "common.h"

namespace tabed {

struct CompactKVParams {
  int64_t L = 0, R = 0, H = 0, S = 0, D = 0;
  int64_t page = 0;       // slots per page; S = table width * page
  int64_t elem_size = 0;  // bytes per element
  void* k = nullptr;  int64_t k_sl = 0, k_sp = 0, k_sh = 0, k_ss = 0;  // strides in elements
  void* v = nullptr;  int64_t v_sl = 0, v_sp = 0, v_sh = 0, v_ss = 0;  // (sp: between pages)
  const int32_t* table = nullptr;         int64_t table_sr = 0;  // [R, S / page], unit last stride
  const int32_t* lengths = nullptr;       int64_t lengths_s = 1;
  const int64_t* path = nullptr;          int64_t path_sr = 0, path_sn = 1;
  int64_t N = 0;                          // path width
  const int64_t* num_accepted = nullptr;  int64_t num_accepted_s = 1;
};

int compact_kv_cpu(const CompactKVParams& prm);
int compact_kv_cuda(const CompactKVParams& prm, void* stream);

// Source slot of entry i of a row, or -1 when the entry is skipped (see above).
TABED_HD int64_t compact_src_slot(int64_t len, int64_t path_i, int64_t i, int64_t S) {
  if (len < 0 || path_i < 0 || path_i == i) return -1;
  const int64_t src = len + path_i, dst = len + i;
  if (src >= S || dst >= S) return -1;
  return src;
}

// Offset in elements of slot s of a row (its table row `tab`) from its (layer, head) base.
TABED_HD int64_t compact_slot_offset(const int32_t* tab, int64_t s, int64_t page, int64_t sp, int64_t ss) {
  return int64_t(tab[s / page]) * sp + (s % page) * ss;
}

// Number of entries (root + accepted) of a row.
TABED_HD int64_t compact_num_entries(int64_t num_accepted, int64_t N) {
  const int64_t a = num_accepted < 0 ? 0 : (num_accepted > N - 1 ? N - 1 : num_accepted);
  return a + 1;
}

}  // namespace tabed
