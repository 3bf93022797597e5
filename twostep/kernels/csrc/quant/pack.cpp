// The panel layout (layout.h) made from row-major planes at load; quantization/packed.py's
// to_panels is the reference it is tested against.
#include "layout.h"
#include "products.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace twostep::quant {
namespace {

// high bits' places (high_chunks, high_shift) are shifts and masks, not divisions (a Q4_K_M file's
// 5-bit tensors: ~6x faster to pack)
template <int BITS>
inline void pack_panel_row(const Planes& p, int64_t row, int64_t b, int j, uint8_t* block) {
  const uint8_t* src = p.qs + row * p.qs_row() + b * qs_bytes(BITS);
  if constexpr (BITS == 8) {      // codes 2c, 2c + 1: two bytes as they are
    for (int c = 0; c < 16; ++c) std::memcpy(block + 16 * c + 2 * j, src + 2 * c, 2);
  } else {
    const uint8_t* hb = BITS > 4 ? p.qh + row * p.qh_row() + b * qh_bytes(BITS) : nullptr;
    int code[kBlock];             // code i of the row, as the row layout stores it (packed.py)
    for (int i = 0; i < kBlock; ++i) {
      code[i] = i < 16 ? src[i] & 0xF : src[i - 16] >> 4;
      if constexpr (BITS == 5) code[i] |= ((hb[i % 4] >> (i / 4)) & 1) << 4;
      if constexpr (BITS == 6) code[i] |= ((hb[i % 8] >> (2 * (i / 8))) & 3) << 4;
    }
    for (int c = 0; c < 8; ++c) {       // codes 4c + u in the low nibbles, 4c + 2 + u in the high ones
      for (int u = 0; u < 2; ++u) {
        block[16 * c + 2 * j + u] = static_cast<uint8_t>((code[4 * c + u] & 0xF) | ((code[4 * c + 2 + u] & 0xF) << 4));
        if constexpr (BITS > 4)         // the high bits of codes 4c + u (h = 0) and 4c + 2 + u (h = 1)
          for (int h = 0; h < 2; ++h) {
            uint8_t& at = block[kNibbleChunks + 16 * (c / high_chunks(BITS)) + 2 * j + u];
            at |= static_cast<uint8_t>((code[4 * c + 2 * h + u] >> 4) << (4 - high_shift(BITS, c, h)));
          }
      }
    }
  }
}

}  // namespace

void pack_panel_codes(const Planes& p, int64_t n, uint8_t* dst) {
  const int64_t nb = p.k / kBlock, panels = n / kPanel, block_bytes = panel_block(p.bits);
  with_bits(p.bits, [&](auto width) {
    constexpr int BITS = decltype(width)::value;
    at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel)
        for (int64_t b = 0; b < nb; ++b)
          for (int j = 0; j < kPanel; ++j)
            pack_panel_row<BITS>(p, panel * kPanel + j, b, j, dst + (panel * nb + b) * block_bytes);
    });
  });
}

}  // namespace twostep::quant
