// Batch-invariant CPU kernels: every output element is reduced in one order, fixed by this
// code, that depends only on the reduction length (K, the hidden size, the head dim, the
// context length) and never on the number of rows, a row's position, the thread count or the
// instruction set. The argument, which must stay true through every edit:
//
// 1. Each output element is computed by exactly one thread, start to finish. Threads split
//    the OUTPUT (rows, columns, tokens), never a reduction, so the thread count only decides
//    who computes an element, not how.
// 2. Every reduction runs on `vf8`, eight float lanes: the input is cut into blocks of 8
//    (the last block padded: zeros for sums and dot products, -inf for maxima), lane l
//    accumulates elements i = l (mod 8) in increasing i, and the 8 partials are combined by
//    the fixed tree of `combine()`. The order is a function of the length alone.
// 3. The arithmetic is IEEE: we never build with -ffast-math, so the compiler may not
//    reassociate, and we build with -ffp-contract=off, so no a*b+c is fused unless written
//    as `fma8`, which is exactly rounded by IEEE 754 in each of its implementations (AVX2's
//    vfmadd, NEON's vfma, libm's fmaf): all give the same bits.
// 4. Transcendental functions are our own (exp8 below: IEEE +, *, and exponent bits) and
//    every element, padding included, goes through the same vf8 code: no library's vector
//    body for some elements and scalar tail for others. log is called once per row, on the
//    row's own sum: the C library's logf, whose version and instruction-set class (glibc
//    picks an FMA variant on CPUs with FMA + AVX2) the worker's fingerprint names.
// 5. The build for this CPU (AVX2 + FMA, or the portable baseline on other x86 and on ARM)
//    changes speed, not bits, by 2-4; `isa()` names it in the worker's machine description
//    (not its fingerprint). tests/kernels/ compare the builds bit for bit on every machine
//    that runs them, and tests/worker/test_numerics_machines.py a whole model's answers.
//
// So the bits of one row of matmul(a, w) depend on that row of `a`, on `w` and on K, nothing
// else; likewise for the other ops.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {

#define DETGATE_INLINE inline __attribute__((always_inline))

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vu16x8 __attribute__((vector_size(16)));
constexpr int L = 8;

DETGATE_INLINE vf8 splat(float x) { return vf8{x, x, x, x, x, x, x, x}; }

