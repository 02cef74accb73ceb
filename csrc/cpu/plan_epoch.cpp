// The two passes of a sampler's epoch plan (latentfast/cache/feed/sampler.py) that touch every item at
// random: a shuffle in numpy's order, and a stable grouping of the shuffled items by a key per item.
// At 10^8 items each is bound by memory latency (one cache miss per item, ~100 ns), not by arithmetic:
// these do the same work as numpy's, with the next items' addresses prefetched a few dozen steps ahead,
// so the misses overlap instead of following one another.
//
// shuffle_like_numpy: numpy.random.Generator.shuffle(data) of a 1-D int32/int64 array, exactly: the
// same draws from the generator's own bit generator (its bitgen_t, from the capsule), in the same
// order, the same swaps (numpy 1.17+'s Fisher-Yates: i from n-1 down to 1, j = random_interval(i)),
// so the plan is the same with or without the native library. The draws do not depend on the data,
// so they are made ahead of the swaps that use them.
//
// group_by_key: out[cursor[key[v]]++] = v for each v of seq in order (a counting sort's placing pass;
// cursor: where each key's next item goes, the exclusive prefix sums of the keys' counts);
// group_packed, the same for items shuffled with their keys, (key << 32 | item) in one uint64: the keys are
// then read in order, not gathered at random from a table of N (at 10^8 items ~5x faster); pack_keys,
// which makes those words of a block of items and counts their keys in one pass; and
// count_keys, its counting pass: counts[k] += 1 for each key k (numpy's bincount copies its input to int64
// and allocates all the counts again for each block of the input).
//
// sort_segments: each segment items[bounds[s]:bounds[s + 1]] sorted stably by ranks[item] (ints below
// count), in place: a counting sort per segment (a comparison sort of its (rank, place) pairs where the
// ranks outnumber the items), the ranks' reads prefetched.
//
// Not an op's kernel (csrc/cpu/<op>_kernel.cpp): entry points of backends/native.py's HOOKS, whose numpy
// reference is the sampler's own code (tests/test_sampler_kernels.py compares them).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "native.h"

namespace latentfast {
namespace {

// numpy/random/bitgen.h (a stable ABI: numpy's C-API for bit generators)
struct BitGen {
  void* state;
  uint64_t (*next_uint64)(void* st);
  uint32_t (*next_uint32)(void* st);
  double (*next_double)(void* st);
  uint64_t (*next_raw)(void* st);
};

// numpy's random_interval (distributions.c): uniform in [0, max] by masked rejection
inline uint64_t random_interval(BitGen* g, uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (g->next_uint32(g->state) & mask)) > max) {
    }
  } else {
    while ((value = (g->next_uint64(g->state) & mask)) > max) {
    }
  }
  return value;
}

constexpr int64_t kAhead = 64;  // draws (and prefetches) made ahead of their swap: enough misses in flight

template <typename T>
void shuffle(BitGen* g, T* data, int64_t n) {
  int64_t ring[kAhead];  // ring[i % kAhead]: the j drawn for step i
  int64_t drawn = n - 1;  // the next step to draw for (steps run n-1 down to 1)
  for (int64_t i = n - 1; i >= 1; --i) {
    for (; drawn >= 1 && drawn > i - kAhead; --drawn) {
      const int64_t j = static_cast<int64_t>(random_interval(g, static_cast<uint64_t>(drawn)));
      ring[drawn % kAhead] = j;
      __builtin_prefetch(data + j, 1);
    }
    const int64_t j = ring[i % kAhead];
    const T held = data[j];
    data[j] = data[i];
    data[i] = held;
  }
}

template <typename T>
T* checked_vector(const Tensor& t, const char* name) {
  LF_CHECK_VALUE(t.is_cpu() && t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D CPU tensor, got ",
                 t.device_name(), " shape ", t.shape(), " strides ", t.strides());
  return t.ptr<T>();
}

