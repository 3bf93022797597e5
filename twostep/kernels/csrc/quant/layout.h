// The packed quantized layouts the products read (twostep/quantization/packed.py writes them), and
// what every source of this library shares about them: a weight's planes (Planes), the block and
// panel geometry, scratch buffers, and the dispatch on a code width.
//
// Row layout: per weight row, qs (4-6-bit codes two to a byte, 8-bit one), qh (5 and 6-bit codes'
// bits above the nibble), an fp16 scale per group (and a min where the format has one).
// Panel layout (the SIMD build's, for every format with n a multiple of 8; pack.cpp makes it from
// the row layout at load): kPanel = 8 weight rows stored together block by block, so a 1-8 row
// product gets eight output columns in the eight int32 lanes of its vectors without a horizontal
// sum, and one vector of eight rows' scales per group. A panel's block starts with 16-byte chunks
// c; bytes 2j and 2j + 1 of a chunk belong to the panel's row j: bits 8: its codes 2c and 2c + 1;
// bits 4-6: the low nibbles of codes 4c and 4c + 1 in the low nibbles, of 4c + 2 and 4c + 3 in the
// high ones. Bits 5 and 6 follow with the bits above the nibble in 16-byte vectors, one per
// P = 4 / w chunks (w = bits - 4): vector c / P's byte 2j + u holds, at bit w (2 (c % P) + h), the
// w high bits of row j's code 4c + 2h + u (the lane order of the chunk's int16 vectors, so one
// shift and one masked or put a chunk's bits in place). qs is [n / 8, blocks, panel_block(bits)]
// bytes (no qh plane), scales / mins [n / 8, groups, 8].
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <memory>
#include <type_traits>

namespace twostep::quant {

constexpr int kBlock = 32;
constexpr int kPanel = 8;      // rows of the panel layout; output columns of the int8 product's panels

// n T's left uninitialised, for a call's scratch arrays that are written before they are read (a
// std::vector zeroes them: with its allocation ~0.8 us of a small call on a Zen 1)
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t n) : data_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }
  bool empty() const { return data_ == nullptr; }

 private:
  std::unique_ptr<T[]> data_;
};

struct Planes {
  const uint8_t* qs;
  const uint8_t* qh;
  const at::Half* scales;
  const at::Half* mins;
  int64_t k;
  int group;
  int zero;
  int64_t qs_row() const { return bits == 8 ? k : k / 2; }
  int64_t qh_row() const { return bits == 5 ? k / 8 : bits == 6 ? k / 4 : 0; }
  int bits;
  bool panels = false;   // the panel layout (above); else row-major planes
  int64_t groups = 0;    // k / group (planes_of sets these two: no division where a loop asks)
  int group_shift = -1;  // log2(group) where group is a power of two
  int64_t groups_row() const { return groups; }
  // the group of weight i of a row: a shift for every GGUF format (an idiv is ~40 cycles on a Zen 1)
  int64_t group_of(int64_t i) const { return group_shift >= 0 ? i >> group_shift : i / group; }
  // where row n's group g's scale (and min) is
  int64_t scale_at(int64_t n, int64_t g) const {
    return panels ? ((n / kPanel) * groups_row() + g) * kPanel + n % kPanel : n * groups_row() + g;
  }
};

// The most rows one call of the panel layout's passes takes: all of them against a panel while it is
// in L1 (L2 for long rows: an 8-bit panel of k = 4,864 is 39 KB), so the weights stream once a call,
// not once per 8 rows (Qwen-shape Q8_0 on a Zen 1, 24-32 rows: 1.02-1.10x the calls of 8 rows)
constexpr int64_t kPanelCallRows = 64;

constexpr int qs_bytes(int bits) { return bits == 8 ? 32 : 16; }
constexpr int qh_bytes(int bits) { return bits == 5 ? 4 : bits == 6 ? 8 : 0; }
// one block of the panel layout: the eight rows' chunks, then their high bits
constexpr int panel_block(int bits) { return (qs_bytes(bits) + qh_bytes(bits)) * kPanel; }
constexpr int kNibbleChunks = 16 * kPanel;   // where a 5 or 6-bit panel block's high bits start
constexpr int high_chunks(int bits) { return 4 / (bits - 4); }   // chunks a vector of high bits covers
// the left shift (negative: right) that moves the high bits of chunk c's half h to bit 4
constexpr int high_shift(int bits, int c, int h) { return 4 - (bits - 4) * (2 * (c % high_chunks(bits)) + h); }

// Code i of the panel's row j in one of its blocks (bytes `block`), in the panel layout
template <int BITS>
inline int panel_code(const uint8_t* block, int j, int i) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(block[16 * (i / 2) + 2 * j + i % 2]);
  } else {
    const uint8_t byte = block[16 * (i / 4) + 2 * j + i % 2];
    int code = i % 4 < 2 ? byte & 0xF : byte >> 4;
    if constexpr (BITS > 4) {
      const int c = i / 4, h = i % 4 / 2;
      const uint8_t high = block[kNibbleChunks + 16 * (c / high_chunks(BITS)) + 2 * j + i % 2];
      code |= ((high >> (4 - high_shift(BITS, c, h))) & ((1 << (BITS - 4)) - 1)) << 4;
    }
    return code;
  }
}


inline float half_to_float(at::Half h) { return static_cast<float>(h); }

// f(std::integral_constant<int, BITS>) for a weight's code width
template <typename F>
void with_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// f(std::integral_constant<int, BITS>, std::bool_constant<G16>) for a weight's code width and
// whether its groups are 16 weights (the products that take half blocks' scales)
template <typename F>
void with_format(const Planes& p, F&& f) {
  with_bits(p.bits, [&](auto bits) {
    p.group == 16 ? f(bits, std::true_type{}) : f(bits, std::false_type{});
  });
}

// A part's planes, checked once (ops.cpp), with its number of weight rows
struct CheckedPlanes {
  Planes p;
  int64_t n;
};

}  // namespace twostep::quant