DETGATE_INLINE vf8 fma8(vf8 a, vf8 b, vf8 c) {
#if defined(__AVX2__) && defined(__FMA__)
  return (vf8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  float32x4_t lo = vfmaq_f32(vld1q_f32(&c[0]), vld1q_f32(&a[0]), vld1q_f32(&b[0]));
  float32x4_t hi = vfmaq_f32(vld1q_f32(&c[4]), vld1q_f32(&a[4]), vld1q_f32(&b[4]));
  vf8 r;
  vst1q_f32(&r[0], lo);
  vst1q_f32(&r[4], hi);
  return r;
#else
  for (int l = 0; l < L; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

// The partials of an 8-lane reduction, added in one fixed tree.
DETGATE_INLINE float combine(vf8 s) {
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

DETGATE_INLINE vf8 max8(vf8 a, vf8 b) { return (a > b) | (a != a) ? a : b; }

DETGATE_INLINE float combine_max(vf8 s) {
  auto mx = [](float a, float b) { return a > b || a != a ? a : b; };
  return mx(mx(mx(s[0], s[4]), mx(s[2], s[6])), mx(mx(s[1], s[5]), mx(s[3], s[7])));
}

// Eight elements from p, widened to fp32 (exact).
DETGATE_INLINE vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

DETGATE_INLINE vf8 load8(const uint16_t* p) {  // bfloat16: the high half of an fp32
  vu16x8 h;
  std::memcpy(&h, p, sizeof h);
  return (vf8)(__builtin_convertvector(h, vu8) << 16);
}

// The first n < 8 elements from p, widened to fp32, the other lanes `fill`.
template <typename T>
vf8 load8_part(const T* p, int64_t n, float fill);

template <>
DETGATE_INLINE vf8 load8_part<float>(const float* p, int64_t n, float fill) {
  vf8 v = splat(fill);
  for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  return v;
}

template <>
DETGATE_INLINE vf8 load8_part<uint16_t>(const uint16_t* p, int64_t n, float fill) {
  vf8 v = splat(fill);
  for (int64_t l = 0; l < n; ++l) {
    uint32_t bits = static_cast<uint32_t>(p[l]) << 16;
    std::memcpy(&v[l], &bits, sizeof(float));
  }
  return v;
}

DETGATE_INLINE void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof v); }

DETGATE_INLINE void store8_part(float* p, vf8 v, int64_t n) {
  for (int64_t l = 0; l < n; ++l) p[l] = v[l];
}

// exp(x), within 2 ulp for normal results, from IEEE +, * and exponent bits only (Cephes'
// expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r).
DETGATE_INLINE vf8 exp8(vf8 x) {
  const vi8 nan = x != x;
  const vi8 overflow = x > 88.72283935546875f;
  x = x < -110.0f ? splat(-110.0f) : x;  // e^-110 rounds to 0; keeps 2^n's halves normal
  x = (nan | overflow) ? splat(0.0f) : x;
  const vf8 t = x * 1.44269504088896341f;
  const vf8 n = (t + 12582912.0f) - 12582912.0f;  // round to nearest, |t| < 2^22
  vf8 r = x - n * 0.693359375f;                   // ln2 in two parts: n * hi is exact
  r = r - n * -2.12194440e-4f;
  vf8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf8 y = p * (r * r) + r + 1.0f;
  // 2^n as two normal factors, so that results down to the subnormals round once.
  const vi8 ni = __builtin_convertvector(n, vi8);
  const vi8 n1 = ni / 2;
  const vi8 n2 = ni - n1;
  y = (y * (vf8)((vu8)(n1 + 127) << 23)) * (vf8)((vu8)(n2 + 127) << 23);
  y = overflow ? splat(INFINITY) : y;
  return nan ? splat(NAN) : y;
}

// Rows whose elements are adjacent (a one-column tensor may have any column stride).
inline bool unit_columns(const torch::Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1; }

// ---- matmul: out[m, n] = sum_k a[m, k] * w[n, k] ---------------------------------------
//
// Dot-product form over w's rows, so a Linear weight [N, K] is read in place (no packing, no
// copy). Per output element: 8 partials over k (2 above), each a chain of fma8 from +0, then
// combine(). Blocks of R rows x C columns share their loads; a block's shape changes which
// elements are computed together, never how.

constexpr int MR = 3;
constexpr int NR = 4;

template <int R, int C, typename TW>
DETGATE_INLINE void dot_block(const float* a, int64_t lda, const TW* w, int64_t ldw,
                              int64_t k, float* out, int64_t ldo) {
  vf8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = splat(0.0f);
  const int64_t body = k - k % L;
  for (int64_t k0 = 0; k0 < body; k0 += L) {
    vf8 av[R];
    for (int r = 0; r < R; ++r) av[r] = load8(a + r * lda + k0);
    for (int c = 0; c < C; ++c) {
      const vf8 wv = load8(w + c * ldw + k0);
      for (int r = 0; r < R; ++r) acc[r][c] = fma8(av[r], wv, acc[r][c]);
    }
  }
  if (body < k) {
    for (int r = 0; r < R; ++r) {
      const vf8 av = load8_part(a + r * lda + body, k - body, 0.0f);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = fma8(av, load8_part(w + c * ldw + body, k - body, 0.0f), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = combine(acc[r][c]);
}

template <int R, typename TW>
DETGATE_INLINE void dot_rows(const float* a, int64_t lda, const TW* w, int64_t ldw, int64_t k,
                             float* out, int64_t ldo, int64_t cols) {
  int64_t c = 0;
  for (; c + NR <= cols; c += NR) dot_block<R, NR>(a, lda, w + c * ldw, ldw, k, out + c, ldo);
  for (; c < cols; ++c) dot_block<R, 1>(a, lda, w + c * ldw, ldw, k, out + c, ldo);
}

// One task: rows [0, rows) x columns [0, cols) of the output.
template <typename TW>
void matmul_task(const float* a, int64_t lda, const TW* w, int64_t ldw, int64_t k,
                 float* out, int64_t ldo, int64_t rows, int64_t cols) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) {
    dot_rows<MR>(a + r * lda, lda, w, ldw, k, out + r * ldo, ldo, cols);
  }
  if (rows - r == 2) dot_rows<2>(a + r * lda, lda, w, ldw, k, out + r * ldo, ldo, cols);
  if (rows - r == 1) dot_rows<1>(a + r * lda, lda, w, ldw, k, out + r * ldo, ldo, cols);
}

// Tasks of ROW_TILE x COL_TILE outputs, column tile major so that a thread's consecutive
// tasks read the same weight rows. M and the thread count change who computes what, only.
constexpr int64_t ROW_TILE = 48;
constexpr int64_t COL_TILE = 64;

torch::Tensor matmul(const torch::Tensor& a, const torch::Tensor& w) {
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2 && a.size(1) == w.size(1),
              "matmul: a [M, K] and w [N, K] expected");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && unit_columns(a),
              "matmul: a must be fp32 with contiguous rows");
  TORCH_CHECK(unit_columns(w) && (w.scalar_type() == torch::kFloat32 ||
                                  w.scalar_type() == torch::kBFloat16),
              "matmul: w must be fp32 or bf16 with contiguous rows");
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  auto out = torch::empty({m, n}, a.options());
  if (m == 0 || n == 0) return out;
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t lda = a.stride(0), ldw = w.stride(0);
  const int64_t row_tiles = (m + ROW_TILE - 1) / ROW_TILE;
  const int64_t col_tiles = (n + COL_TILE - 1) / COL_TILE;
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  const void* wp = w.data_ptr();
  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = (t % row_tiles) * ROW_TILE, c0 = (t / row_tiles) * COL_TILE;
      const int64_t rows = std::min(ROW_TILE, m - r0), cols = std::min(COL_TILE, n - c0);
      if (bf16) {
        matmul_task(ap + r0 * lda, lda, static_cast<const uint16_t*>(wp) + c0 * ldw, ldw, k,
                    op + r0 * n + c0, n, rows, cols);
      } else {
        matmul_task(ap + r0 * lda, lda, static_cast<const float*>(wp) + c0 * ldw, ldw, k,
                    op + r0 * n + c0, n, rows, cols);
      }
    }
  });
  return out;
}

