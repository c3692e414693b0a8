// cadenza's compiled CPU kernels: the ops of a decode step, fp32, without Python per op.
//
// On a CPU a decode step is a chain of matrix-vector products over weights read once per step
// plus ~70 small ops per layer; in eager PyTorch the small ops cost more than the products' own
// memory traffic. These kernels do each job in one call: a matrix-vector product for a few rows
// that streams each weight row once (`linear_rows`), RMSNorm with the residual add fused,
// in-place rotary embedding, SwiGLU, and paged attention of short query rows with the cache
// write fused. Work is split over torch's intra-op threads (at::parallel_for). Inner loops use
// GCC vector extensions (16 floats), compiled for the host CPU, so the same source builds AVX-512
// or AVX2 code. Shapes and semantics are those of kernels/reference.py, which the tests compare
// against; invariants are checked with TORCH_CHECK (a RuntimeError in Python).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The sum of the 16 lanes as a tree (halves added: 16 -> 8 -> 4 -> 1), a few shuffles rather
// than 15 dependent scalar adds.
inline float hsum(v16 v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const v8 s8 = lo + hi;
  v4 a, b;
  std::memcpy(&a, &s8, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof(a), sizeof(b));
  const v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

typedef int32_t vi16 __attribute__((vector_size(64)));

// exp of 16 lanes: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r,
// 2^n built in the exponent bits); within 2 ulp of std::exp for x in [-87, 88], inputs below
// clamp to e^-87 (softmax weights: x <= 0, negligible beside the maximum's 1).
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.0f, hi = v16{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  const vi16 trunc = __builtin_convertvector(fx, vi16);
  const v16 tf = __builtin_convertvector(trunc, v16);
  const vi16 n = tf > fx ? trunc - 1 : trunc;  // floor
  fx = __builtin_convertvector(n, v16);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const v16 z = x * x;
  v16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const vi16 bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a CPU float32 tensor");
}

// y[m, n0 + r] = x[m] . w[n0 + r] for MR rows of x and NR rows of w: each w row is read once from
// memory for all MR rows, with MR * NR accumulator vectors (at most 16 of the 32 registers).
template <int MR, int NR>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0) {
  v16 acc[MR][NR] = {};
  const float* w0 = w + n0 * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load16(w0 + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const v16 xv = load16(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[m][r] += wv[r] * xv;
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * w0[r * K + kk];
      y[m * N + n0 + r] = s;
    }
  }
}

// Rows of x in passes of 8, 4, then the rest, over blocks of kBlockN rows of w (one or two rows
// of x stream all 8 w rows at once: more streams in flight keep the memory system busier).
constexpr int64_t kBlockN = 8;

void rows_block(const float* x, const float* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 8 <= rows; m += 8)
    for (int64_t r = 0; r < kBlockN; r += 2) block<8, 2>(x + m * K, w, y + m * N, K, N, n0 + r);
  for (; m + 4 <= rows; m += 4)
    for (int64_t r = 0; r < kBlockN; r += 4) block<4, 4>(x + m * K, w, y + m * N, K, N, n0 + r);
  switch (rows - m) {
    case 3: for (int64_t r = 0; r < kBlockN; r += 4) block<3, 4>(x + m * K, w, y + m * N, K, N, n0 + r); break;
    case 2: block<2, 8>(x + m * K, w, y + m * N, K, N, n0); break;
    case 1: block<1, 8>(x + m * K, w, y + m * N, K, N, n0); break;
    default: break;
  }
}

}  // namespace

