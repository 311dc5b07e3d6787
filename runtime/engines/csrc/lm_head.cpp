// The embedded engine's LM head on CPUs with AMX: bf16 inputs and weights, fp32 accumulation and
// fp32 logits (``gen.lm_head_dtype=mixed``). PyTorch's bf16 product rounds every logit to bf16
// (an error of up to 2^-9 of a logit, ~0.06 nats at logit 30); its fp32 product reads twice the
// bytes and runs on the AVX-512 FMA units. Here each 16 x 16 tile of logits is summed over the
// hidden dim by AMX's TDPBF16PS (bf16 pairs multiplied exactly, summed in fp32; Intel Architecture
// Instruction Set Extensions Programming Reference, ch. 3) and stored in fp32.
//
//   pack_lm_head(weight [vocab, hidden] bf16) -> packed [ceil(vocab/16), hidden_p/2, 16, 2] bf16
//       (hidden_p: hidden rounded up to 32; zero padding): for each block of 16 vocabulary rows,
//       row kk holds, for each of the 16, the pair (w[n][2 kk], w[n][2 kk + 1]): AMX's B layout.
//   lm_head(x [rows, hidden] fp32 or bf16, packed, vocab) -> logits [rows, vocab] fp32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AREAL_FLOW_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

at::Tensor pack_lm_head(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_lm_head: weight [vocab, hidden] bf16 on CPU expected; got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t vocab = weight.size(0), hidden = weight.size(1);
  const int64_t vb = (vocab + 15) / 16, hp = (hidden + 31) / 32 * 32;
  at::Tensor padded = at::zeros({vb * 16, hp}, weight.options());
  padded.narrow(0, 0, vocab).narrow(1, 0, hidden).copy_(weight);
  // [vb, 16 n, hp/2 kk, 2] -> [vb, hp/2 kk, 16 n, 2]
  return padded.view({vb, 16, hp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
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

at::Tensor lm_head(const at::Tensor& x, const at::Tensor& packed, int64_t vocab) {
#ifndef AREAL_FLOW_AMX
  TORCH_CHECK(false, "lm_head: this build has no AMX (the CPU lacks amx_tile / amx_bf16)");
#else
  TORCH_CHECK(amx_permitted(), "lm_head: the kernel refused AMX's tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "lm_head: x [rows, hidden] on CPU expected; got ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "lm_head: packed weights from pack_lm_head expected; got ", packed.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1), vb = packed.size(0), hp = packed.size(1) * 2;
  TORCH_CHECK(hidden <= hp && hp - hidden < 32 && vocab <= vb * 16 && vocab > (vb - 1) * 16,
              "lm_head: x's hidden ", hidden, " or vocab ", vocab, " does not match the packed weights ", packed.sizes());
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
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_flow, m) {
  m.def("pack_lm_head(Tensor weight) -> Tensor");
  m.def("lm_head(Tensor x, Tensor packed, int vocab) -> Tensor");
  m.impl("pack_lm_head", c10::DispatchKey::CPU, TORCH_FN(pack_lm_head));
  m.impl("lm_head", c10::DispatchKey::CPU, TORCH_FN(lm_head));
}