// ---- quantised weights: GGUF blocks read in place ---------------------------------------
//
// A Q8_0 / Q4_0 / Q4_1 weight [N, K] stays as the GGUF file stores it: each row is K / 32
// blocks, each block an fp16 scale d (Q4_1: then an fp16 minimum m) and 32 quants. Its value
// is, as gguf's and llama.cpp's dequantisation write it, in fp32:
//   Q8_0: q * d          q = int8
//   Q4_0: d * (q - 8)    q = the nibbles, element j < 16 the low one of byte j, j + 16 its high
//   Q4_1: d * q + m      the product rounded, then the sum (no fused multiply-add)
// The first two products are exact (an 11-bit significand times an integer of at most 8
// bits fits in fp32's 24), so only Q4_1's sum rounds, once; fp16 -> fp32 is exact in F16C's
// vcvtph2ps and in the portable code below alike. So `dequant_row` gives the bits of the
// dequantised fp32 weight the other path reads, on every build.
//
// Equality and invariance: matmul_quantised dequantises weight rows into a thread-private
// buffer (a few at a time for a few rows, a whole column tile for more), then runs the fp32
// path's dot_block over them, the code its matmul_task runs. Every output element
// is thus the same chain of fma8 over the same fp32 values in the same k order as
// matmul(a, dequantised w): bit for bit that result, whatever M, the tiling or the thread
// count (which decide only who dequantises and computes what).

constexpr int64_t QK = 32;
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml's type ids

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ8_0: return 2 + QK;
    case kQ4_0: return 2 + QK / 2;
    case kQ4_1: return 4 + QK / 2;
    default: TORCH_CHECK(false, "quantised weights: unsupported ggml type ", qtype);
  }
  return 0;
}

// fp16 bits -> fp32, exactly (subnormals, infinities; a NaN comes back quiet, as F16C does).
DETGATE_INLINE float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: shift the leading one into the implicit bit
    int e = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// 32 quants of one block as fp32 integers (exact): Q8_0's int8, or Q4's nibbles (element
// j < 16: the low nibble of byte j, j + 16: its high one), unsigned.
DETGATE_INLINE void block_quants(const uint8_t* qs, bool q8, vf8 out[4]) {
#if defined(__AVX2__)
  if (q8) {
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
      out[i] = (vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    return;
  }
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
  for (int i = 0; i < 4; ++i) {
    for (int l = 0; l < L; ++l) {
      const int j = 8 * i + l;
      out[i][l] = q8 ? static_cast<float>(static_cast<int8_t>(qs[j]))
                     : static_cast<float>(j < 16 ? qs[j] & 15 : qs[j - 16] >> 4);
    }
  }
#endif
}

// One row of K / 32 blocks -> K fp32 values.
void dequant_row(const uint8_t* row, int64_t qtype, int64_t k, float* out) {
  const int64_t bb = block_bytes(qtype);
  const bool q8 = qtype == kQ8_0;
  vf8 q[4];
  for (int64_t b = 0; b < k / QK; ++b, row += bb, out += QK) {
    const vf8 d = splat(half_to_float(row));
    if (qtype == kQ4_1) {
      const vf8 m = splat(half_to_float(row + 2));
      block_quants(row + 4, false, q);
      for (int i = 0; i < 4; ++i) store8(out + L * i, d * q[i] + m);
    } else {
      block_quants(row + 2, q8, q);
      if (q8) {
        for (int i = 0; i < 4; ++i) store8(out + L * i, q[i] * d);
      } else {  // Q4_0; q - 8 is exact
        for (int i = 0; i < 4; ++i) store8(out + L * i, d * (q[i] - 8.0f));
      }
    }
  }
}

void check_quantised(const torch::Tensor& blocks, int64_t qtype, int64_t k) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 &&
                  unit_columns(blocks) && k % QK == 0 &&
                  blocks.size(1) == k / QK * block_bytes(qtype),
              "quantised weights: blocks [N, K / 32 * block bytes] uint8 with contiguous rows "
              "expected");
}

// blocks [N, K / 32 * block bytes] uint8 -> the weight [N, K] fp32.
torch::Tensor dequantise(const torch::Tensor& blocks, int64_t qtype, int64_t k) {
  check_quantised(blocks, qtype, k);
  const int64_t n = blocks.size(0), ld = blocks.stride(0);
  auto out = torch::empty({n, k}, blocks.options().dtype(torch::kFloat32));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequant_row(bp + r * ld, qtype, k, op + r * k);
  });
  return out;
}

