// The link's blockwise codecs (int8, int4, int2 in the signed and the positive domain, and top-k)
// as CPU kernels: one pass over a block to find its scale, one to write its codes.
//
// Each kernel does, block by block, exactly the operations of the eager (torch) codec in
// mtdao/sync/quantize.py, lowbit.py and topk.py, in the same order and in float32, each correctly
// rounded (built with -ffp-contract=off: no fused multiply-adds; rounding is round-half-to-even,
// as torch.round). So a block encodes to the same bytes and decodes to the same bits on either
// path, which is what lets workers that take different paths end a round with the same values;
// mtdao/sync/native_codecs.py checks it when the library loads. The one freedom is top-k's choice
// among magnitudes tied at the k-th place: here the lowest positions win.
//
// Blocks are rows of a contiguous float32 tensor [rows, block]; payloads are rows of a uint8
// tensor [rows, block_bytes]. Rows are independent, so the result does not depend on how torch's
// intra-op threads share them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrainRows = 64;
constexpr int32_t kAbsMask = 0x7FFFFFFF;
constexpr int32_t kInfPattern = 0x7F800000;  // +inf's bit pattern
constexpr float kInfBits = static_cast<float>(kInfPattern);  // the same, as a float
constexpr int32_t kNegativeZero = INT32_MIN;

// torch.round: to the nearest integer, halves to even. Adding and taking away 2^23 rounds in the
// current (default: to nearest even) mode; from 2^23 on every float is an integer already. Written
// without a call so that the loops vectorize.
inline float round_even(float x) {
  const float magnitude = std::fabs(x);
  const float rounded = std::copysign((magnitude + 8388608.0f) - 8388608.0f, x);
  return magnitude < 8388608.0f ? rounded : x;
}

inline float clamp(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }

inline int32_t pattern_of(float x) {
  int32_t pattern;
  std::memcpy(&pattern, &x, 4);
  return pattern;
}

inline float float_of(int32_t pattern) {
  float x;
  std::memcpy(&x, &pattern, 4);
  return x;
}

// The largest magnitude of a block, NaN if it holds a NaN (as torch's amax): on the bit patterns
// with the sign cleared, whose integer order is the magnitudes' and puts NaN above inf.
inline float abs_max(const float* x, int64_t n) {
  int32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, pattern_of(x[i]) & kAbsMask);
  return largest > kInfPattern ? std::numeric_limits<float>::quiet_NaN() : float_of(largest);
}

// Code i of a byte in its bits `BITS * i` and up.
template <int BITS>
inline void pack_codes(const uint8_t* codes, int64_t n, uint8_t* out) {
  constexpr int kPerByte = 8 / BITS;
  for (int64_t b = 0; b < n / kPerByte; ++b) {
    uint8_t byte = 0;
    for (int i = 0; i < kPerByte; ++i) byte |= codes[b * kPerByte + i] << (BITS * i);
    out[b] = byte;
  }
}

template <int BITS>
inline void unpack_codes(const uint8_t* packed, int64_t n, uint8_t* codes) {
  constexpr int kPerByte = 8 / BITS;
  for (int64_t b = 0; b < n / kPerByte; ++b) {
    for (int i = 0; i < kPerByte; ++i)
      codes[b * kPerByte + i] = (packed[b] >> (BITS * i)) & ((1 << BITS) - 1);
  }
}

// Each row of blocks [rows, n] encoded by encode_row(row, n, dest, scratch) into a payload of
// block_bytes per row; scratch holds n bytes. The row functions take plain restrict pointers, so
// their loops vectorize without checks that their stores might move the loop's bounds.
template <typename RowEncoder>
at::Tensor encode_rows(const at::Tensor& blocks, int64_t block_bytes, RowEncoder encode_row) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kFloat,
              "codec kernels take float32 CPU blocks");
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous(), "codec kernels take [rows, block]");
  const int64_t rows = blocks.size(0), n = blocks.size(1);
  at::Tensor payload = at::empty({rows, block_bytes}, blocks.options().dtype(at::kByte));
  const float* x = blocks.data_ptr<float>();
  uint8_t* out = payload.data_ptr<uint8_t>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(n);
    for (int64_t r = begin; r < end; ++r)
      encode_row(x + r * n, n, out + r * block_bytes, scratch.data());
  });
  return payload;
}

