// The embedded engine's mixed bf16 product on CPUs with bf16 products (AMX, or AVX-512 BF16 without it):
// bf16 inputs and weights, fp32 accumulation, fp32 outputs, or each output rounded once to bf16. It makes
// the LM head's logits (``gen.lm_head_dtype=mixed``) and, where it runs on AVX-512 BF16, a bf16 engine's
// layer products (runtime/engines/products.py's KernelWeight). PyTorch's bf16 product rounds every logit to
// bf16 (an error of up to 2^-9 of a logit, ~0.06 nats at logit 30); its fp32 product reads twice the bytes
// and runs on the FMA units. Here bf16 pairs are multiplied exactly and summed in fp32 (Intel Architecture
// Instruction Set Extensions Programming Reference, ch. 3: AMX's TDPBF16PS sums 16 x 16 tiles of logits over
// the hidden dim; AVX-512 BF16's VDPBF16PS one pair of each of 16 logits per instruction).
//
//   pack_lm_head(weight [vocab, hidden] bf16) -> packed [ceil(vocab/16), hidden_p/2, 16, 2] bf16
//       (hidden_p: hidden rounded up to 32; zero padding): for each block of 16 vocabulary rows,
//       row kk holds, for each of the 16, the pair (w[n][2 kk], w[n][2 kk + 1]): AMX's B layout, and
//       one 64-byte vector of VDPBF16PS's second operand.
//   lm_head(x [rows, hidden] fp32 or bf16, packed, vocab, bias [vocab] or None, bf16_out) -> logits
//       [rows, vocab]: fp32 sums plus the bias (in fp32), stored in fp32, or with bf16_out each rounded
//       once to bf16 (nearest even). With bf16_out the same product serves a bf16 engine's layers
//       (runtime/engines/products.py's KernelWeight: every [out, in] weight packed as a "vocabulary" of
//       out rows) where it runs on AVX-512 BF16; the AMX path gives fp32 and then adds and rounds.
//   mixed_product_isa() -> "amx", "avx512_bf16" or "none": which path this build runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AREAL_FLOW_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AREAL_FLOW_AVX512_BF16 1
#include <immintrin.h>
#endif