// Rows [0, rows < MR + 2) x columns [0, cols) of the output against NR weight rows at a time,
// each group dequantised into `buffer` (NR x K floats, L1-sized) just before use: for a few
// rows the weights are read once and never leave L1. The same dot_block as matmul_task.
void few_rows_task(const float* a, int64_t lda, const uint8_t* blocks, int64_t ldb,
                   int64_t qtype, int64_t k, float* out, int64_t ldo, int64_t rows,
                   int64_t cols, float* buffer) {
  for (int64_t c = 0; c < cols; c += NR) {
    const int64_t width = std::min<int64_t>(NR, cols - c);
    for (int64_t j = 0; j < width; ++j) {
      dequant_row(blocks + (c + j) * ldb, qtype, k, buffer + j * k);
    }
    int64_t r = 0;
    for (; r + MR <= rows; r += MR) {
      dot_rows<MR>(a + r * lda, lda, buffer, k, k, out + r * ldo + c, ldo, width);
    }
    if (rows - r == 2) dot_rows<2>(a + r * lda, lda, buffer, k, k, out + r * ldo + c, ldo, width);
    if (rows - r == 1) dot_rows<1>(a + r * lda, lda, buffer, k, k, out + r * ldo + c, ldo, width);
  }
}

// a [M, K] fp32 x blocks of w [N, K] -> [M, N] fp32: matmul(a, dequantise(blocks)) bit for bit.
// Up to FEW_ROWS rows, few_rows_task; beyond, a task dequantises its tile's COL_TILE weight
// rows into a thread-private buffer (L2-sized: COL_TILE x K floats) once and runs the fp32
// path's own matmul_task over it. Which one runs changes speed only: both compute every
// element with dot_block.
constexpr int64_t FEW_ROWS = MR + 1;

torch::Tensor matmul_quantised(const torch::Tensor& a, const torch::Tensor& blocks,
                               int64_t qtype) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == torch::kFloat32 && unit_columns(a),
              "matmul_quantised: a [M, K] fp32 with contiguous rows expected");
  const int64_t m = a.size(0), k = a.size(1), n = blocks.size(0);
  check_quantised(blocks, qtype, k);
  auto out = torch::empty({m, n}, a.options());
  if (m == 0 || n == 0) return out;
  const float* ap = a.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t lda = a.stride(0), ldb = blocks.stride(0);
  const int64_t row_tiles = (m + ROW_TILE - 1) / ROW_TILE;
  const int64_t col_tiles = (n + COL_TILE - 1) / COL_TILE;
  const bool few = m <= FEW_ROWS;
  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer((few ? NR : COL_TILE) * k);  // dequantised weight rows
    int64_t buffered = -1;                                 // the column tile they are
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = (t % row_tiles) * ROW_TILE, c0 = (t / row_tiles) * COL_TILE;
      const int64_t rows = std::min(ROW_TILE, m - r0), cols = std::min(COL_TILE, n - c0);
      if (few) {
        few_rows_task(ap + r0 * lda, lda, bp + c0 * ldb, ldb, qtype, k, op + r0 * n + c0, n,
                      rows, cols, buffer.data());
        continue;
      }
      if (buffered != c0) {  // tasks are column tile major: each tile dequantised once a run
        for (int64_t j = 0; j < cols; ++j) {
          dequant_row(bp + (c0 + j) * ldb, qtype, k, buffer.data() + j * k);
        }
        buffered = c0;
      }
      matmul_task(ap + r0 * lda, lda, static_cast<const float*>(buffer.data()), k, k,
                  op + r0 * n + c0, n, rows, cols);
    }
  });
  return out;
}

// ---- row reductions ---------------------------------------------------------------------

DETGATE_INLINE float sum_squares(const float* x, int64_t n) {
  vf8 s = splat(0.0f);
  const int64_t body = n - n % L;
  for (int64_t i = 0; i < body; i += L) {
    const vf8 v = load8(x + i);
    s = fma8(v, v, s);
  }
  if (body < n) {
    const vf8 v = load8_part(x + body, n - body, 0.0f);
    s = fma8(v, v, s);
  }
  return combine(s);
}

// 1 / sqrt(mean(x^2) + eps) of one row: sqrt and / are correctly rounded IEEE operations, so
// the statistic's bits follow from the sum's.
DETGATE_INLINE float row_inv_rms(const float* x, int64_t h, float eps) {
  return 1.0f / std::sqrt(sum_squares(x, h) / static_cast<float>(h) + eps);
}

// inv_rms per row of x [R, H] fp32 -> [R] fp32.
torch::Tensor inv_rms(const torch::Tensor& x, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && unit_columns(x),
              "inv_rms: x [R, H] fp32 with contiguous rows expected");
  const int64_t rows = x.size(0), h = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_inv_rms(xp + r * ld, h, feps);
  });
  return out;
}

// o = w * (x * inv) per element: two products, each rounded once (no FMA: -ffp-contract=off),
// in the order of the composition `weight * (x * inv_rms(x))` that kernels/cpu.py ran as
// torch multiplies before: the same bits.
DETGATE_INLINE void scale_row(const float* x, const float* w, float inv, float* o, int64_t n) {
  const vf8 vinv = splat(inv);
  const int64_t body = n - n % L;
  for (int64_t i = 0; i < body; i += L) store8(o + i, load8(w + i) * (load8(x + i) * vinv));
  for (int64_t i = body; i < n; ++i) o[i] = w[i] * (x[i] * inv);
}

void check_norm(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && unit_columns(x), name,
              ": x [R, H] fp32 with contiguous rows expected");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == torch::kFloat32 &&
              w.is_contiguous(), name, ": weight [H] fp32 contiguous expected");
}