// Each row of a payload [rows, block_bytes] decoded by decode_row(source, n, row, scratch) into
// blocks [rows, n].
template <typename RowDecoder>
at::Tensor decode_rows(const at::Tensor& payload, int64_t block_bytes, int64_t n,
                       RowDecoder decode_row) {
  TORCH_CHECK(payload.device().is_cpu() && payload.scalar_type() == at::kByte,
              "codec kernels take uint8 CPU payloads");
  TORCH_CHECK(payload.dim() == 2 && payload.is_contiguous() && payload.size(1) == block_bytes,
              "codec kernels take [rows, block_bytes]");
  const int64_t rows = payload.size(0);
  at::Tensor blocks = at::empty({rows, n}, payload.options().dtype(at::kFloat));
  const uint8_t* in = payload.data_ptr<uint8_t>();
  float* x = blocks.data_ptr<float>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(n);
    for (int64_t r = begin; r < end; ++r)
      decode_row(in + r * block_bytes, n, x + r * n, scratch.data());
  });
  return blocks;
}

template <typename F>
at::Tensor dispatch_bits(int64_t bits, const F& body) {
  switch (bits) {
    case 8: return body(std::integral_constant<int, 8>());
    case 4: return body(std::integral_constant<int, 4>());
    case 2: return body(std::integral_constant<int, 2>());
  }
  TORCH_CHECK(false, "codes of 8, 4 or 2 bits, got ", bits);
}

// -- signed: integer multiples of a scale ---------------------------------------------------------
// 8 bits: int8 codes -127..127 times absmax / 127 (an all-zero block's scale is 1).
// 4 and 2 bits: codes 0..2 top standing for (code - top) * unit, unit = absmax / top (0 for an
// all-zero block), packed.

template <int BITS>
constexpr float kSignedTop = BITS == 8 ? 127.0f : static_cast<float>((1 << (BITS - 1)) - 1);

template <int BITS>
void encode_signed_row(const float* __restrict row, int64_t n, uint8_t* __restrict dest,
                       uint8_t* __restrict scratch) {
  constexpr float kTop = kSignedTop<BITS>;
  constexpr float kOffset = BITS == 8 ? 0.0f : kTop;  // the code of zero
  uint8_t* __restrict codes = BITS == 8 ? dest : scratch;
  const float absmax = abs_max(row, n);
  const float scale = BITS == 8 && absmax == 0.0f ? 1.0f : absmax / kTop;
  const float divisor = absmax == 0.0f ? 1.0f : scale;
  if (!std::isfinite(divisor)) {  // NaN/inf: any codes, the scale decodes the block non-finite
    std::fill(codes, codes + n, static_cast<uint8_t>(kOffset));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float code = clamp(round_even(row[i] / divisor), -kTop, kTop) + kOffset;
      codes[i] = static_cast<uint8_t>(static_cast<int32_t>(code));  // int8: two's complement
    }
  }
  const int64_t code_bytes = n * BITS / 8;
  if constexpr (BITS != 8) pack_codes<BITS>(codes, n, dest);
  std::memcpy(dest + code_bytes, &scale, 4);
}

template <int BITS>
void decode_signed_row(const uint8_t* __restrict source, int64_t n, float* __restrict row,
                       uint8_t* __restrict scratch) {
  const int64_t code_bytes = n * BITS / 8;
  float scale;
  std::memcpy(&scale, source + code_bytes, 4);
  if constexpr (BITS == 8) {
    const int8_t* __restrict codes = reinterpret_cast<const int8_t*>(source);
    for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(codes[i]) * scale;
  } else {
    unpack_codes<BITS>(source, n, scratch);
    for (int64_t i = 0; i < n; ++i)
      row[i] = (static_cast<float>(scratch[i]) - kSignedTop<BITS>) * scale;
  }
}

at::Tensor encode_signed(const at::Tensor& blocks, int64_t bits) {
  return dispatch_bits(bits, [&](auto b) {
    constexpr int kBits = decltype(b)::value;
    return encode_rows(blocks, blocks.size(-1) * kBits / 8 + 4, encode_signed_row<kBits>);
  });
}

at::Tensor decode_signed(const at::Tensor& payload, int64_t bits, int64_t block) {
  return dispatch_bits(bits, [&](auto b) {
    constexpr int kBits = decltype(b)::value;
    return decode_rows(payload, block * kBits / 8 + 4, block, decode_signed_row<kBits>);
  });
}

