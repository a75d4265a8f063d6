// The engine's CPU kernels (fp32), built on first use by torch.utils.cpp_extension (see cpu_kernels.py):
// - paged_decode_attention: each sequence's single new query reads its keys and values in place through
//   its block table (no gather into a contiguous copy); the query heads that share a KV head read each
//   K/V row once, and a sequence's KV heads are read together, in address order. head_dim 16, 32, 64 or
//   128; up to 8 query heads per KV head.
// - rms_norm: RMSNorm in two passes over each row; add_rms_norm_: the skip connection's add and the next norm
//   in place; silu_and_mul: SwiGLU's activation; rotary_: RoPE in place. One pass each where ATen takes several
//   ops and temporaries.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// 16 floats; GCC lowers it to what the target has (one AVX-512 register, two AVX2, four SSE).
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

inline vec16 load(const float* p) { vec16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(vec16 v) {  // a tree of halving adds, not 15 dependent ones
  vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

struct Paged {  // one sequence's KV head: token i of its j-th block sits at block(j) + i * token_stride
  const float* base; const int64_t* table; int64_t block_size, block_stride, token_stride;
  const float* block(int64_t j) const { return base + table[j] * block_stride; }
};

// One sequence's rows in order, block by block, with no division per row.
struct Rows {
  const Paged& p;
  const int64_t ctx;
  int64_t t = 0, i = 0, j = 0;  // token t: row i of the sequence's j-th block
  const float* row;
  Rows(const Paged& p, int64_t ctx) : p(p), ctx(ctx), row(p.block(0)) {}
  void next() {
    ++t;
    if (++i < p.block_size) {
      row += p.token_stride;
      return;
    }
    i = 0, ++j;
    if (t < ctx) row = p.block(j);  // past the last row the table may have no next block
  }
};

// Calls fn(t, row) for t in [0, ctx), prefetching in two streams: ~8 KB ahead into L2 and ~1 KB ahead into
// L1. Blocks lie anywhere in the cache, so the hardware prefetchers do not see the next one coming, and one
// stream into L1 alone keeps too few lines in flight. Measured here, 8 layers of 32 decodes at contexts
// 100-600 over 4 KV heads (16 query heads): 10.0 ms against 14.1 with one stream 2 KB ahead into L1, and
// 1.7 ms against 2.5 at 8 decodes; about the same at 1 decode and over 2 KV heads. Of 4, 8 and 16 KB far
// and 0.5, 1 and 2 KB near, 8 KB and 1 KB were best or within 5% of it in each case; far into L1 or
// non-temporal was slower.
template <int kLocality>  // 3: into L1; 1: into L2
inline void prefetch_row(const float* row, int64_t row_bytes) {
  for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + c, 0, kLocality);
}

template <typename Fn>
inline void for_each_row(const Paged& p, int64_t ctx, int64_t row_bytes, Fn fn) {
  const int64_t near_rows = std::max<int64_t>(1, 1024 / row_bytes), far_rows = std::max<int64_t>(2, 8192 / row_bytes);
  Rows at(p, ctx), near(p, ctx), far(p, ctx);
  for (; far.t < std::min(far_rows, ctx); far.next()) prefetch_row<1>(far.row, row_bytes);
  for (; near.t < std::min(near_rows, ctx); near.next()) prefetch_row<3>(near.row, row_bytes);
  for (; at.t < ctx; at.next()) {
    if (far.t < ctx) prefetch_row<1>(far.row, row_bytes), far.next();
    if (near.t < ctx) prefetch_row<3>(near.row, row_bytes), near.next();
    fn(at.t, at.row);
  }
}

// One sequence and nh adjacent KV heads, each shared by kG query heads, token by token: a token's rows
// of those heads lie side by side, so a block is read in address order, not one head's rows at a stride
// (at 32 decodes over 4 KV heads, whole sequences per item: ~18% faster than a head per item here).
// kD (head_dim / 16) and kG are compile-time so a K/V row stays in registers.
template <int kD, int kG>
void attend(const float* q, Paged keys, Paged values, int64_t head_stride, int64_t nh, int64_t ctx, float scale, float* scores,
            float* out) {
  const int64_t row_bytes = ((nh - 1) * head_stride + kD * 16) * 4;
  for_each_row(keys, ctx, row_bytes, [&](int64_t t, const float* row) {
    for (int64_t h = 0; h < nh; ++h) {
      const float *k = row + h * head_stride, *qh = q + h * kG * kD * 16;
      vec16 kv[kD];
      for (int d = 0; d < kD; ++d) kv[d] = load(k + 16 * d);
      for (int g = 0; g < kG; ++g) {
        vec16 s = load(qh + g * kD * 16) * kv[0];
        for (int d = 1; d < kD; ++d) s += load(qh + (g * kD + d) * 16) * kv[d];
        scores[(h * kG + g) * ctx + t] = hsum(s) * scale;
      }
    }
  });
  for (int64_t r = 0; r < nh * kG; ++r) {  // softmax over the context, in place
    float* s = scores + r * ctx;
    const float m = *std::max_element(s, s + ctx);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) sum += (s[t] = std::exp(s[t] - m));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
  }
  std::memset(out, 0, nh * kG * kD * 16 * sizeof(float));
  for_each_row(values, ctx, row_bytes, [&](int64_t t, const float* row) {
    for (int64_t h = 0; h < nh; ++h) {
      const float* v = row + h * head_stride;
      vec16 vv[kD];
      for (int d = 0; d < kD; ++d) vv[d] = load(v + 16 * d);
      for (int g = 0; g < kG; ++g) {
        const float p = scores[(h * kG + g) * ctx + t];
        float* o = out + (h * kG + g) * kD * 16;
        for (int d = 0; d < kD; ++d) store(o + 16 * d, load(o + 16 * d) + p * vv[d]);
      }
    }
  });
}