// RMSNorm of x [R, H] fp32 with weight [H] fp32 -> [R, H]: inv_rms and scale_row per row, one
// call instead of a launch per op (what a thread count scales: the host work between ops
// does not).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_norm(x, w, "rms_norm");
  const int64_t rows = x.size(0), h = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * ld;
      scale_row(xr, wp, row_inv_rms(xr, h, feps), op + r * h, h);
    }
  });
  return out;
}

// (rms_norm(x + residual), x + residual) for x, residual [R, H] fp32: the sum one IEEE add per
// element (x's value first, as `x + residual`), then the norm of the sum.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& w, double eps) {
  check_norm(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat32 &&
              unit_columns(residual), "add_rms_norm: residual like x expected");
  const int64_t rows = x.size(0), h = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  auto sum = torch::empty({rows, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t body = h - h % L;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * ldx;
      const float* rr = rp + r * ldr;
      float* sr = sp + r * h;
      for (int64_t i = 0; i < body; i += L) store8(sr + i, load8(xr + i) + load8(rr + i));
      for (int64_t i = body; i < h; ++i) sr[i] = xr[i] + rr[i];
      scale_row(sr, wp, row_inv_rms(sr, h, feps), op + r * h, h);
    }
  });
  return {out, sum};
}

// Neox rotary of x [T, H, D] fp32 (head rows of D contiguous) at positions [T] int64, with
// cos and sin tables [P, D / 2] fp32: for the halves x1, x2 of a head,
//   out = (x1 * c - x2 * s, x2 * c + x1 * s),  c, s = cos[pos], sin[pos],
// each product and each sum rounded once, in the order of the torch composition in
// worker/model/layers/rotary.py: the same bits. Pointwise: no order to fix.
torch::Tensor rotary(const torch::Tensor& positions, const torch::Tensor& x,
                     const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 &&
              x.size(2) % 2 == 0, "rotary: x [T, H, D] fp32 with contiguous heads expected");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == t &&
              positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "rotary: positions [T] int64 expected");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && cos.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.sizes() == cos.sizes() &&
              sin.scalar_type() == torch::kFloat32 && sin.is_contiguous(),
              "rotary: cos and sin [P, D / 2] fp32 contiguous expected");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cos.size(0), "rotary: position ", pp[i],
                " outside the table of ", cos.size(0));
  }
  auto out = torch::empty({t, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), body = half - half % L;
  at::parallel_for(0, t * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tok = i / heads, head = i % heads;
      const float* x1 = xp + tok * s0 + head * s1;
      const float* x2 = x1 + half;
      const float* c = cp + pp[tok] * half;
      const float* s = snp + pp[tok] * half;
      float* o1 = op + i * d;
      float* o2 = o1 + half;
      for (int64_t j = 0; j < body; j += L) {
        const vf8 a = load8(x1 + j), b = load8(x2 + j), cv = load8(c + j), sv = load8(s + j);
        store8(o1 + j, a * cv - b * sv);
        store8(o2 + j, b * cv + a * sv);
      }
      for (int64_t j = body; j < half; ++j) {
        o1[j] = x1[j] * c[j] - x2[j] * s[j];
        o2[j] = x2[j] * c[j] + x1[j] * s[j];
      }
    }
  });
  return out;
}

DETGATE_INLINE float max_of(const float* x, int64_t n) {
  vf8 m = splat(-INFINITY);
  const int64_t body = n - n % L;
  for (int64_t i = 0; i < body; i += L) m = max8(m, load8(x + i));
  if (body < n) m = max8(m, load8_part(x + body, n - body, -INFINITY));
  return combine_max(m);
}

// sum of exp(x[i] - m) over i < n; with Store, also e[i] = exp(x[i] - m) (e may be x).
template <bool Store>
DETGATE_INLINE float exp_sum(const float* x, int64_t n, float m, float* e) {
  vf8 s = splat(0.0f);
  const int64_t body = n - n % L;
  for (int64_t i = 0; i < body; i += L) {
    const vf8 v = exp8(load8(x + i) - m);
    if (Store) std::memcpy(e + i, &v, sizeof v);
    s = s + v;
  }
  if (body < n) {  // padding is -inf: exp gives exactly 0
    const vf8 v = exp8(load8_part(x + body, n - body, -INFINITY) - m);
    if (Store) store8_part(e + body, v, n - body);
    s = s + v;
  }
  return combine(s);
}

// log_softmax over the last dim of x [R, V] fp32 -> [R, V] fp32: x - (max + log(sum exp)).
torch::Tensor log_softmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && unit_columns(x),
              "log_softmax: x [R, V] fp32 with contiguous rows expected");
  const int64_t rows = x.size(0), v = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, v}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * ld;
      float* orow = op + r * v;
      const float m = max_of(row, v);
      const float shift = m + std::log(exp_sum<false>(row, v, m, nullptr));
      for (int64_t i = 0; i < v; ++i) orow[i] = row[i] - shift;
    }
  });
  return out;
}