// -- positive: log-spaced codes from the bit pattern ----------------------------------------------
// Codes 1 .. steps + 1 spread between the block's smallest and largest positive bit pattern (as a
// float), 0 for zero, steps = 254 for 8 bits and 2^bits - 2 below; the bounds travel as two
// floats, NaN for a corrupt block (NaN, < 0, inf).

inline float log_step(float lo, float hi, float steps) {
  const float step = (hi - lo) / steps;
  return step > 0.0f ? step : 1.0f;
}

template <int BITS>
constexpr float kLogSteps = BITS == 8 ? 254.0f : static_cast<float>((1 << BITS) - 2);

template <int BITS>
void encode_log_row(const float* __restrict row, int64_t n, uint8_t* __restrict dest,
                    uint8_t* __restrict scratch) {
  constexpr float kSteps = kLogSteps<BITS>;
  uint8_t* __restrict codes = BITS == 8 ? dest : scratch;
  // On the bit patterns, whose integer order is the values' for values >= 0 (converting them to
  // float keeps that order, so the bounds are the float patterns' too). A positive value's
  // pattern is > 0; -0.0's is INT32_MIN; any other negative value or a negative NaN has another
  // negative pattern, a positive NaN or inf one >= inf's: the corrupt blocks.
  int32_t largest = 0, smallest_positive = INT32_MAX;
  int32_t negative = 0;  // an int, not a bool, so that the loop vectorizes
  for (int64_t i = 0; i < n; ++i) {
    const int32_t pattern = pattern_of(row[i]);
    largest = std::max(largest, pattern);
    smallest_positive = std::min(smallest_positive, pattern > 0 ? pattern : INT32_MAX);
    negative |= pattern < 0 && pattern != kNegativeZero ? 1 : 0;
  }
  const float hi = static_cast<float>(largest);
  const bool corrupt = negative != 0 || hi >= kInfBits;
  const float lo =  // a block without positive values: lo = hi = 0
      smallest_positive == INT32_MAX ? hi : std::min(static_cast<float>(smallest_positive), hi);
  const float step = log_step(lo, hi, kSteps);
  for (int64_t i = 0; i < n; ++i) {
    const float value = row[i];
    const float pattern = static_cast<float>(pattern_of(value));
    const float code = clamp(round_even((pattern - lo) / step), 0.0f, kSteps) + 1.0f;
    codes[i] = value > 0.0f ? static_cast<uint8_t>(static_cast<int32_t>(code)) : 0;
  }
  const int64_t code_bytes = n * BITS / 8;
  if constexpr (BITS != 8) pack_codes<BITS>(codes, n, dest);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float bounds[2] = {corrupt ? nan : lo, corrupt ? nan : hi};
  std::memcpy(dest + code_bytes, bounds, 8);
}