template <typename Item, typename Key>
void group(const Item* seq, int64_t n, const Key* keys, int64_t n_keys, int64_t* cursor, int64_t bound, Item* out,
           int64_t n_out) {
  // three stages kAhead apart: the item's key, then its key's cursor, then the slot the cursor points at
  auto key_of = [&](int64_t i) -> uint64_t {
    const Item v = seq[i];
    LF_CHECK_INDEX(v >= 0 && static_cast<int64_t>(v) < n_keys, "group_by_key: seq[", i, "] = ", static_cast<int64_t>(v),
                   " is not an item of keys [", n_keys, "]");
    const uint64_t k = keys[v];
    LF_CHECK_INDEX(k < static_cast<uint64_t>(bound), "group_by_key: the key of item ", static_cast<int64_t>(v),
                   " is ", k, ", keys must be < ", bound, " (the cursors)");
    return k;
  };
  for (int64_t i = 0; i < n; ++i) {
    if (i + 3 * kAhead < n) __builtin_prefetch(keys + seq[i + 3 * kAhead]);
    if (i + 2 * kAhead < n) __builtin_prefetch(cursor + key_of(i + 2 * kAhead), 1);
    if (i + kAhead < n) {
      const int64_t slot = cursor[key_of(i + kAhead)];
      if (slot >= 0 && slot < n_out) __builtin_prefetch(out + slot, 1);
    }
    const Item v = seq[i];
    const uint64_t k = key_of(i);
    const int64_t slot = cursor[k]++;
    LF_CHECK_INDEX(slot >= 0 && slot < n_out, "group_by_key: key ", k, "'s cursor reached ", slot,
                   ", past out [", n_out, "] (the cursors must be the prefix sums of the keys' counts)");
    out[slot] = v;
  }
}

template <typename Item, typename Rank>
void sort_segments(Item* items, int64_t n_items, const int64_t* bounds, int64_t n_bounds, const Rank* ranks,
                   int64_t n_ranks, int64_t count) {
  for (int64_t s = 0; s + 1 < n_bounds; ++s) {  // every bound checked before an item moves
    LF_CHECK_INDEX(bounds[s] >= 0 && bounds[s] <= bounds[s + 1] && bounds[s + 1] <= n_items,
                   "sort_segments: bounds[", s, ":", s + 2, "] = [", bounds[s], ", ", bounds[s + 1],
                   "] is not a segment of items [", n_items, "]");
  }
  const int64_t last = n_bounds ? bounds[n_bounds - 1] : 0;
  std::vector<uint64_t> rank_of;  // the segment's items' ranks, in place order
  std::vector<Item> sorted;
  std::vector<int64_t> slots, place;
  for (int64_t s = 0; s + 1 < n_bounds; ++s) {
    const int64_t r0 = bounds[s], len = bounds[s + 1] - r0;
    rank_of.resize(len);
    sorted.resize(len);
    for (int64_t i = 0; i < len; ++i) {
      if (r0 + i + kAhead < last) __builtin_prefetch(ranks + items[r0 + i + kAhead]);
      const Item v = items[r0 + i];
      LF_CHECK_INDEX(v >= 0 && static_cast<int64_t>(v) < n_ranks, "sort_segments: items[", r0 + i, "] = ",
                     static_cast<int64_t>(v), " is not an item of ranks [", n_ranks, "]");
      rank_of[i] = ranks[v];
      LF_CHECK_INDEX(rank_of[i] < static_cast<uint64_t>(count), "sort_segments: the rank of item ",
                     static_cast<int64_t>(v), " is ", rank_of[i], ", ranks must be < ", count);
    }
    if (count <= 2 * len + 64) {  // counting sort: the ranks' slots
      slots.assign(count, 0);
      for (int64_t i = 0; i < len; ++i) ++slots[rank_of[i]];
      int64_t sum = 0;
      for (int64_t r = 0; r < count; ++r) sum += std::exchange(slots[r], sum);
      for (int64_t i = 0; i < len; ++i) sorted[slots[rank_of[i]]++] = items[r0 + i];
    } else {  // far more ranks than items: sort the places by rank, ties in place order
      place.resize(len);
      for (int64_t i = 0; i < len; ++i) place[i] = i;
      std::stable_sort(place.begin(), place.end(), [&](int64_t a, int64_t b) { return rank_of[a] < rank_of[b]; });
      for (int64_t i = 0; i < len; ++i) sorted[i] = items[r0 + place[i]];
    }
    std::copy(sorted.begin(), sorted.end(), items + r0);
  }
}