// softmax over the last dim of x [R, V] fp32 -> [R, V] fp32: exp(x - max) / sum, the sum in
// exp_sum's order (the sampler draws from these; torch's softmax sums in lanes of its vector
// width, so its AVX2 and AVX-512 kernels give other bits).
torch::Tensor softmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && unit_columns(x),
              "softmax: x [R, V] fp32 with contiguous rows expected");
  const int64_t rows = x.size(0), v = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, v}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * ld;
      float* orow = op + r * v;
      const float total = exp_sum<true>(row, v, max_of(row, v), orow);
      for (int64_t i = 0; i < v; ++i) orow[i] = orow[i] / total;
    }
  });
  return out;
}

// ---- SwiGLU: silu(gate) * up, elementwise ----------------------------------------------

DETGATE_INLINE vf8 silu_mul8(vf8 g, vf8 u) { return g / (1.0f + exp8(-g)) * u; }

// x [R, 2I] fp32 (gate | up, as the packed matmul writes them) -> [R, I] fp32.
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && unit_columns(x) &&
                  x.size(1) % 2 == 0,
              "silu_and_mul: x [R, 2I] fp32 with contiguous rows expected");
  const int64_t rows = x.size(0), half = x.size(1) / 2, ld = x.stride(0);
  auto out = torch::empty({rows, half}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t body = half - half % L;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * ld;
      const float* u = g + half;
      float* o = op + r * half;
      for (int64_t i = 0; i < body; i += L) {
        const vf8 v = silu_mul8(load8(g + i), load8(u + i));
        std::memcpy(o + i, &v, sizeof v);
      }
      if (body < half) {
        store8_part(o + body, silu_mul8(load8_part(g + body, half - body, 0.0f),
                                        load8_part(u + body, half - body, 0.0f)),
                    half - body);
      }
    }
  });
  return out;
}

// ---- paged attention --------------------------------------------------------------------
//
// For each query (its sequence, its position p, its q head) the keys are positions 0..p of
// its sequence, visited in increasing position whatever the cache's block size:
//   s_j = dot(q * scale, k_j)         8 partials over the head dim, then combine()
//   m = max_j s_j;  e_j = exp(s_j - m);  sum_e: 8 partials over j, then combine()
//   out = (sum_j e_j * v_j) / sum_e   per head-dim element, fma8 in increasing j
// Every order is a function of (head dim, p + 1). A decode query and the same position in a
// prefill, alone or in a batch, chunked or not, read the same keys in the same order.

struct PagedArgs {
  const float* q;         // [T, Hq, D]
  float scale;            // the softmax scale, folded into each query: q[i] * scale, one
                          // IEEE multiply per element, as torch's `q * scale` does
  const void* k_cache;    // [NB, BS, Hkv, D]
  const void* v_cache;
  const int32_t* tables;  // [B, max_blocks]
  int64_t max_blocks, block_size, hkv, hq, d;
  float* out;             // [T, Hq, D]
};

template <typename TC>
DETGATE_INLINE float dot_head(const float* q, const TC* k, int64_t d) {
  vf8 s = splat(0.0f);
  const int64_t body = d - d % L;
  for (int64_t i = 0; i < body; i += L) s = fma8(load8(q + i), load8(k + i), s);
  if (body < d) s = fma8(load8_part(q + body, d - body, 0.0f), load8_part(k + body, d - body, 0.0f), s);
  return combine(s);
}