// x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N], for small M (decode rows): w streamed once.
torch::Tensor linear_rows(const torch::Tensor& x_in, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  check_f32(x_in, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_rows: x [M, K] and weight [N, K]");
  TORCH_CHECK(w.is_contiguous(), "linear_rows: weight must be contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "linear_rows: bias must be [N]");
  }
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (K == 0 || M == 0 || N == 0) {  // an empty product: zeros (plus the bias)
    torch::Tensor y = torch::zeros({M, N}, x.options());
    return has_bias ? y.add_(*bias) : y;
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / kBlockN;
  // ~64 KiB of weights per task at least, so small layers are not split into slivers.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kBlockN * K * static_cast<int64_t>(sizeof(float))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows_block(xp, wp, yp, M, K, N, kBlockN * b);
  });
  for (int64_t n = kBlockN * blocks; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot(xp + m * K, wp + n * K, K);
  if (has_bias) y.add_(*bias);
  return y;
}

// RMSNorm over the last dim of x [T, H]; with a residual, h = x + residual is normalised and
// returned as the new residual. Returns {out} or {out, h}.
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps,
                                    const c10::optional<torch::Tensor>& residual_in) {
  check_f32(x_in, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 1 && weight.size(0) == x_in.size(1) && x_in.size(1) > 0,
              "rms_norm: x [T, H], weight [H], H > 0");
  const torch::Tensor x = x_in.contiguous();
  const bool fused = residual_in.has_value() && residual_in->defined();
  torch::Tensor h;
  if (fused) {
    check_f32(*residual_in, "residual");
    TORCH_CHECK(residual_in->sizes() == x.sizes(), "rms_norm: residual must match x");
    h = torch::empty_like(x);
  }
  const torch::Tensor residual = fused ? residual_in->contiguous() : x;
  torch::Tensor out = torch::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* hp = fused ? h.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = xp + t * H;
      if (fused) {
        float* dst = hp + t * H;
        for (int64_t i = 0; i < H; ++i) dst[i] = src[i] + rp[t * H + i];
        src = dst;
      }
      double ss = 0.0;
      for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(src[i]) * src[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) op[t * H + i] = wp[i] * (src[i] * inv);
    }
  });
  if (fused) return {out, h};
  return {out};
}

// GPT-NeoX rotary embedding applied in place to q [T, Hq, D] and k [T, Hkv, D] (last dim
// contiguous, any row stride: views of the fused qkv output), cos_sin [P, D] = [cos | sin].
void rotary_embedding(const torch::Tensor& positions, torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos_sin_in) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(cos_sin_in, "cos_sin_cache");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1, "rotary_embedding: positions [T] int64");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == positions.size(0) && k.size(0) == positions.size(0) &&
                  q.size(2) == k.size(2) && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary_embedding: q [T, Hq, D], k [T, Hkv, D] with a contiguous last dim");
  TORCH_CHECK(cos_sin_in.dim() == 2, "rotary_embedding: cos_sin_cache must be [max_position, D]");
  const torch::Tensor cos_sin = cos_sin_in.contiguous();
  const torch::Tensor pos = positions.contiguous();
  const int64_t T = q.size(0), D = q.size(2), half = D / 2, P = cos_sin.size(0);
  TORCH_CHECK(cos_sin.size(1) == D, "rotary_embedding: cos_sin_cache must be [max_position, D]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "rotary_embedding: position ", pp[t], " outside the table");
  const float* cs = cos_sin.data_ptr<float>();
  auto rotate = [&](torch::Tensor& x, int64_t t) {
    const float* c = cs + pp[t] * D;
    const float* s = c + half;
    float* base = x.data_ptr<float>() + t * x.stride(0);
    for (int64_t h = 0; h < x.size(1); ++h) {
      float* v = base + h * x.stride(1);
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  };
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, t);
      rotate(k, t);
    }
  });
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I] -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& x_in) {
  check_f32(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "silu_and_mul: x [T, 2I]");
  const torch::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  torch::Tensor out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * I, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t t = j / I, i = j % I;
      const float g = xp[t * 2 * I + i];
      op[j] = g / (1.0f + std::exp(-g)) * xp[t * 2 * I + I + i];
    }
  });
  return out;
}