template <typename Item>
void segments_by_rank(const Tensor& items, const Tensor& bounds, const Tensor& ranks, int64_t count) {
  Item* it = checked_vector<Item>(items, "items");
  const int64_t* b = checked_vector<int64_t>(bounds, "bounds");
  const int64_t n = items.size(0), n_bounds = bounds.size(0), n_ranks = ranks.size(0);
  switch (ranks.dtype) {  // ranks are read as unsigned ints of their width
    case kByte: return sort_segments(it, n, b, n_bounds, checked_vector<uint8_t>(ranks, "ranks"), n_ranks, count);
    case kShort: return sort_segments(it, n, b, n_bounds, checked_vector<uint16_t>(ranks, "ranks"), n_ranks, count);
    case kInt: return sort_segments(it, n, b, n_bounds, checked_vector<uint32_t>(ranks, "ranks"), n_ranks, count);
    case kLong: return sort_segments(it, n, b, n_bounds, checked_vector<uint64_t>(ranks, "ranks"), n_ranks, count);
    default:
      LF_CHECK_VALUE(false, "sort_segments: ranks must be 8, 16, 32 or 64-bit ints, got ", dtype_name(ranks.dtype));
  }
}

template <typename Item>
void place_packed(const uint64_t* packed, int64_t n, int64_t* cursor, int64_t bound, Item* out, int64_t n_out) {
  const uint64_t keys = static_cast<uint64_t>(bound);
  for (int64_t i = 0; i < n; ++i) {  // two stages kAhead apart: the key's cursor, then the slot it points at
    if (i + 2 * kAhead < n && (packed[i + 2 * kAhead] >> 32) < keys) {
      __builtin_prefetch(cursor + (packed[i + 2 * kAhead] >> 32), 1);
    }
    if (i + kAhead < n && (packed[i + kAhead] >> 32) < keys) {
      const int64_t slot = cursor[packed[i + kAhead] >> 32];
      if (slot >= 0 && slot < n_out) __builtin_prefetch(out + slot, 1);
    }
    const uint64_t v = packed[i], k = v >> 32;
    LF_CHECK_INDEX(k < keys, "group_packed: packed[", i, "]'s key is ", k, ", keys must be < ", bound,
                   " (the cursors)");
    const int64_t slot = cursor[k]++;
    LF_CHECK_INDEX(slot >= 0 && slot < n_out, "group_packed: key ", k, "'s cursor reached ", slot, ", past out [",
                   n_out, "] (the cursors must be the prefix sums of the keys' counts)");
    out[slot] = static_cast<Item>(v & 0xffffffffu);
  }
}

// packed[i] = keys[i] << 32 | (first + i), counts[keys[i]] += 1
void pack(const int64_t* keys, int64_t n, int64_t first, uint64_t* packed, int64_t* counts, int64_t bound) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = keys[i];
    LF_CHECK_INDEX(k >= 0 && k < bound, "pack_keys: keys[", i, "] = ", k, ", keys must be in [0, ", bound,
                   ") (the counts)");
    ++counts[k];
    packed[i] = static_cast<uint64_t>(k) << 32 | static_cast<uint64_t>(first + i);
  }
}