// combine() of eight vectors at once: lane c of the result is combine(s[c]), the same
// additions of the same operands in the same order, made lane-parallel by shuffles (which move
// values and never change them): first (s0+s4, s1+s5, s2+s6, s3+s7) of each vector, then
// (s0+s4)+(s2+s6) and (s1+s5)+(s3+s7), then their sum.
DETGATE_INLINE vf8 combine8(const vf8* s) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  vf8 p[4];  // p[c]: the four pair sums of s[2c] in lanes 0-3, of s[2c + 1] in lanes 4-7
  for (int c = 0; c < 4; ++c) {
    p[c] = __builtin_shufflevector(s[2 * c], s[2 * c + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(s[2 * c], s[2 * c + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  vf8 w[2];  // w[h]: the two half sums of s[4h + c] in lanes 2c, 2c + 1
  for (int h = 0; h < 2; ++h) {
    w[h] = __builtin_shufflevector(p[2 * h], p[2 * h + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(p[2 * h], p[2 * h + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  vf8 r;
  for (int c = 0; c < L; ++c) r[c] = combine(s[c]);
  return r;
#endif
}

// dot_head of q with eight keys, bit for bit: key c's lanes accumulate exactly as dot_head's
// (lane l: elements i = l (mod 8) in increasing i, fma8 from +0) and combine8 adds each key's
// partials in combine()'s tree. Eight keys share each load of q and one combine.
template <typename TC>
DETGATE_INLINE vf8 dot_heads8(const float* q, const TC* const* k, int64_t d) {
  vf8 s[L];
  for (int c = 0; c < L; ++c) s[c] = splat(0.0f);
  const int64_t body = d - d % L;
  for (int64_t i = 0; i < body; i += L) {
    const vf8 qv = load8(q + i);
    for (int c = 0; c < L; ++c) s[c] = fma8(qv, load8(k[c] + i), s[c]);
  }
  if (body < d) {
    const vf8 qv = load8_part(q + body, d - body, 0.0f);
    for (int c = 0; c < L; ++c) s[c] = fma8(qv, load8_part(k[c] + body, d - body, 0.0f), s[c]);
  }
  return combine8(s);
}

// o[i0 + i] = (sum_j e[j] * vrows[j][i0 + i]) / total for i < 8C: per element one fma8 chain
// over j in increasing order from +0, then one division. C is a constant so that the C
// accumulators stay in registers across the key loop.
template <int C, typename TC>
DETGATE_INLINE void weighted_sum(const float* e, const TC* const* vrows, int64_t len,
                                 float total, int64_t i0, float* o) {
  vf8 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = splat(0.0f);
  for (int64_t j = 0; j < len; ++j) {
    const vf8 w = splat(e[j]);
    const TC* v = vrows[j] + i0;
    for (int c = 0; c < C; ++c) acc[c] = fma8(w, load8(v + c * L), acc[c]);
  }
  for (int c = 0; c < C; ++c) store8(o + i0 + c * L, acc[c] / total);
}

// weighted_sum of `chunks` (1..8) vf8 of the head dim.
template <typename TC>
void weighted_sum_any(int64_t chunks, const float* e, const TC* const* vrows, int64_t len,
                      float total, int64_t i0, float* o) {
  switch (chunks) {
    case 8: return weighted_sum<8>(e, vrows, len, total, i0, o);
    case 7: return weighted_sum<7>(e, vrows, len, total, i0, o);
    case 6: return weighted_sum<6>(e, vrows, len, total, i0, o);
    case 5: return weighted_sum<5>(e, vrows, len, total, i0, o);
    case 4: return weighted_sum<4>(e, vrows, len, total, i0, o);
    case 3: return weighted_sum<3>(e, vrows, len, total, i0, o);
    case 2: return weighted_sum<2>(e, vrows, len, total, i0, o);
    default: return weighted_sum<1>(e, vrows, len, total, i0, o);
  }
}

// The q heads of kv head h for one query token with `len` visible keys; scratch, krows and
// vrows hold >= len entries, qs >= d. The keys' rows are looked up once for the group; the
// scores come eight keys at a time (dot_heads8, dot_head's bits); the weighted sum of V runs
// key by key over up to 8 vf8 of the head dim at once (each element's chain is still over j in
// increasing order, so the loop order changes speed, not bits).
template <typename TC>
void attend(const PagedArgs& p, int64_t b, int64_t token, int64_t len, int64_t h,
            float* scratch, const TC** krows, const TC** vrows, float* qs) {
  const TC* kc = static_cast<const TC*>(p.k_cache);
  const TC* vc = static_cast<const TC*>(p.v_cache);
  const int64_t group = p.hq / p.hkv, d = p.d, row = p.hkv * d;
  const int32_t* table = p.tables + b * p.max_blocks;
  for (int64_t j = 0, block = 0; j < len; ++block) {  // block by block: no division per key
    const TC* kb = kc + table[block] * p.block_size * row + h * d;
    const TC* vb = vc + table[block] * p.block_size * row + h * d;
    for (int64_t slot = 0; slot < p.block_size && j < len; ++slot, ++j) {
      krows[j] = kb + slot * row;
      vrows[j] = vb + slot * row;
    }
  }
  const int64_t body = d - d % L;
  constexpr int64_t CHUNKS = 8;  // vf8 accumulators of the head dim held at once
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    const float* qh = p.q + (token * p.hq + head) * d;
    for (int64_t i = 0; i < d; ++i) qs[i] = qh[i] * p.scale;
    int64_t j = 0;
    for (; j + L <= len; j += L) store8(scratch + j, dot_heads8(qs, krows + j, d));
    for (; j < len; ++j) scratch[j] = dot_head(qs, krows[j], d);
    const float m = max_of(scratch, len);
    const float total = exp_sum<true>(scratch, len, m, scratch);
    float* o = p.out + (token * p.hq + head) * d;
    for (int64_t i0 = 0; i0 < body; i0 += CHUNKS * L) {
      const int64_t chunks = std::min<int64_t>(CHUNKS, (body - i0) / L);
      weighted_sum_any(chunks, scratch, vrows, len, total, i0, o);
    }
    if (body < d) {
      vf8 acc = splat(0.0f);
      for (int64_t j = 0; j < len; ++j) {
        acc = fma8(splat(scratch[j]), load8_part(vrows[j] + body, d - body, 0.0f), acc);
      }
      store8_part(o + body, acc / total, d - body);
    }
  }
}

// q [T, Hq, D] fp32 (unscaled), caches [NB, BS, Hkv, D] fp32 or bf16, block_tables
// [B, max_blocks] int32, query_start_loc [B + 1] int32, seq_lens [B] int32, the softmax
// scale -> [T, Hq, D] fp32.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start_loc,
                              const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "paged_attention: q [T, Hq, D] contiguous fp32 expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == torch::kFloat32 ||
                   k_cache.scalar_type() == torch::kBFloat16),
              "paged_attention: contiguous fp32 or bf16 caches expected");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                  query_start_loc.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "paged_attention: int32 block_tables, query_start_loc and seq_lens expected");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  auto out = torch::empty_like(q);  // rows of padding tokens (of no sequence) are zeroed below
  const auto qsl = query_start_loc.contiguous();
  const auto lens = seq_lens.contiguous();
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t batch = lens.size(0), tokens = q.size(0);
  // Each query token's sequence and visible key count.
  std::vector<int64_t> seq_of(tokens, -1), keys(tokens, 0);
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t qlen = starts[b + 1] - starts[b];
    TORCH_CHECK(starts[b] >= 0 && qlen >= 0 && starts[b + 1] <= tokens && qlen <= lp[b],
                "paged_attention: query_start_loc and seq_lens disagree");
    for (int64_t j = 0; j < qlen; ++j) {
      seq_of[starts[b] + j] = b;
      keys[starts[b] + j] = lp[b] - qlen + j + 1;
      longest = std::max(longest, keys[starts[b] + j]);
    }
  }
  const PagedArgs args{q.data_ptr<float>(), static_cast<float>(scale), k_cache.data_ptr(),
                       v_cache.data_ptr(),
                       block_tables.data_ptr<int32_t>(), block_tables.size(1),
                       k_cache.size(1), hkv, hq, d, out.data_ptr<float>()};
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, tokens * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(longest), qs(d);
    std::vector<const void*> krows(longest), vrows(longest);
    const int64_t group = hq / hkv;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t token = i / hkv, h = i % hkv;
      if (seq_of[token] < 0) {
        std::memset(args.out + (token * hq + h * group) * d, 0, group * d * sizeof(float));
        continue;
      }
      if (bf16) {
        attend<uint16_t>(args, seq_of[token], token, keys[token], h, scratch.data(),
                         reinterpret_cast<const uint16_t**>(krows.data()),
                         reinterpret_cast<const uint16_t**>(vrows.data()), qs.data());
      } else {
        attend<float>(args, seq_of[token], token, keys[token], h, scratch.data(),
                      reinterpret_cast<const float**>(krows.data()),
                      reinterpret_cast<const float**>(vrows.data()), qs.data());
      }
    }
  });
  return out;
}