template <int BITS>
void decode_log_row(const uint8_t* __restrict source, int64_t n, float* __restrict row,
                    uint8_t* __restrict scratch) {
  const int64_t code_bytes = n * BITS / 8;
  float bounds[2];
  std::memcpy(bounds, source + code_bytes, 8);
  const float lo = bounds[0], hi = bounds[1];
  if (std::isnan(lo)) {  // a corrupt block
    std::fill(row, row + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const uint8_t* __restrict codes = source;
  if constexpr (BITS != 8) {
    unpack_codes<BITS>(source, n, scratch);
    codes = scratch;
  }
  const float step = log_step(lo, hi, kLogSteps<BITS>);
  for (int64_t i = 0; i < n; ++i) {
    const float rounded = round_even((static_cast<float>(codes[i]) - 1.0f) * step + lo);
    const int32_t pattern = static_cast<int32_t>(std::min(rounded, hi));
    row[i] = codes[i] == 0 ? 0.0f : float_of(pattern);
  }
}

at::Tensor encode_log(const at::Tensor& blocks, int64_t bits) {
  return dispatch_bits(bits, [&](auto b) {
    constexpr int kBits = decltype(b)::value;
    return encode_rows(blocks, blocks.size(-1) * kBits / 8 + 8, encode_log_row<kBits>);
  });
}

at::Tensor decode_log(const at::Tensor& payload, int64_t bits, int64_t block) {
  return dispatch_bits(bits, [&](auto b) {
    constexpr int kBits = decltype(b)::value;
    return decode_rows(payload, block * kBits / 8 + 8, block, decode_log_row<kBits>);
  });
}

// -- top-k: the k largest magnitudes of a block, as int8 with one scale, and their positions -----

// The k-th largest of n keys >= 0: the largest t with at least k keys >= t, built bit by bit
// from the top (31 counting passes that vectorize, where a selection would branch on every key).
inline int32_t kth_largest(const int32_t* __restrict keys, int64_t n, int64_t k) {
  int32_t threshold = 0;
  for (int bit = 30; bit >= 0; --bit) {
    const int32_t candidate = threshold | (int32_t{1} << bit);
    int32_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += keys[i] >= candidate ? 1 : 0;
    if (count >= k) threshold = candidate;
  }
  return threshold;
}

void encode_topk_row(const float* __restrict row, int64_t n, int64_t k, uint8_t* __restrict dest) {
  // Magnitudes as bit patterns with the sign cleared (integer order is the magnitudes', a NaN
  // above inf, so a NaN is kept and its block decodes to NaN).
  int32_t keys[256];
  for (int64_t i = 0; i < n; ++i) keys[i] = pattern_of(row[i]) & kAbsMask;
  const int32_t threshold = kth_largest(keys, n, k);
  int64_t ties = k;  // positions at the threshold to keep: the lowest ones
  for (int64_t i = 0; i < n; ++i) ties -= keys[i] > threshold;
  int64_t kept[256], count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] > threshold || (keys[i] == threshold && ties-- > 0)) kept[count++] = i;
  }
  int32_t largest = 0;
  for (int64_t j = 0; j < k; ++j) largest = std::max(largest, keys[kept[j]]);
  const float absmax =
      largest > kInfPattern ? std::numeric_limits<float>::quiet_NaN() : float_of(largest);
  const float scale = absmax == 0.0f ? 1.0f : absmax / 127.0f;
  for (int64_t j = 0; j < k; ++j) {
    const float code =
        std::isfinite(scale) ? clamp(round_even(row[kept[j]] / scale), -127.0f, 127.0f) : 0.0f;
    dest[j] = static_cast<uint8_t>(static_cast<int32_t>(code));
    dest[k + j] = static_cast<uint8_t>(kept[j]);
  }
  std::memcpy(dest + 2 * k, &scale, 4);
}

at::Tensor encode_topk(const at::Tensor& blocks, int64_t k) {
  const int64_t n = blocks.size(-1);
  TORCH_CHECK(k >= 1 && k <= n && n <= 256, "top-k needs 1 <= k <= block <= 256");
  return encode_rows(blocks, 2 * k + 4, [k](const float* row, int64_t n, uint8_t* dest, uint8_t*) {
    encode_topk_row(row, n, k, dest);
  });
}

at::Tensor decode_topk(const at::Tensor& payload, int64_t k, int64_t block) {
  TORCH_CHECK(block <= 256, "top-k blocks are at most 256 long");
  std::atomic<bool> beyond{false};  // a position past the block: a corrupt payload, refused below
  at::Tensor blocks = decode_rows(
      payload, 2 * k + 4, block, [k, &beyond](const uint8_t* source, int64_t n, float* row, uint8_t*) {
        std::fill(row, row + n, 0.0f);
        float scale;
        std::memcpy(&scale, source + 2 * k, 4);
        const int8_t* codes = reinterpret_cast<const int8_t*>(source);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t position = source[k + j];
          if (position >= n) {
            beyond = true;
            continue;
          }
          row[position] = static_cast<float>(codes[j]) * scale;
        }
      });
  TORCH_CHECK(!beyond, "a top-k position beyond its block of ", block, ": a corrupt payload");
  return blocks;
}

}  // namespace

TORCH_LIBRARY(mtdao_codecs, m) {
  m.def("encode_signed(Tensor blocks, int bits) -> Tensor");
  m.def("decode_signed(Tensor payload, int bits, int block) -> Tensor");
  m.def("encode_log(Tensor blocks, int bits) -> Tensor");
  m.def("decode_log(Tensor payload, int bits, int block) -> Tensor");
  m.def("encode_topk(Tensor blocks, int k) -> Tensor");
  m.def("decode_topk(Tensor payload, int k, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtdao_codecs, CPU, m) {
  m.impl("encode_signed", &encode_signed);
  m.impl("decode_signed", &decode_signed);
  m.impl("encode_log", &encode_log);
  m.impl("decode_log", &decode_log);
  m.impl("encode_topk", &encode_topk);
  m.impl("decode_topk", &decode_topk);
}