// Writes k, v [T, Hkv, D] into the caches [NB, BS, Hkv, D] at slot_mapping [T] (negative slots
// are skipped), then, for every
// row whose query length is at most max_query_len, attends each of its query tokens (causal
// within the row, full over the cached prefix) into out [T, Hq, D]. Rows longer than that are
// skipped (the caller attends them); the return value says whether any was.
bool paged_attention_short(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                           torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping_in,
                           const torch::Tensor& query_start_loc_in, const torch::Tensor& seq_lens_in,
                           const torch::Tensor& block_tables_in, double scale, torch::Tensor& out,
                           int64_t max_query_len) {
  for (const torch::Tensor* t : {&q_in, &k, &v, static_cast<const torch::Tensor*>(&k_cache),
                                 static_cast<const torch::Tensor*>(&v_cache), static_cast<const torch::Tensor*>(&out)})
    check_f32(*t, "attention tensors");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(), "attention: caches and out must be contiguous");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "attention: k, v [T, Hkv, D]");
  TORCH_CHECK(q_in.dim() == 3 && q_in.stride(2) == 1, "attention: q [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(slot_mapping_in.scalar_type() == torch::kInt64, "attention: slot_mapping must be int64");
  for (const torch::Tensor* t : {&query_start_loc_in, &seq_lens_in, &block_tables_in})
    TORCH_CHECK(t->scalar_type() == torch::kInt32, "attention: query_start_loc, seq_lens, block_tables must be int32");
  const torch::Tensor& q = q_in;  // read through its strides: a view of the fused qkv output
  const torch::Tensor slots = slot_mapping_in.contiguous();
  const torch::Tensor qsl = query_start_loc_in.contiguous();
  const torch::Tensor lens = seq_lens_in.contiguous();
  const torch::Tensor tables = block_tables_in.contiguous();
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.dim() == 4, "attention: k_cache and v_cache must both be [NB, BS, Hkv, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "attention: out must be shaped as q");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(Hkv > 0 && D > 0 && k_cache.size(1) > 0, "attention: no KV heads, head dim or block size");
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), S = lens.size(0), W = tables.size(1);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && k_cache.size(2) == Hkv && k_cache.size(3) == D && Hq % Hkv == 0,
              "attention: shapes disagree");
  TORCH_CHECK(slots.size(0) == T && qsl.size(0) == S + 1 && tables.size(0) == S, "attention: metadata shapes disagree");
  const int32_t* qp = qsl.data_ptr<int32_t>();
  TORCH_CHECK(qp[0] == 0 && qp[S] == T, "attention: query_start_loc must run from 0 to T = ", T);
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(qp[s] <= qp[s + 1], "attention: query_start_loc must not decrease");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < NB * BS, "attention: slot ", sp[t], " outside the cache");
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t row_floats = Hkv * D;
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0) continue;  // a padding token: nothing to write (as the Triton kernel)
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kc + sp[t] * row_floats + h * D, k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), D * sizeof(float));
      std::memcpy(vc + sp[t] * row_floats + h * D, v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), D * sizeof(float));
    }
  }
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  // One task per query token of the short rows, all heads together: a token's key and value
  // rows (all KV heads, contiguous) are read once, in order, for every query head — a stream the
  // hardware prefetcher follows, where one KV head's slice at a stride is a latency-bound walk.
  // With fewer tokens than twice the threads, a task takes one KV head (its query group), so a
  // single decode still spreads over the threads.
  std::vector<int64_t> task_row, task_token;
  bool skipped = false;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qp[s + 1] - qp[s];
    if (n > max_query_len) {
      skipped = true;
      continue;
    }
    TORCH_CHECK(n <= lp[s] && (lp[s] + BS - 1) / BS <= W, "attention: row ", s, " has more tokens than its blocks");
    for (int64_t b = 0; b < (lp[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[s * W + b] >= 0 && tp[s * W + b] < NB, "attention: row ", s, " names block ", tp[s * W + b]);
    for (int64_t j = 0; j < n; ++j) {
      task_row.push_back(s);
      task_token.push_back(qp[s] + j);
    }
  }
  const float* qd = q.data_ptr<float>();
  const int64_t q_t = q.stride(0), q_h = q.stride(1);
  float* od = out.data_ptr<float>();
  const int64_t G = Hq / Hkv, num_tokens = static_cast<int64_t>(task_row.size());
  const int64_t split = num_tokens >= 2 * at::get_num_threads() ? 1 : Hkv;  // tasks per token
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_tokens * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, best, total;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / split, g0 = split == 1 ? 0 : task % split, g1 = split == 1 ? Hkv : g0 + 1;
      const int64_t s = task_row[i], t = task_token[i];
      const int64_t n = qp[s + 1] - qp[s];
      const int64_t length = lp[s] - n + (t - qp[s]) + 1;  // keys 0 .. position of this query
      const int64_t H = (g1 - g0) * G;                      // query heads g0*G .. g1*G - 1
      const float* qt = qd + t * q_t;
      const int32_t* row_blocks = tp + s * W;
      scores.resize(H * length);
      best.assign(H, -std::numeric_limits<float>::infinity());
      total.assign(H, 0.f);
      acc.assign(H * D, 0.f);
      for (int64_t l0 = 0, b = 0; l0 < length; l0 += BS, ++b) {  // scores, block by block
        const float* kb = kc + static_cast<int64_t>(row_blocks[b]) * BS * row_floats;
        const int64_t m = std::min(BS, length - l0);
        for (int64_t j = 0; j < m; ++j) {
          const float* krow = kb + j * row_floats;
          for (int64_t h = 0; h < H; ++h) {
            const int64_t qh = g0 * G + h;
            const float sc = dot(qt + qh * q_h, krow + (qh / G) * D, D) * fscale;
            scores[h * length + l0 + j] = sc;
            best[h] = std::max(best[h], sc);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // softmax weights, in place
        float* sh = scores.data() + h * length;
        v16 sums = {};
        int64_t l = 0;
        for (; l + 16 <= length; l += 16) {
          const v16 e = exp16(load16(sh + l) - best[h]);
          store16(sh + l, e);
          sums += e;
        }
        float sum = hsum(sums);
        for (; l < length; ++l) sum += (sh[l] = std::exp(sh[l] - best[h]));
        total[h] = sum;
      }
      for (int64_t l0 = 0, b = 0; l0 < length; l0 += BS, ++b) {  // weighted values
        const float* vb = vc + static_cast<int64_t>(row_blocks[b]) * BS * row_floats;
        const int64_t m = std::min(BS, length - l0);
        for (int64_t j = 0; j < m; ++j) {
          const float* vrow = vb + j * row_floats;
          for (int64_t h = 0; h < H; ++h) {
            const float p = scores[h * length + l0 + j];
            const float* vv = vrow + ((g0 * G + h) / G) * D;
            float* a = acc.data() + h * D;
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) store16(a + d, load16(a + d) + p * load16(vv + d));
            for (; d < D; ++d) a[d] += p * vv[d];
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* o = od + (t * Hq + g0 * G + h) * D;
        const float inv = 1.0f / total[h];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
      }
    }
  });
  return skipped;
}