// k, v [T, Hkv, D] (heads of D adjacent, any token stride) into the caches [NB, BS, Hkv, D]
// of their dtype, at slot_mapping [T] int64 (block * BS + offset); negative slots are skipped.
// A copy of each token's rows: no arithmetic, so no bits to argue about.
void store_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_cache,
              const torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() &&
                  k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == v_cache.scalar_type(),
              "store_kv: k, v [T, Hkv, D] of the caches' dtype expected");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "store_kv: contiguous caches [NB, BS, Hkv, D] matching k, v expected");
  const int64_t d = k.size(2), hkv = k.size(1);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == d && v.stride(1) == d,
              "store_kv: k, v with adjacent heads of adjacent elements expected");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.scalar_type() == torch::kInt64,
              "store_kv: slot_mapping [T] int64 expected");
  const auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t tokens = k.size(0), capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] < capacity, "store_kv: slot ", sp[t], " beyond the cache's ", capacity);
  }
  const int64_t item = k.element_size(), row = hkv * d * item;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * item, vs = v.stride(0) * item;
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * row, kp + t * ks, row);
      std::memcpy(vc + sp[t] * row, vp + t * vs, row);
    }
  });
}

std::string isa() {
#if defined(__AVX2__) && defined(__FMA__)
  return "x86-64 avx2+fma";
#elif defined(__aarch64__)
  return "aarch64 neon";
#elif defined(__x86_64__)
  return "x86-64 baseline";
#else
  return "portable";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "detgate's batch-invariant CPU kernels (the argument is at the top of the source)";
  m.def("matmul", &matmul, "a [M, K] fp32 x w [N, K] fp32|bf16 -> [M, N] fp32");
  m.def("matmul_quantised", &matmul_quantised,
        "a [M, K] fp32 x GGUF blocks of w [N, K] (ggml type id) -> [M, N] fp32");
  m.def("dequantise", &dequantise, "GGUF blocks [N, K / 32 * block bytes] -> [N, K] fp32");
  m.def("inv_rms", &inv_rms, "x [R, H] fp32 -> 1 / sqrt(mean(x^2) + eps), [R]");
  m.def("rms_norm", &rms_norm, "x [R, H] fp32, weight [H] fp32 -> weight * (x * inv_rms(x))");
  m.def("add_rms_norm", &add_rms_norm,
        "x, residual [R, H] fp32, weight [H] -> (rms_norm(x + residual), x + residual)");
  m.def("rotary", &rotary, "positions [T] int64, x [T, H, D] fp32, cos/sin [P, D/2] -> Neox rotary");
  m.def("log_softmax", &log_softmax, "x [R, V] fp32 -> log_softmax over V, fp32");
  m.def("softmax", &softmax, "x [R, V] fp32 -> softmax over V, fp32");
  m.def("silu_and_mul", &silu_and_mul, "x [R, 2I] fp32 -> silu(x[:, :I]) * x[:, I:]");
  m.def("paged_attention", &paged_attention,
        "causal GQA attention over a paged KV cache (q unscaled, the scale folded in)");
  m.def("store_kv", &store_kv, "k, v [T, Hkv, D] into the paged caches at slot_mapping");
  m.def("isa", &isa, "the instruction set this build uses");
}