template <typename Key>
void count(const Key* keys, int64_t n, int64_t* counts, int64_t bound) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = keys[i];
    LF_CHECK_INDEX(k < static_cast<uint64_t>(bound), "count_keys: keys[", i, "] = ", k, ", keys must be < ", bound,
                   " (the counts)");
    ++counts[k];
  }
}

template <typename Item>
void group_keys(const Tensor& seq, const Tensor& keys, const Tensor& cursor, const Tensor& out) {
  const Item* s = checked_vector<Item>(seq, "seq");
  Item* o = checked_vector<Item>(out, "out");
  int64_t* c = checked_vector<int64_t>(cursor, "cursor");
  const int64_t n = seq.size(0), n_keys = keys.size(0), bound = cursor.size(0), n_out = out.size(0);
  switch (keys.dtype) {  // keys are read as unsigned ints of their width
    case kByte: return group(s, n, checked_vector<uint8_t>(keys, "keys"), n_keys, c, bound, o, n_out);
    case kShort: return group(s, n, checked_vector<uint16_t>(keys, "keys"), n_keys, c, bound, o, n_out);
    case kInt: return group(s, n, checked_vector<uint32_t>(keys, "keys"), n_keys, c, bound, o, n_out);
    case kLong: return group(s, n, checked_vector<uint64_t>(keys, "keys"), n_keys, c, bound, o, n_out);
    default:
      LF_CHECK_VALUE(false, "group_by_key: keys must be 8, 16, 32 or 64-bit ints, got ", dtype_name(keys.dtype));
  }
}

}  // namespace
}  // namespace latentfast

using namespace latentfast;

// args: the address of the generator's bitgen_t, data
LATENTFAST_ENTRY(latentfast_shuffle_like_numpy) {
  auto* g = reinterpret_cast<BitGen*>(static_cast<uintptr_t>(in.integer()));
  const Tensor data = in.tensor();
  in.finish();
  LF_CHECK_VALUE(g != nullptr, "shuffle_like_numpy: no bit generator");
  if (data.dtype == kInt) return shuffle(g, checked_vector<int32_t>(data, "data"), data.size(0));
  LF_CHECK_VALUE(data.dtype == kLong, "shuffle_like_numpy: data must be int32 or int64, got ", dtype_name(data.dtype));
  shuffle(g, checked_vector<int64_t>(data, "data"), data.size(0));
}

// args: seq, keys (one per item), cursor (int64, one per key: advanced), out (seq's dtype)
LATENTFAST_ENTRY(latentfast_group_by_key) {
  const Tensor seq = in.tensor(), keys = in.tensor(), cursor = in.tensor(), out = in.tensor();
  in.finish();
  LF_CHECK_VALUE(cursor.dtype == kLong, "group_by_key: cursor must be int64, got ", dtype_name(cursor.dtype));
  LF_CHECK_VALUE(out.dtype == seq.dtype, "group_by_key: out must have seq's dtype ", dtype_name(seq.dtype), ", got ",
                 dtype_name(out.dtype));
  if (seq.dtype == kInt) return group_keys<int32_t>(seq, keys, cursor, out);
  LF_CHECK_VALUE(seq.dtype == kLong, "group_by_key: seq must be int32 or int64, got ", dtype_name(seq.dtype));
  group_keys<int64_t>(seq, keys, cursor, out);
}

// args: items (sorted in place), bounds (int64: segment s is items[bounds[s]:bounds[s + 1]]), ranks (one per
// item), count
LATENTFAST_ENTRY(latentfast_sort_segments) {
  const Tensor items = in.tensor(), bounds = in.tensor(), ranks = in.tensor();
  const int64_t count = in.integer();
  in.finish();
  LF_CHECK_VALUE(bounds.dtype == kLong, "sort_segments: bounds must be int64, got ", dtype_name(bounds.dtype));
  LF_CHECK_VALUE(count >= 0, "sort_segments: count must be >= 0, got ", count);
  if (items.dtype == kInt) return segments_by_rank<int32_t>(items, bounds, ranks, count);
  LF_CHECK_VALUE(items.dtype == kLong, "sort_segments: items must be int32 or int64, got ", dtype_name(items.dtype));
  segments_by_rank<int64_t>(items, bounds, ranks, count);
}