namespace {

at::Tensor pack_lm_head(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_lm_head: weight [vocab, hidden] bf16 on CPU expected; got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t vocab = weight.size(0), hidden = weight.size(1);
  const int64_t vb = (vocab + 15) / 16, hp = (hidden + 31) / 32 * 32;
  at::Tensor padded = weight.contiguous();
  if (vb * 16 != vocab || hp != hidden || padded.storage_offset() % 2 != 0) {  // the int32 view needs an even offset
    padded = at::zeros({vb * 16, hp}, weight.options());
    padded.narrow(0, 0, vocab).narrow(1, 0, hidden).copy_(weight);
  }
  // each pair as one int32: [vb, 16 n, hp/2 kk] -> [vb, hp/2 kk, 16 n], a 3-D transpose (8x faster than
  // moving 2-byte halves in a 4-D permute: 0.3 against 2.6 ms for [3072, 576], one thread)
  return padded.view(at::kInt).view({vb, 16, hp / 2}).transpose(1, 2).contiguous().view(at::kBFloat16).view(
      {vb, hp / 2, 16, 2});
}

#ifdef AREAL_FLOW_AMX
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux grants AMX's tile data state to a process on request (once)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// logits of row tiles [0, RT) (16 rows each, from a) for one 16-column block; tiles 0..3 accumulate,
// 4 holds a row tile of x, 5 the block's weights.
template <int RT>
void column_block(const c10::BFloat16* a, int64_t a_stride, const c10::BFloat16* b, int64_t k_steps, float* c,
                  int64_t c_stride) {
  if (RT > 0) _tile_zero(0);
  if (RT > 1) _tile_zero(1);
  if (RT > 2) _tile_zero(2);
  if (RT > 3) _tile_zero(3);
  for (int64_t k = 0; k < k_steps; ++k) {
    _tile_loadd(5, b + k * 16 * 32, 64);
    const c10::BFloat16* ak = a + k * 32;
    _tile_loadd(4, ak, a_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (RT > 1) {
      _tile_loadd(4, ak + 16 * a_stride / 2, a_stride);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (RT > 2) {
      _tile_loadd(4, ak + 32 * a_stride / 2, a_stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (RT > 3) {
      _tile_loadd(4, ak + 48 * a_stride / 2, a_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, c_stride);
  if (RT > 1) _tile_stored(1, c + 16 * c_stride / 4, c_stride);
  if (RT > 2) _tile_stored(2, c + 32 * c_stride / 4, c_stride);
  if (RT > 3) _tile_stored(3, c + 48 * c_stride / 4, c_stride);
}
#endif

#ifdef AREAL_FLOW_AVX512_BF16
// Block sizes, from timing 3 x 8, 4 x 6, 6 x 4 and 8 x 3 (column blocks x rows) and 2 x 12 on an AMD
// EPYC with AVX-512 BF16, one thread, [rows, 576] x [49152, 576]: 6 x 4 fastest at 13, 32 and 64 rows
// (5.07 ms at 32 rows against 7.22 ms for 2 x 12). 24 accumulators, 6 weight vectors and the broadcast
// take 31 of the 32 vector registers.
constexpr int kBlocks = 6, kRows = 4;

// Stores the first `left` (<= 16; none if <= 0) lanes of v at c: fp32, or rounded to bf16 (nearest even).
inline void store_lanes(float* c, __m512 v, int64_t left) {
  if (left >= 16)
    _mm512_storeu_ps(c, v);
  else if (left > 0)
    _mm512_mask_storeu_ps(c, (__mmask16)((1u << left) - 1), v);
}
inline void store_lanes(c10::BFloat16* c, __m512 v, int64_t left) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  if (left >= 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), h);
  else if (left > 0)
    _mm256_mask_storeu_epi16(c, (__mmask16)((1u << left) - 1), h);
}

// The next group's weights to bring into L2 while this one computes: every row block of the group prefetches
// the lines kk = phase, phase + stride, ... of each of the next group's nb blocks, so the whole next group is
// fetched evenly over the whole group. Measured (SmolLM2's 30 layers and head in turn, one thread): 1.17-1.23x
// at 32 rows and 1.12x at 64 against none; the whole group in the first row block was 2 % slower than none.
struct Prefetch {
  const c10::BFloat16* next = nullptr;
  int nb = 0;
  int64_t phase = 0, stride = 1;
};

// The products of RB rows (from a, stride hp bf16) with NB 16-column blocks (b: the first block's
// packed weights, blocks hp/2 * 32 bf16 apart): RB x NB accumulators of 16 fp32 lanes, each VDPBF16PS
// adding one hidden pair of 16 columns; the pair of x is broadcast to every lane. Adds bias (fp32, or
// null) and stores the first `cols` columns (the last block may be partial) in TOut; prefetches as pf says.
template <int RB, int NB, typename TOut>
void row_block(const c10::BFloat16* a, int64_t hp, const c10::BFloat16* b, TOut* c, int64_t c_stride,
               int64_t cols, const float* bias, Prefetch pf) {
  __m512 acc[RB][NB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t block = hp / 2 * 32;
  int64_t fetch = pf.nb > 0 ? pf.phase : hp / 2;
  for (int64_t kk = 0; kk < hp / 2; ++kk) {
    if (kk == fetch) {
      for (int j = 0; j < pf.nb; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(pf.next + j * block + kk * 32), _MM_HINT_T1);
      fetch += pf.stride;
    }
    __m512bh w[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(b + j * block + kk * 32);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * hp + 2 * kk, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, w[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t left = cols - j * 16;
    const __m512 bj = bias == nullptr || left <= 0 ? _mm512_setzero_ps()
                      : _mm512_maskz_loadu_ps(left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1),
                                              bias + j * 16);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) store_lanes(c + r * c_stride + j * 16, _mm512_add_ps(acc[r][j], bj), left);
  }
}

// rows [0, rows) of one group of NB column blocks, kRows at a time (the remainder by a smaller RB); pf.next
// and pf.nb name the next group's weights, which the row blocks prefetch between them.
template <int NB, typename TOut>
void column_group(const c10::BFloat16* a, int64_t rows, int64_t hp, const c10::BFloat16* b, TOut* c, int64_t n_out,
                  int64_t cols, const float* bias, Prefetch pf) {
  pf.stride = (rows + kRows - 1) / kRows;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows, ++pf.phase)
    row_block<kRows, NB>(a + r * hp, hp, b, c + r * n_out, n_out, cols, bias, pf);
  const c10::BFloat16* ar = a + r * hp;
  TOut* cr = c + r * n_out;
  static_assert(kRows == 4, "the remainder switch covers 1 .. kRows - 1 rows");
  switch (rows - r) {
    case 0: break;
    case 1: row_block<1, NB>(ar, hp, b, cr, n_out, cols, bias, pf); break;
    case 2: row_block<2, NB>(ar, hp, b, cr, n_out, cols, bias, pf); break;
    default: row_block<3, NB>(ar, hp, b, cr, n_out, cols, bias, pf); break;
  }
}

constexpr int64_t kRowChunk = 64;  // rows of one task (a multiple of kRows): a prefill's rows split over threads too

// tasks [begin, end) in turn, task = group * chunks + chunk: kBlocks column blocks (fewer in the last group) x
// kRowChunk rows; a thread's consecutive tasks share their group's weights, which stay in L2
template <typename TOut>
void tasks(const c10::BFloat16* a, int64_t rows, int64_t hp, const c10::BFloat16* bp, int64_t vb, TOut* out,
           int64_t n_out, const float* bias, int64_t chunks, int64_t begin, int64_t end) {
  static_assert(kBlocks == 6 && kRowChunk % kRows == 0, "the switch covers 1 .. kBlocks blocks");
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = kBlocks * (task / chunks), cols = std::min<int64_t>(16 * kBlocks, n_out - n * 16);
    const int64_t r0 = task % chunks * kRowChunk, nr = std::min<int64_t>(kRowChunk, rows - r0);
    const c10::BFloat16 *ar = a + r0 * hp, *b = bp + n * (hp / 2) * 32;
    const float* bg = bias == nullptr ? nullptr : bias + n * 16;
    TOut* c = out + r0 * n_out + n * 16;
    Prefetch pf;  // this thread's next task starts the next group: fetch its weights meanwhile
    if (task + 1 < end && (task + 1) % chunks == 0) {
      pf.next = b + kBlocks * (hp / 2) * 32;
      pf.nb = static_cast<int>(std::min<int64_t>(kBlocks, vb - n - kBlocks));
    }
    switch (std::min<int64_t>(kBlocks, vb - n)) {
      case 1: column_group<1>(ar, nr, hp, b, c, n_out, cols, bg, pf); break;
      case 2: column_group<2>(ar, nr, hp, b, c, n_out, cols, bg, pf); break;
      case 3: column_group<3>(ar, nr, hp, b, c, n_out, cols, bg, pf); break;
      case 4: column_group<4>(ar, nr, hp, b, c, n_out, cols, bg, pf); break;
      case 5: column_group<5>(ar, nr, hp, b, c, n_out, cols, bg, pf); break;
      default: column_group<kBlocks>(ar, nr, hp, b, c, n_out, cols, bg, pf); break;
    }
  }
}
#endif

// The checks both paths share; returns {rows, hidden, column blocks, hidden_p}.
std::array<int64_t, 4> check_lm_head(const at::Tensor& x, const at::Tensor& packed, int64_t vocab,
                                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "lm_head: x [rows, hidden] on CPU expected; got ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "lm_head: packed weights from pack_lm_head expected; got ", packed.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1), vb = packed.size(0), hp = packed.size(1) * 2;
  TORCH_CHECK(hidden <= hp && hp - hidden < 32 && vocab <= vb * 16 && vocab > (vb - 1) * 16,
              "lm_head: x's hidden ", hidden, " or vocab ", vocab, " does not match the packed weights ", packed.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == vocab && bias->device().is_cpu()),
              "lm_head: bias [", vocab, "] on CPU expected; got ", bias.has_value() ? bias->sizes() : at::IntArrayRef{});
  return {rows, hidden, vb, hp};
}

// Which path this build runs the products on: "amx", "avx512_bf16" or "none".
std::string mixed_product_isa() {
#if defined(AREAL_FLOW_AVX512_BF16)
  return "avx512_bf16";
#elif defined(AREAL_FLOW_AMX)
  return "amx";
#else
  return "none";
#endif
}

at::Tensor lm_head(const at::Tensor& x, const at::Tensor& packed, int64_t vocab, const c10::optional<at::Tensor>& bias,
                   bool bf16_out) {
#if defined(AREAL_FLOW_AVX512_BF16)
  const auto dims = check_lm_head(x, packed, vocab, bias);
  const int64_t rows = dims[0], hidden = dims[1], vb = dims[2], hp = dims[3];
  at::Tensor a = x;  // bf16 rows of hp: a layer's input mostly is; else rounded and zero-padded
  if (x.scalar_type() != at::kBFloat16 || hidden != hp || !x.is_contiguous()) {
    a = at::zeros({rows, hp}, x.options().dtype(at::kBFloat16));
    a.narrow(1, 0, hidden).copy_(x);
  }
  at::Tensor out = at::empty({rows, vocab}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const c10::BFloat16 *ap = a.data_ptr<c10::BFloat16>(), *bp = packed.data_ptr<c10::BFloat16>();
  const at::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* biasp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  // threads split the tasks: groups of kBlocks column blocks x chunks of rows; a group's weights (6 x hp/2 x 64
  // bytes, 108 KB at hidden 576) stay in L2 while every row block of a chunk reads them
  const int64_t chunks = std::max<int64_t>(1, (rows + kRowChunk - 1) / kRowChunk);
  at::parallel_for(0, (vb + kBlocks - 1) / kBlocks * chunks, 1, [&](int64_t begin, int64_t end) {
    if (bf16_out)
      tasks(ap, rows, hp, bp, vb, out.data_ptr<c10::BFloat16>(), vocab, biasp, chunks, begin, end);
    else
      tasks(ap, rows, hp, bp, vb, out.data_ptr<float>(), vocab, biasp, chunks, begin, end);
  });
  return out;
#elif !defined(AREAL_FLOW_AMX)
  TORCH_CHECK(false, "lm_head: this build has neither AMX nor AVX-512 BF16 (the CPU lacks amx_bf16 and avx512_bf16)");
#else
  TORCH_CHECK(amx_permitted(), "lm_head: the kernel refused AMX's tile state (arch_prctl)");
  const auto dims = check_lm_head(x, packed, vocab, bias);
  const int64_t rows = dims[0], hidden = dims[1], vb = dims[2], hp = dims[3];
  const int64_t rp = (rows + 63) / 64 * 64;  // row tiles in groups of 4
  at::Tensor a = at::zeros({rp, hp}, x.options().dtype(at::kBFloat16));
  a.narrow(0, 0, rows).narrow(1, 0, hidden).copy_(x);
  at::Tensor out = at::empty({rows, vocab}, x.options().dtype(at::kFloat));
  const int64_t full = vocab / 16;  // column blocks stored straight into out; the last partial via scratch
  const c10::BFloat16 *ap = a.data_ptr<c10::BFloat16>(), *bp = packed.data_ptr<c10::BFloat16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, vb, 64, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) float scratch[64 * 16];
    for (int64_t g = 0; g < rp; g += 64) {
      const int64_t rt = std::min<int64_t>(4, (rows - g + 15) / 16);
      const bool direct_rows = g + rt * 16 <= rows;
      for (int64_t n = begin; n < end; ++n) {
        const bool direct = direct_rows && n < full;
        float* c = direct ? op + g * vocab + n * 16 : scratch;
        const int64_t cs = direct ? vocab * 4 : 64;
        const c10::BFloat16* a_g = ap + g * hp;
        const c10::BFloat16* b_n = bp + n * (hp / 2) * 32;
        switch (rt) {
          case 1: column_block<1>(a_g, hp * 2, b_n, hp / 32, c, cs); break;
          case 2: column_block<2>(a_g, hp * 2, b_n, hp / 32, c, cs); break;
          case 3: column_block<3>(a_g, hp * 2, b_n, hp / 32, c, cs); break;
          default: column_block<4>(a_g, hp * 2, b_n, hp / 32, c, cs); break;
        }
        if (!direct) {
          const int64_t cols = std::min<int64_t>(16, vocab - n * 16);
          for (int64_t r = 0; r < std::min<int64_t>(rt * 16, rows - g); ++r)
            std::memcpy(op + (g + r) * vocab + n * 16, scratch + r * 16, cols * sizeof(float));
        }
      }
    }
    _tile_release();
  });
  if (bias.has_value()) out.add_(*bias);  // fp32 sums plus bias, then one rounding
  return bf16_out ? out.to(at::kBFloat16) : out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_flow, m) {
  m.def("pack_lm_head(Tensor weight) -> Tensor");
  m.def("lm_head(Tensor x, Tensor packed, int vocab, Tensor? bias=None, bool bf16_out=False) -> Tensor");
  m.def("mixed_product_isa() -> str", TORCH_FN(mixed_product_isa));
  m.impl("pack_lm_head", c10::DispatchKey::CPU, TORCH_FN(pack_lm_head));
  m.impl("lm_head", c10::DispatchKey::CPU, TORCH_FN(lm_head));
}
