// A custom block through the graph C ABI: a causal 1-D depthwise convolution gate (a host
// callback), a residual add, RMSNorm and a matmul on the backend. The graph fuses the add
// and the norm into one add_rmsnorm; the example checks the output against its own
// computation and exits nonzero on a mismatch.
#include <tboost.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {
constexpr size_t T = 4, C = 8, N = 3, K = 3;  // rows, channels, outputs, conv taps

std::vector<float> conv_k(C* K);

// g[t, c] = x[t, c] * sigmoid(sum_j k[c, j] * x[t - j, c])
void gate(const float* x, float* g) {
  for (size_t t = 0; t < T; t++)
    for (size_t c = 0; c < C; c++) {
      float s = 0;
      for (size_t j = 0; j < K && j <= t; j++) s += conv_k[c * K + j] * x[(t - j) * C + c];
      g[t * C + c] = x[t * C + c] / (1.0f + std::exp(-s));
    }
}

int32_t conv_gate(void*, const float* const* in, const size_t* in_lens, size_t n_in, float* const* out,
                  const size_t* out_lens, size_t n_out) {
  if (n_in != 1 || n_out != 1 || in_lens[0] != T * C || out_lens[0] != T * C) return 1;
  gate(in[0], out[0]);
  return 0;
}

bool check(tboost_status s, const char* what) {
  if (s == TBOOST_OK) return true;
  char msg[512];
  size_t need = 0;
  tboost_last_error(msg, sizeof msg, &need);
  std::fprintf(stderr, "%s failed (%d): %s\n", what, static_cast<int>(s), msg);
  return false;
}

tboost_tensor tensor(tboost_buffer* b, std::vector<uint64_t> shape) {
  tboost_tensor t{};
  tboost_tensor_init(&t, b, shape.data(), shape.size());
  return t;
}
}  // namespace

#define CHECK(call)                 \
  do {                              \
    if (!check((call), #call)) return 1; \
  } while (0)

int main() {
  for (size_t i = 0; i < C * K; i++) conv_k[i] = 0.25f * static_cast<float>(i % 5) - 0.5f;
  std::vector<float> x(T * C), gain(C), w(N * C);
  for (size_t i = 0; i < x.size(); i++) x[i] = std::sin(0.7f * static_cast<float>(i));
  for (size_t i = 0; i < C; i++) gain[i] = 0.5f + 0.125f * static_cast<float>(i);
  for (size_t i = 0; i < w.size(); i++) w[i] = std::cos(0.3f * static_cast<float>(i));

  tboost_backend* be = nullptr;
  CHECK(tboost_backend_open("cpu", 1, &be));
  std::vector<tboost_buffer*> bufs(5, nullptr);
  uint64_t xs[] = {T, C}, gs[] = {C}, ws[] = {N, C}, ys[] = {T, N};
  CHECK(tboost_backend_upload_weight(be, TBOOST_DTYPE_F32, gs, 1, gain.data(), gain.size() * 4, &bufs[0]));
  CHECK(tboost_backend_upload_weight(be, TBOOST_DTYPE_F32, ws, 2, w.data(), w.size() * 4, &bufs[1]));
  CHECK(tboost_backend_alloc(be, TBOOST_DTYPE_F32, xs, 2, &bufs[2]));
  CHECK(tboost_backend_alloc(be, TBOOST_DTYPE_F32, ys, 2, &bufs[3]));

  tboost_norm_params np{};
  np.struct_size = sizeof np;
  np.gain_dtype = TBOOST_DTYPE_F32;
  np.dim = C;
  np.eps = 1e-6f;
  np.act_dtype = TBOOST_DTYPE_F32;
  tboost_matmul_params mp{};
  mp.struct_size = sizeof mp;
  mp.weight_dtype = TBOOST_DTYPE_F32;
  mp.n = N;
  mp.k = C;
  mp.bias = 0;
  mp.precision = 0;
  mp.act_dtype = TBOOST_DTYPE_F32;
  tboost_op *norm = nullptr, *mm = nullptr;
  CHECK(tboost_op_create(be, TBOOST_OP_RMSNORM, &np, &norm));
  CHECK(tboost_op_create(be, TBOOST_OP_MATMUL, &mp, &mm));

  tboost_graph* g = nullptr;
  CHECK(tboost_graph_create(be, &g));
  CHECK(tboost_graph_add_input(g, "x", TBOOST_DTYPE_F32, xs, 2));
  tboost_tensor gain_t = tensor(bufs[0], {C}), w_t = tensor(bufs[1], {N, C});
  CHECK(tboost_graph_add_constant(g, "gain", &gain_t));
  CHECK(tboost_graph_add_constant(g, "w", &w_t));
  const char* cb_in[] = {"x"};
  const char* cb_out[] = {"gated"};
  size_t cb_nd[] = {2};
  CHECK(tboost_graph_add_callback(g, conv_gate, nullptr, cb_in, 1, cb_out, cb_nd, xs, 1));
  CHECK(tboost_graph_add_add(g, TBOOST_DTYPE_F32, "x", "gated", "h"));
  const char* norm_in[] = {"h", "gain"};
  const char* norm_out[] = {"normed"};
  CHECK(tboost_graph_add_op(g, norm, norm_in, 2, norm_out, 1));
  const char* mm_in[] = {"normed", "w"};
  const char* mm_out[] = {"y"};
  CHECK(tboost_graph_add_op(g, mm, mm_in, 2, mm_out, 1));
  const char* outs[] = {"y"};
  CHECK(tboost_graph_set_outputs(g, outs, 1));
  CHECK(tboost_graph_build(g));
  char report[512];
  size_t need = 0;
  CHECK(tboost_graph_fusions(g, report, sizeof report, &need));
  std::printf("fusions: %s\n", report);

  tboost_tensor x_t = tensor(bufs[2], {T, C}), y_t = tensor(bufs[3], {T, N});
  CHECK(tboost_backend_copy(be, &x_t, x.data(), x.size() * 4, TBOOST_COPY_HOST_TO_BACKEND));
  CHECK(tboost_graph_run(g, &x_t, 1, &y_t, 1));
  std::vector<float> y(T * N);
  CHECK(tboost_backend_copy(be, &y_t, y.data(), y.size() * 4, TBOOST_COPY_BACKEND_TO_HOST));

  // By hand, in double: h = x + gate(x); y = rmsnorm(h) * gain . w^T.
  std::vector<float> gx(T * C);
  gate(x.data(), gx.data());
  int bad = 0;
  for (size_t t = 0; t < T; t++) {
    double ms = 0;
    std::vector<double> h(C);
    for (size_t c = 0; c < C; c++) {
      h[c] = static_cast<double>(x[t * C + c]) + gx[t * C + c];
      ms += h[c] * h[c];
    }
    double inv = 1.0 / std::sqrt(ms / C + 1e-6);
    for (size_t n = 0; n < N; n++) {
      double want = 0;
      for (size_t c = 0; c < C; c++) want += h[c] * inv * gain[c] * w[n * C + c];
      double got = y[t * N + n];
      if (std::fabs(got - want) > 1e-4 * (1 + std::fabs(want))) {
        std::fprintf(stderr, "y[%zu, %zu] = %.7f, expected %.7f\n", t, n, got, want);
        bad++;
      }
    }
  }
  tboost_graph_free(g);
  tboost_op_free(norm);
  tboost_op_free(mm);
  for (auto* b : bufs) tboost_buffer_free(b);
  tboost_backend_free(be);
  if (bad) return 1;
  std::printf("custom block: %zu x %zu outputs equal the hand computation\n", T, N);
  return 0;
}