// args: keys, counts (int64, one per key: each key's count added)
LATENTFAST_ENTRY(latentfast_count_keys) {
  const Tensor keys = in.tensor(), counts = in.tensor();
  in.finish();
  LF_CHECK_VALUE(counts.dtype == kLong, "count_keys: counts must be int64, got ", dtype_name(counts.dtype));
  int64_t* c = checked_vector<int64_t>(counts, "counts");
  const int64_t n = keys.size(0), bound = counts.size(0);
  switch (keys.dtype) {  // keys are read as unsigned ints of their width
    case kByte: return count(checked_vector<uint8_t>(keys, "keys"), n, c, bound);
    case kShort: return count(checked_vector<uint16_t>(keys, "keys"), n, c, bound);
    case kInt: return count(checked_vector<uint32_t>(keys, "keys"), n, c, bound);
    case kLong: return count(checked_vector<uint64_t>(keys, "keys"), n, c, bound);
    default:
      LF_CHECK_VALUE(false, "count_keys: keys must be 8, 16, 32 or 64-bit ints, got ", dtype_name(keys.dtype));
  }
}

// args: packed (int64: key << 32 | item), cursor (int64, one per key: advanced), out (int32 or int64)
LATENTFAST_ENTRY(latentfast_group_packed) {
  const Tensor packed = in.tensor(), cursor = in.tensor(), out = in.tensor();
  in.finish();
  LF_CHECK_VALUE(packed.dtype == kLong, "group_packed: packed must be int64, got ", dtype_name(packed.dtype));
  LF_CHECK_VALUE(cursor.dtype == kLong, "group_packed: cursor must be int64, got ", dtype_name(cursor.dtype));
  const auto* p = checked_vector<uint64_t>(packed, "packed");
  int64_t* c = checked_vector<int64_t>(cursor, "cursor");
  const int64_t n = packed.size(0), bound = cursor.size(0), n_out = out.size(0);
  if (out.dtype == kInt) return place_packed(p, n, c, bound, checked_vector<int32_t>(out, "out"), n_out);
  LF_CHECK_VALUE(out.dtype == kLong, "group_packed: out must be int32 or int64, got ", dtype_name(out.dtype));
  place_packed(p, n, c, bound, checked_vector<int64_t>(out, "out"), n_out);
}

// args: keys (int64), first (the first item's number), packed (int64 [len(keys)]: written), counts (int64: added to)
LATENTFAST_ENTRY(latentfast_pack_keys) {
  const Tensor keys = in.tensor();
  const int64_t first = in.integer();
  const Tensor packed = in.tensor(), counts = in.tensor();
  in.finish();
  for (const auto* t : {&keys, &packed, &counts}) {
    LF_CHECK_VALUE(t->dtype == kLong, "pack_keys: keys, packed and counts must be int64, got ", dtype_name(t->dtype));
  }
  LF_CHECK_VALUE(packed.size(0) == keys.size(0), "pack_keys: packed must hold one word per key (", keys.size(0),
                 "), got ", packed.size(0));
  LF_CHECK_VALUE(first >= 0 && first + keys.size(0) <= (int64_t{1} << 32) && counts.size(0) <= (int64_t{1} << 32),
                 "pack_keys: items and keys must be < 2^32, got items from ", first, " to ", first + keys.size(0),
                 " and ", counts.size(0), " keys");
  pack(checked_vector<int64_t>(keys, "keys"), keys.size(0), first, checked_vector<uint64_t>(packed, "packed"),
       checked_vector<int64_t>(counts, "counts"), counts.size(0));
}