// One Llama decoder layer for a step of short rows (decodes), in one call from Python: the same
// kernels as above in the model's order (llama.py's DecoderLayer), without a Python frame, a
// module call or a tensor view per op. Built once per layer with the layer's weights.
struct DecodeLayer {
  torch::Tensor input_norm, w_qkv, w_o, post_norm, w_gate_up, w_down;
  c10::optional<torch::Tensor> b_qkv, b_gate_up, b_down;
  double eps, scale;
  int64_t num_heads, num_kv_heads, head_dim, short_row;

  // x [T, H] and the residual stream ([T, H], or None before the first layer) -> {x, residual}.
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                     const torch::Tensor& positions, const torch::Tensor& cos_sin,
                                     torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                     const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                                     const torch::Tensor& block_tables) const {
    const bool first = !(residual.has_value() && residual->defined());
    std::vector<torch::Tensor> normed = rms_norm(x, input_norm, eps, residual);
    const torch::Tensor stream = first ? x : normed[1];
    const int64_t T = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    torch::Tensor qkv = linear_rows(normed[0], w_qkv, b_qkv);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos_sin);
    torch::Tensor o = torch::empty({T, num_heads, head_dim}, x.options());
    const bool skipped = paged_attention_short(q, k, v, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens,
                                               block_tables, scale, o, short_row);
    TORCH_CHECK(!skipped, "decode layer: a row of more than ", short_row, " query tokens");
    std::vector<torch::Tensor> post = rms_norm(linear_rows(o.view({T, q_size}), w_o, c10::nullopt), post_norm, eps, stream);
    torch::Tensor down = linear_rows(silu_and_mul(linear_rows(post[0], w_gate_up, b_gate_up)), w_down, b_down);
    return {down, post[1]};
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init([](torch::Tensor input_norm, torch::Tensor w_qkv, c10::optional<torch::Tensor> b_qkv,
                             torch::Tensor w_o, torch::Tensor post_norm, torch::Tensor w_gate_up,
                             c10::optional<torch::Tensor> b_gate_up, torch::Tensor w_down,
                             c10::optional<torch::Tensor> b_down, double eps, double scale, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t short_row) {
             for (const torch::Tensor* t : {&input_norm, &w_qkv, &w_o, &post_norm, &w_gate_up, &w_down}) {
               check_f32(*t, "decode layer weights");
               TORCH_CHECK(t->is_contiguous(), "decode layer: weights must be contiguous");
             }
             TORCH_CHECK(w_qkv.size(0) == (num_heads + 2 * num_kv_heads) * head_dim && w_o.size(1) == num_heads * head_dim &&
                             w_gate_up.size(0) == 2 * w_down.size(1),
                         "decode layer: weight shapes disagree with the head counts");
             return DecodeLayer{input_norm, w_qkv, w_o, post_norm, w_gate_up, w_down, b_qkv, b_gate_up, b_down,
                                eps, scale, num_heads, num_kv_heads, head_dim, short_row};
           }))
      .def("forward", &DecodeLayer::forward, "one decoder layer over a step of short rows");
  m.def("linear_rows", &linear_rows, "x [M, K] @ weight [N, K]^T + bias for few rows");
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional fused residual add");
  m.def("rotary_embedding", &rotary_embedding, "in-place GPT-NeoX rotary embedding of q and k");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU of the fused gate/up projection");
  m.def("paged_attention_short", &paged_attention_short, "cache write and paged attention of short rows");
}