template <int kD, int kG>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& context_lens, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), KV = k_cache.size(2), G = kG, W = block_tables.size(1);
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // Work items handed out one at a time (contexts differ, so equal static shares would not balance): whole
  // sequences when there are enough to keep every thread busy, else one KV head of a sequence each.
  const int64_t threads = at::get_num_threads(), heads_per_item = B >= 2 * threads ? KV : 1, items_per_seq = KV / heads_per_item;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t item; (item = next++) < B * items_per_seq;) {
      const int64_t b = item / items_per_seq, h = item % items_per_seq * heads_per_item, ctx = lens[b];
      scores.resize(heads_per_item * G * ctx);
      Paged keys{kp + h * k_cache.stride(2), tables + b * W, k_cache.size(1), k_cache.stride(0), k_cache.stride(1)};
      Paged values{vp + h * v_cache.stride(2), tables + b * W, v_cache.size(1), v_cache.stride(0), v_cache.stride(1)};
      attend<kD, kG>(qp + b * q.stride(0) + h * G * q.stride(1), keys, values, k_cache.stride(2), heads_per_item, ctx, scale,
                     scores.data(), op + (b * H + h * G) * 16 * kD);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "paged_decode_attention: q [B, H, D], k_cache and v_cache [blocks, block_size, KV, D] of one layout");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong && block_tables.is_contiguous() &&
              context_lens.is_contiguous() && block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode_attention: block_tables [B, W] and context_lens [B], contiguous int64");
  const int64_t D = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && k_cache.stride(3) == 1 && k_cache.size(3) == D && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: rows of head_dim contiguous, query heads a multiple of KV heads");
  TORCH_CHECK(k_cache.size(2) > 0 && k_cache.size(1) > 0, "paged_decode_attention: empty cache layout");
  const int64_t W = block_tables.size(1), bs = k_cache.size(1), num_blocks = k_cache.size(0), capacity = W * bs;
  const int64_t *lens = context_lens.data_ptr<int64_t>(), *tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= capacity, "paged_decode_attention: context_lens[", b, "] = ", lens[b],
                " is outside 1..", capacity, " (block_tables width x block_size)");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[b * W + j] >= 0 && tables[b * W + j] < num_blocks, "paged_decode_attention: block_tables[", b, ", ", j,
                  "] = ", tables[b * W + j], " is outside 0..", num_blocks - 1);
  }
  auto out = at::empty({q.size(0), q.size(1), D}, q.options());
  const int64_t G = q.size(1) / k_cache.size(2);
#define KERNEL(d, g) \
  if (D == 16 * d && G == g) return run<d, g>(q, k_cache, v_cache, block_tables, context_lens, scale, out), out;
#define GROUPS(d) KERNEL(d, 1) KERNEL(d, 2) KERNEL(d, 3) KERNEL(d, 4) KERNEL(d, 5) KERNEL(d, 6) KERNEL(d, 7) KERNEL(d, 8)
  GROUPS(1) GROUPS(2) GROUPS(4) GROUPS(8)
#undef GROUPS
#undef KERNEL
  TORCH_CHECK(false, "paged_decode_attention: no kernel for head_dim ", D, " with ", G, " query heads per KV head");
}

// RMSNorm of one row: one pass for its sum of squares, one to scale it.
inline void rms_norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

// Rows per task for the row-wise ops below: ~64K elements, so decode's few rows run on the calling thread
// without a parallel region.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)); }

// RMSNorm over the last dimension. ATen's CPU rms_norm is a chain of ops (pow, mean, add, rsqrt, mul, mul,
// casts), each a pass and a parallel region of its own: 4-6x slower here, from 1 row to 2048.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: x [..., N] and weight [N]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty(xc.sizes(), xc.options());
  const int64_t N = weight.size(0), rows = N ? xc.numel() / N : 0;
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * N, wp, op + r * N, N, eps);
  });
  return out;
}

// residual += x, then x = RMSNorm(residual), both in place: a decoder layer's skip connection and the norm
// after it in one pass over the rows, with no new tensor (vLLM's fused_add_rms_norm).
void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "add_rms_norm_: float32 only");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous() && weight.dim() == 1 &&
              weight.is_contiguous() && x.size(-1) == weight.size(0), "add_rms_norm_: x and residual [..., N] contiguous, weight [N]");
  const int64_t N = weight.size(0), rows = N ? x.numel() / N : 0;
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float *xr = xp + r * N, *rr = rp + r * N;
      for (int64_t i = 0; i < N; ++i) rr[i] += xr[i];
      rms_norm_row(rr, wp, xr, N, eps);
    }
  });
}

// silu(gate) * up of the fused gate/up projection's output [T, 2N] (gate first): one pass, where ATen runs
// silu into a temporary and then a multiply.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_and_mul: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x [T, 2N]");
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), N = xc.size(1) / 2;
  auto out = at::empty({T, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(2 * N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = xp + r * 2 * N, *up = gate + N;
      float* o = op + r * N;
      for (int64_t i = 0; i < N; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// RoPE in place on x [T, heads, D] (rows of D contiguous; q and k can be views into the fused qkv output),
// with each token's cos and sin [T, D] at full width and rotate_half's sign folded into sin (model.Rotary):
// x * cos + swap_halves(x) * sin, the same arithmetic as transformers' rotate_half.
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rotary_: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary_: x [T, heads, D] with rows of D contiguous, D even");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D, "rotary_: cos and sin [T, D] contiguous");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, T, row_grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* row = xp + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = row[i], x2 = row[i + half];
          row[i] = x1 * c[i] + x2 * s[i];
          row[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(mlplat, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, &rotary_);
}
