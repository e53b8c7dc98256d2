// The C ABI from C++: every function in tboost.h, its error paths, its thread rules, and
// equality with the Rust API (the `tboost batch` CLI) on the golden models.
#include <gtest/gtest.h>
#include <tboost.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Tokens = std::vector<int32_t>;
using Clock = std::chrono::steady_clock;

// ---- environment ----------------------------------------------------------------------

std::string SharedDir() {
  const char* env = std::getenv("TBOOST_SHARED");
  return env != nullptr ? env : TBOOST_SHARED_DEFAULT;
}

bool IsDir(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool IsFile(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string Golden(const std::string& name) { return SharedDir() + "/testdata/golden/" + name; }

// Fails the whole run, with how to fix it, when the shared test data is missing.
class SharedData : public ::testing::Environment {
 public:
  void SetUp() override {
    ASSERT_TRUE(IsDir(Golden("llama_gqa")))
        << "shared test data not found at " << SharedDir()
        << ": check out `shared` next to the repository or set TBOOST_SHARED";
  }
};
const auto* const kSharedData = ::testing::AddGlobalTestEnvironment(new SharedData);

std::string LastError() {
  size_t need = 0;
  tboost_last_error(nullptr, 0, &need);
  std::string msg(need, '\0');
  EXPECT_EQ(tboost_last_error(msg.data(), msg.size(), nullptr), TBOOST_OK);
  if (!msg.empty()) msg.pop_back();
  return msg;
}

std::string Name(int32_t s) { return tboost_status_name(s); }

#define EXPECT_STATUS(want, call)                                                                \
  do {                                                                                           \
    const tboost_status got_ = (call);                                                           \
    EXPECT_EQ(Name(got_), Name(want)) << #call << ": " << (got_ != TBOOST_OK ? LastError() : ""); \
  } while (0)
#define ASSERT_OK(call)                                                           \
  do {                                                                            \
    const tboost_status got_ = (call);                                            \
    ASSERT_EQ(Name(got_), "TBOOST_OK") << #call << ": " << LastError();           \
  } while (0)
#define ASSERT_STATUS(want, call)                                                 \
  do {                                                                            \
    const tboost_status got_ = (call);                                            \
    ASSERT_EQ(Name(got_), Name(want)) << #call << ": " << LastError();            \
  } while (0)

// ---- RAII handles -----------------------------------------------------------------------

struct Config {
  tboost_config* p = nullptr;
  Config() { EXPECT_EQ(tboost_config_new(&p), TBOOST_OK); }
  Config(std::initializer_list<std::pair<const char*, const char*>> kv) : Config() {
    for (auto& [k, v] : kv) EXPECT_STATUS(TBOOST_OK, tboost_config_set_str(p, k, v));
  }
  ~Config() { tboost_config_free(p); }
  Config(const Config&) = delete;
  Config& operator=(const Config&) = delete;
};

struct Model {
  tboost_model* p = nullptr;
  explicit Model(const std::string& path, const tboost_config* cfg = nullptr) {
    EXPECT_STATUS(TBOOST_OK, tboost_model_load(path.c_str(), cfg, nullptr, nullptr, &p));
  }
  ~Model() { tboost_model_free(p); }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
};

struct Engine {
  tboost_engine* p = nullptr;
  Engine(const tboost_model* m, const tboost_config* cfg) { EXPECT_STATUS(TBOOST_OK, tboost_engine_new(m, cfg, &p)); }
  ~Engine() { tboost_engine_free(p); }
  tboost_engine* release() { return std::exchange(p, nullptr); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
};

// Small engines: the machine is shared and the golden models are tiny.
Config* SmallConfig() {
  return new Config{{"threads", "1"}, {"kv_cache_blocks", "128"}, {"max_seqs", "16"}, {"max_batched_tokens", "128"}};
}

tboost_sampling_params Params(uint32_t max_tokens, float temperature = 0.0f, uint64_t seed = 0) {
  tboost_sampling_params sp;
  tboost_sampling_params_init(&sp);
  sp.max_tokens = max_tokens;
  sp.temperature = temperature;
  sp.seed = seed;
  sp.ignore_eos = 1;
  return sp;
}

Tokens Prompt(int k, int len, int vocab = 500) {
  Tokens p;
  for (int j = 0; j < len; ++j) p.push_back(3 + (k * 37 + j * 11) % (vocab - 3));
  return p;
}

tboost_request_id Enqueue(tboost_engine* e, const Tokens& prompt, const tboost_sampling_params& sp,
                          const std::vector<Tokens>& stops = {}) {
  Tokens flat;
  std::vector<size_t> lens;
  for (auto& s : stops) {
    flat.insert(flat.end(), s.begin(), s.end());
    lens.push_back(s.size());
  }
  tboost_request_id id = 0;
  EXPECT_STATUS(TBOOST_OK, tboost_engine_enqueue(e, prompt.data(), prompt.size(), &sp, flat.data(), lens.data(),
                                                 lens.size(), &id));
  return id;
}

void RunToCompletion(tboost_engine* e) {
  for (int i = 0; i < 100000; ++i) {
    bool work = false;
    ASSERT_OK(tboost_engine_has_work(e, &work));
    if (!work) return;
    ASSERT_OK(tboost_engine_step(e, nullptr));
  }
  FAIL() << "the engine did not finish within 100000 steps";
}

std::vector<tboost_event> ReadAll(tboost_engine* e, tboost_request_id id) {
  std::vector<tboost_event> out;
  tboost_event buf[7];
  for (;;) {
    size_t n = 0;
    EXPECT_STATUS(TBOOST_OK, tboost_engine_read(e, id, buf, sizeof(tboost_event), 7, &n));
    out.insert(out.end(), buf, buf + n);
    if (n < 7) return out;
  }
}

Tokens TokensOf(const std::vector<tboost_event>& evs) {
  Tokens t;
  for (auto& e : evs)
    if (e.token >= 0) t.push_back(e.token);
  return t;
}

// One request's stream is: tokens with index 0, 1, ..., then exactly one final event.
void ExpectWellFormed(const std::vector<tboost_event>& evs, tboost_request_id id) {
  ASSERT_FALSE(evs.empty());
  uint32_t next = 0;
  for (size_t i = 0; i < evs.size(); ++i) {
    EXPECT_EQ(evs[i].request_id, id);
    EXPECT_EQ(evs[i].struct_size, sizeof(tboost_event));
    EXPECT_EQ(evs[i].index, next) << "event " << i;
    if (evs[i].token >= 0) ++next;
    EXPECT_EQ(evs[i].finish != TBOOST_FINISH_NONE, i + 1 == evs.size()) << "event " << i;
  }
}

std::string ModelInfo(const tboost_model* m) {
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_info_json(m, nullptr, 0, &need));
  std::string s(need, '\0');
  EXPECT_STATUS(TBOOST_OK, tboost_model_info_json(m, s.data(), s.size(), &need));
  s.resize(need - 1);
  return s;
}

std::string PlanJson(const tboost_engine* e) {
  size_t need = 0;
  tboost_engine_plan_json(e, nullptr, 0, &need);
  std::string s(need, '\0');
  EXPECT_STATUS(TBOOST_OK, tboost_engine_plan_json(e, s.data(), s.size(), &need));
  s.resize(need - 1);
  return s;
}

std::string TempDir() {
  char tmpl[] = "/tmp/tboost-gtest-XXXXXX";
  const char* d = mkdtemp(tmpl);
  EXPECT_NE(d, nullptr);
  return d != nullptr ? d : "/tmp";
}

std::string ReadFile(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& p, const std::string& data) {
  std::ofstream f(p, std::ios::binary);
  f << data;
}

// ---- version, names, last error -------------------------------------------------------

TEST(Version, LibraryMatchesHeader) {
  EXPECT_EQ(tboost_abi_version(), static_cast<uint32_t>(TBOOST_ABI_VERSION));
  EXPECT_STREQ(tboost_version(), TBOOST_VERSION_STRING);
  const std::string v = std::to_string(TBOOST_VERSION_MAJOR) + "." + std::to_string(TBOOST_VERSION_MINOR) + "." +
                        std::to_string(TBOOST_VERSION_PATCH);
  EXPECT_EQ(v, TBOOST_VERSION_STRING);
}

TEST(Names, StatusNamesAreStableAndDistinct) {
  EXPECT_EQ(Name(TBOOST_OK), "TBOOST_OK");
  EXPECT_EQ(Name(TBOOST_ERR_BUSY), "TBOOST_ERR_BUSY");
  EXPECT_EQ(TBOOST_ERR_INTERNAL, 18);
  EXPECT_EQ(TBOOST_ERR_REENTRANT, 19);  // the last status: appended after INTERNAL
  std::vector<std::string> names;
  for (int s = 0; s <= TBOOST_ERR_REENTRANT; ++s) names.push_back(Name(s));
  for (auto& n : names) EXPECT_EQ(n.rfind("TBOOST_", 0), 0u) << n;
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
  EXPECT_EQ(Name(-1), "TBOOST_UNKNOWN_STATUS");
  EXPECT_EQ(Name(TBOOST_ERR_REENTRANT + 1), "TBOOST_UNKNOWN_STATUS");
}

TEST(Names, FinishReasonNames) {
  EXPECT_STREQ(tboost_finish_reason_name(TBOOST_FINISH_NONE), "none");
  EXPECT_STREQ(tboost_finish_reason_name(TBOOST_FINISH_LENGTH), "length");
  EXPECT_STREQ(tboost_finish_reason_name(TBOOST_FINISH_EOS), "eos");
  EXPECT_STREQ(tboost_finish_reason_name(TBOOST_FINISH_STOP_SEQUENCE), "stop_sequence");
  EXPECT_STREQ(tboost_finish_reason_name(TBOOST_FINISH_CANCELLED), "cancelled");
  EXPECT_STREQ(tboost_finish_reason_name(TBOOST_FINISH_ERROR), "error");
  EXPECT_STREQ(tboost_finish_reason_name(99), "unknown");
}

TEST(LastError, PerThreadCopiedIntoCallerBuffers) {
  std::thread([] { EXPECT_EQ(LastError(), ""); }).join();
  Config cfg;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "max_seqs", -3));
  const std::string msg = LastError();
  EXPECT_NE(msg.find("tboost_config_set_int"), std::string::npos) << msg;
  EXPECT_NE(msg.find("max_seqs"), std::string::npos) << msg;
  std::thread([] { EXPECT_EQ(LastError(), "") << "another thread's failure leaked here"; }).join();
  // Success does not clear it.
  EXPECT_STATUS(TBOOST_OK, tboost_config_set_int(cfg.p, "max_seqs", 3));
  EXPECT_EQ(LastError(), msg);
  // Size query, exact buffer, truncated buffer, NULL buffer with a capacity.
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_last_error(nullptr, 0, &need));
  EXPECT_EQ(need, msg.size() + 1);
  std::vector<char> exact(need, 'x');
  EXPECT_STATUS(TBOOST_OK, tboost_last_error(exact.data(), exact.size(), nullptr));
  EXPECT_EQ(std::string(exact.data()), msg);
  char small[8];
  std::memset(small, 'x', sizeof small);
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_last_error(small, sizeof small, &need));
  EXPECT_EQ(std::string(small), msg.substr(0, 7));
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, tboost_last_error(nullptr, 16, nullptr));
  EXPECT_EQ(LastError(), msg) << "tboost_last_error must not overwrite the message it reports";
}

// ---- logging ------------------------------------------------------------------------------

struct LogRecord {
  int level;
  std::string target, message;
};
std::mutex g_log_mu;
std::vector<LogRecord> g_logs;

void CollectLog(tboost_log_level level, const char* target, const char* message, void* user_data) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  ++*static_cast<int*>(user_data);
  g_logs.push_back({static_cast<int>(level), target, message});
}

TEST(Log, CallbackGetsLevelTargetAndMessage) {
  int calls = 0;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_log_set(CollectLog, &calls, 9));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_log_set(CollectLog, &calls, -1));
  ASSERT_OK(tboost_log_set(CollectLog, &calls, TBOOST_LOG_INFO));
  {
    // The plan is built (and logged) when it is first needed: here, the model info.
    Model m(Golden("llama_gqa"));
    size_t need = 0;
    EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_info_json(m.p, nullptr, 0, &need));
  }
  std::vector<LogRecord> logs;
  {
    std::lock_guard<std::mutex> lock(g_log_mu);
    logs.swap(g_logs);
  }
  EXPECT_EQ(calls, static_cast<int>(logs.size()));
  const bool plan_line = std::any_of(logs.begin(), logs.end(), [](const LogRecord& r) {
    return r.level == TBOOST_LOG_INFO && r.target == "tboost::plan" && r.message.find("attention") != std::string::npos;
  });
  EXPECT_TRUE(plan_line) << "no INFO plan line from tboost::plan among " << logs.size() << " records";
  // Warnings only: the plan's INFO lines are filtered out.
  ASSERT_OK(tboost_log_set(CollectLog, &calls, TBOOST_LOG_WARN));
  {
    Model m(Golden("llama_gqa"));
    size_t need = 0;
    EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_info_json(m.p, nullptr, 0, &need));
  }
  {
    std::lock_guard<std::mutex> lock(g_log_mu);
    for (auto& r : g_logs) EXPECT_LE(r.level, TBOOST_LOG_WARN) << r.message;
    g_logs.clear();
  }
  // Back to stderr: the callback is never called again.
  ASSERT_OK(tboost_log_set(nullptr, nullptr, TBOOST_LOG_WARN));
  const int before = calls;
  ASSERT_OK(tboost_log_set(nullptr, nullptr, TBOOST_LOG_OFF));
  {
    Model m(Golden("llama_gqa"));
  }
  EXPECT_EQ(calls, before);
  ASSERT_OK(tboost_log_set(nullptr, nullptr, TBOOST_LOG_WARN));
}

// A callback that calls back into tboost: the log sink (whose lock the logging thread holds)
// and the engine (whose lock enqueue holds while it warns). Each inner call is refused with
// TBOOST_ERR_REENTRANT; the outer call completes.
struct Reentry {
  std::thread::id thread;
  tboost_engine* engine = nullptr;
  std::vector<std::pair<int, int>> statuses;
  std::vector<std::string> errors;
};

void ReenterLog(tboost_log_level, const char*, const char*, void* user_data) {
  auto* r = static_cast<Reentry*>(user_data);
  if (std::this_thread::get_id() != r->thread) return;
  const int set = tboost_log_set(nullptr, nullptr, TBOOST_LOG_WARN);
  tboost_stats st{};
  st.struct_size = sizeof st;
  const int stats = tboost_engine_stats(r->engine, &st);
  r->statuses.push_back({set, stats});
  r->errors.push_back(LastError());
}

TEST(Log, CallsFromTheCallbackAreRefusedNotDeadlocked) {
  std::unique_ptr<Config> cfg(SmallConfig());
  Model m(Golden("llama_gqa"), cfg->p);
  Engine e(m.p, cfg->p);
  Reentry r;
  int enqueued = -1;
  tboost_request_id id = 0;
  // A hard limit: a deadlocked call never returns, and the test fails (and exits) here.
  std::atomic<bool> done{false};
  std::thread worker([&] {
    r.thread = std::this_thread::get_id();
    r.engine = e.p;
    if (tboost_log_set(ReenterLog, &r, TBOOST_LOG_WARN) == TBOOST_OK) {
      // 600 new tokens go beyond llama_gqa's 512 trained positions: enqueue warns.
      tboost_sampling_params sp = Params(600);
      Tokens prompt = Prompt(0, 3);
      enqueued = tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &id);
    }
    tboost_log_set(nullptr, nullptr, TBOOST_LOG_WARN);
    done = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!done) {
    ADD_FAILURE() << "a tboost call from a log callback did not return in 60 s (deadlock)";
    std::fflush(nullptr);
    std::_Exit(1);
  }
  worker.join();
  EXPECT_EQ(enqueued, TBOOST_OK) << "the outer enqueue must complete";
  ASSERT_FALSE(r.statuses.empty()) << "enqueue's warning never reached the callback";
  for (size_t i = 0; i < r.statuses.size(); ++i) {
    EXPECT_EQ(r.statuses[i].first, TBOOST_ERR_REENTRANT);
    EXPECT_EQ(r.statuses[i].second, TBOOST_ERR_REENTRANT);
    EXPECT_EQ(r.errors[i].rfind("tboost_engine_stats: called from a tboost log callback (fired inside "
                                "tboost_engine_enqueue)",
                                0),
              0u)
        << r.errors[i];
  }
  // The engine keeps working after the refused calls.
  EXPECT_STATUS(TBOOST_OK, tboost_engine_cancel(e.p, id));
  EXPECT_STREQ(tboost_status_name(TBOOST_ERR_REENTRANT), "TBOOST_ERR_REENTRANT");
}

// ---- config ------------------------------------------------------------------------------

TEST(Config, KeysSetAndShowInJson) {
  Config cfg;
  ASSERT_OK(tboost_config_set_int(cfg.p, "threads", 3));
  ASSERT_OK(tboost_config_set_int(cfg.p, "kv_cache_bytes", 1 << 20));
  ASSERT_OK(tboost_config_set_int(cfg.p, "block_size", 32));
  ASSERT_OK(tboost_config_set_int(cfg.p, "max_seqs", 8));
  ASSERT_OK(tboost_config_set_int(cfg.p, "max_batched_tokens", 256));
  ASSERT_OK(tboost_config_set_int(cfg.p, "prefix_caching", 0));
  ASSERT_OK(tboost_config_set_str(cfg.p, "queue_limit", "77"));
  ASSERT_OK(tboost_config_set_str(cfg.p, "backend", "cpu"));
  ASSERT_OK(tboost_config_set_str(cfg.p, "kv_dtype", "bf16"));
  ASSERT_OK(tboost_config_set_str(cfg.p, "disabled_ops", "flash_attention,fuse_qkv"));
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_config_to_json(cfg.p, nullptr, 0, &need));
  std::string json(need, '\0');
  ASSERT_OK(tboost_config_to_json(cfg.p, json.data(), json.size(), &need));
  for (const char* part : {"\"threads\":3", "\"kv_cache_bytes\":1048576", "\"kv_cache_blocks\":null",
                           "\"block_size\":32", "\"max_seqs\":8", "\"max_batched_tokens\":256",
                           "\"prefix_caching\":false", "\"queue_limit\":77", "\"backend\":\"cpu\"",
                           "\"kv_dtype\":\"bf16\"", "\"disabled_ops\":\"flash_attention,fuse_qkv\""})
    EXPECT_NE(json.find(part), std::string::npos) << part << " not in " << json;
  ASSERT_OK(tboost_config_set_int(cfg.p, "kv_cache_blocks", 12));
  ASSERT_OK(tboost_config_to_json(cfg.p, json.data(), json.size(), &need));
  EXPECT_NE(json.find("\"kv_cache_blocks\":12"), std::string::npos) << json;
}

TEST(Config, BadKeysAndValuesNameTheKeyAndChangeNothing) {
  Config cfg;
  size_t need = 0;
  tboost_config_to_json(cfg.p, nullptr, 0, &need);
  std::string before(need, '\0');
  ASSERT_OK(tboost_config_to_json(cfg.p, before.data(), before.size(), nullptr));
  struct Case {
    const char* key;
    const char* value;
    tboost_status want;
    const char* text;
  };
  for (const Case& c : std::vector<Case>{
           {"no_such_key", "1", TBOOST_ERR_INVALID_ARGUMENT, "unknown config key `no_such_key`"},
           {"threads", "two", TBOOST_ERR_INVALID_ARGUMENT, "`threads` = `two` is not an integer"},
           {"threads", "-1", TBOOST_ERR_INVALID_ARGUMENT, "out of range"},
           {"block_size", "4096", TBOOST_ERR_INVALID_ARGUMENT, "out of range"},
           {"prefix_caching", "perhaps", TBOOST_ERR_INVALID_ARGUMENT, "flag"},
           {"kv_dtype", "int4", TBOOST_ERR_INVALID_ARGUMENT, "`kv_dtype` = `int4`"},
           {"disabled_ops", "flash_attention,teleport", TBOOST_ERR_INVALID_ARGUMENT, "teleport"},
           {"backend", "nosuch", TBOOST_ERR_INVALID_ARGUMENT, "unknown backend `nosuch`"},
       }) {
    EXPECT_STATUS(c.want, tboost_config_set_str(cfg.p, c.key, c.value));
    EXPECT_NE(LastError().find(c.text), std::string::npos) << LastError();
  }
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "backend", 1));
  EXPECT_NE(LastError().find("takes a string"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "prefix_caching", 2));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "max_seqs", 0));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_str(cfg.p, "threads", "\xff"));
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, tboost_config_set_int(cfg.p, nullptr, 1));
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, tboost_config_set_str(cfg.p, "threads", nullptr));
  EXPECT_NE(LastError().find("`value` is NULL"), std::string::npos) << LastError();
  std::string after(before.size(), '\0');
  ASSERT_OK(tboost_config_to_json(cfg.p, after.data(), after.size(), nullptr));
  EXPECT_EQ(after, before);
  char tiny[4];
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_config_to_json(cfg.p, tiny, sizeof tiny, &need));
  EXPECT_EQ(std::string(tiny), before.substr(0, 3));
  EXPECT_EQ(need, before.size());
}

TEST(Config, EngineChecksCrossKeyRules) {
  Model m(Golden("llama_gqa"));
  Config cfg{{"max_seqs", "64"}, {"max_batched_tokens", "32"}};
  tboost_engine* e = nullptr;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_new(m.p, cfg.p, &e));
  EXPECT_NE(LastError().find("max_batched_tokens"), std::string::npos) << LastError();
  EXPECT_EQ(e, nullptr);
  Config tiny{{"kv_cache_bytes", "1"}};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_new(m.p, tiny.p, &e));
  EXPECT_NE(LastError().find("kv_cache"), std::string::npos) << LastError();
}

// ---- handles and NULL pointers -------------------------------------------------------------

TEST(Handles, FreedForeignAndBogusHandlesAreRejected) {
  EXPECT_STATUS(TBOOST_OK, tboost_config_free(nullptr));
  EXPECT_STATUS(TBOOST_OK, tboost_model_free(nullptr));
  EXPECT_STATUS(TBOOST_OK, tboost_engine_free(nullptr));

  tboost_config* cfg = nullptr;
  ASSERT_OK(tboost_config_new(&cfg));
  ASSERT_OK(tboost_config_free(cfg));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_config_free(cfg));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_config_set_int(cfg, "threads", 1));
  EXPECT_NE(LastError().find("tboost_config"), std::string::npos) << LastError();

  tboost_model* m = nullptr;
  ASSERT_OK(tboost_model_load(Golden("llama_gqa").c_str(), nullptr, nullptr, nullptr, &m));
  tboost_engine* e = nullptr;
  ASSERT_OK(tboost_engine_new(m, nullptr, &e));
  // A handle of one kind passed as another.
  auto* m_as_e = reinterpret_cast<tboost_engine*>(m);
  auto* e_as_m = reinterpret_cast<tboost_model*>(e);
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_step(m_as_e, nullptr));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_model_info_json(e_as_m, nullptr, 0, nullptr));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_free(m_as_e));
  // A pointer tboost never returned is never dereferenced.
  auto* bogus = reinterpret_cast<tboost_engine*>(uintptr_t{0x1000});
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_cancel(bogus, 1));
  // Freed handles.
  ASSERT_OK(tboost_model_free(m));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_model_free(m));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_model_info_json(m, nullptr, 0, nullptr));
  tboost_engine* e2 = nullptr;
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_new(m, nullptr, &e2));
  ASSERT_OK(tboost_engine_step(e, nullptr));  // the engine outlives its model
  ASSERT_OK(tboost_engine_free(e));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_free(e));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_step(e, nullptr));
  bool work = false;
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_has_work(e, &work));
}

TEST(NullPointers, EveryRequiredPointerIsChecked) {
  Model m(Golden("llama_gqa"));
  Engine e(m.p, nullptr);
  const Tokens prompt{5, 6, 7};
  tboost_sampling_params sp = Params(2);
  tboost_request_id id = 0;
  size_t n = 0;
  bool work = false;
  tboost_event ev[2];
  tboost_stats st{};
  st.struct_size = sizeof st;
  tboost_sampling_params_init(nullptr);  // ignored, no crash
  std::vector<std::pair<std::string, tboost_status>> calls = {
      {"config_new", tboost_config_new(nullptr)},
      {"config_set_int", tboost_config_set_int(nullptr, "threads", 1)},
      {"config_set_str", tboost_config_set_str(nullptr, "threads", "1")},
      {"config_to_json", tboost_config_to_json(nullptr, nullptr, 0, nullptr)},
      {"model_load path", tboost_model_load(nullptr, nullptr, nullptr, nullptr, &m.p)},
      {"model_load out", tboost_model_load(Golden("llama_gqa").c_str(), nullptr, nullptr, nullptr, nullptr)},
      {"model_info_json", tboost_model_info_json(nullptr, nullptr, 0, nullptr)},
      {"engine_new model", tboost_engine_new(nullptr, nullptr, &e.p)},
      {"engine_new out", tboost_engine_new(m.p, nullptr, nullptr)},
      {"enqueue engine", tboost_engine_enqueue(nullptr, prompt.data(), 3, &sp, nullptr, nullptr, 0, &id)},
      {"enqueue prompt", tboost_engine_enqueue(e.p, nullptr, 3, &sp, nullptr, nullptr, 0, &id)},
      {"enqueue id_out", tboost_engine_enqueue(e.p, prompt.data(), 3, &sp, nullptr, nullptr, 0, nullptr)},
      {"enqueue stop_lens", tboost_engine_enqueue(e.p, prompt.data(), 3, &sp, prompt.data(), nullptr, 1, &id)},
      {"cancel", tboost_engine_cancel(nullptr, 1)},
      {"step", tboost_engine_step(nullptr, &n)},
      {"has_work engine", tboost_engine_has_work(nullptr, &work)},
      {"has_work out", tboost_engine_has_work(e.p, nullptr)},
      {"rank", tboost_engine_rank(nullptr, nullptr, nullptr)},
      {"read engine", tboost_engine_read(nullptr, 0, ev, sizeof(tboost_event), 2, &n)},
      {"read events", tboost_engine_read(e.p, 0, nullptr, sizeof(tboost_event), 2, &n)},
      {"read n_out", tboost_engine_read(e.p, 0, ev, sizeof(tboost_event), 2, nullptr)},
      {"wait", tboost_engine_wait(nullptr, 0, 0, &n)},
      {"output", tboost_engine_output(nullptr, 1, nullptr, 0, &n, nullptr)},
      {"request_error", tboost_engine_request_error(nullptr, 1, nullptr, 0, &n)},
      {"stats engine", tboost_engine_stats(nullptr, &st)},
      {"stats out", tboost_engine_stats(e.p, nullptr)},
      {"plan_json", tboost_engine_plan_json(nullptr, nullptr, 0, &n)},
      {"tokenize engine", tboost_engine_tokenize(nullptr, "a", 1, false, nullptr, 0, &n)},
      {"tokenize text", tboost_engine_tokenize(e.p, nullptr, 3, false, nullptr, 0, &n)},
      {"tokenize n_out", tboost_engine_tokenize(e.p, "a", 1, false, nullptr, 0, nullptr)},
      {"detokenize engine", tboost_engine_detokenize(nullptr, prompt.data(), 3, nullptr, 0, &n)},
      {"detokenize tokens", tboost_engine_detokenize(e.p, nullptr, 3, nullptr, 0, &n)},
      {"prompt_logprobs engine", tboost_engine_prompt_logprobs(nullptr, 1, nullptr, 0, &n)},
      {"prompt_logprobs n_out", tboost_engine_prompt_logprobs(e.p, 1, nullptr, 0, nullptr)},
      {"chat_apply model", tboost_model_chat_apply(nullptr, "[]", true, nullptr, 0, &n)},
      {"chat_apply messages_json", tboost_model_chat_apply(m.p, nullptr, true, nullptr, 0, &n)},
      {"chat_stops", tboost_model_chat_stops(nullptr, nullptr, 0, &n)},
      {"chat_tokens model", tboost_model_chat_tokens(nullptr, "[]", true, nullptr, 0, &n)},
      {"chat_tokens messages_json", tboost_model_chat_tokens(m.p, nullptr, true, nullptr, 0, &n)},
      {"chat_tokens n_out", tboost_model_chat_tokens(m.p, "[]", true, nullptr, 0, nullptr)},
  };
  for (auto& [what, status] : calls) EXPECT_EQ(Name(status), "TBOOST_ERR_NULL_POINTER") << what;
  // A NULL buffer with a nonzero capacity.
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, tboost_engine_plan_json(e.p, nullptr, 10, &n));
  EXPECT_NE(LastError().find("`buf` is NULL"), std::string::npos) << LastError();
}

// ---- model load ----------------------------------------------------------------------------

TEST(ModelLoad, ProgressRisesToOneAndCanCancel) {
  std::vector<float> seen;
  auto record = [](float p, void* ud) -> bool {
    static_cast<std::vector<float>*>(ud)->push_back(p);
    return true;
  };
  tboost_model* m = nullptr;
  ASSERT_OK(tboost_model_load(Golden("llama_gqa").c_str(), nullptr, record, &seen, &m));
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front(), 0.0f);
  EXPECT_EQ(seen.back(), 1.0f);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  ASSERT_OK(tboost_model_free(m));

  auto stop_midway = [](float p, void*) -> bool { return p < 0.5f; };
  m = nullptr;
  EXPECT_STATUS(TBOOST_ERR_CANCELLED, tboost_model_load(Golden("llama_gqa").c_str(), nullptr, stop_midway, nullptr, &m));
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(LastError().find("cancelled by the progress callback"), std::string::npos) << LastError();
}

TEST(ModelLoad, MissingTruncatedAndCorruptFilesNameTheFile) {
  tboost_model* m = nullptr;
  const std::string missing = "/nonexistent/tboost/model-dir";
  EXPECT_STATUS(TBOOST_ERR_IO, tboost_model_load(missing.c_str(), nullptr, nullptr, nullptr, &m));
  EXPECT_NE(LastError().find(missing), std::string::npos) << LastError();

  // A Hugging Face directory whose safetensors file is cut in half.
  const std::string dir = TempDir();
  const std::string cfg_json = ReadFile(Golden("llama_gqa") + "/config.json");
  const std::string weights = ReadFile(Golden("llama_gqa") + "/model.safetensors");
  ASSERT_GT(weights.size(), 1000u);
  WriteFile(dir + "/config.json", cfg_json);
  WriteFile(dir + "/model.safetensors", weights.substr(0, weights.size() / 2));
  EXPECT_STATUS(TBOOST_ERR_MODEL_FORMAT, tboost_model_load(dir.c_str(), nullptr, nullptr, nullptr, &m));
  EXPECT_NE(LastError().find(dir + "/model.safetensors"), std::string::npos) << LastError();

  // A safetensors header that claims more bytes than the file has.
  std::string corrupt = weights;
  for (int i = 0; i < 8; ++i) corrupt[i] = static_cast<char>(0x7f);
  WriteFile(dir + "/model.safetensors", corrupt);
  EXPECT_STATUS(TBOOST_ERR_MODEL_FORMAT, tboost_model_load(dir.c_str(), nullptr, nullptr, nullptr, &m));
  EXPECT_NE(LastError().find(dir + "/model.safetensors"), std::string::npos) << LastError();

  // config.json that is not JSON.
  WriteFile(dir + "/model.safetensors", weights);
  WriteFile(dir + "/config.json", "{ not json");
  EXPECT_STATUS(TBOOST_ERR_MODEL_FORMAT, tboost_model_load(dir.c_str(), nullptr, nullptr, nullptr, &m));
  EXPECT_NE(LastError().find(dir + "/config.json"), std::string::npos) << LastError();

  // A GGUF file cut short.
  const std::string gguf = SharedDir() + "/models/llama-2-tiny-random.gguf";
  ASSERT_TRUE(IsFile(gguf)) << gguf << " is missing: it ships in ../shared/models";
  const std::string cut = dir + "/cut.gguf";
  WriteFile(cut, ReadFile(gguf).substr(0, 4096));
  EXPECT_STATUS(TBOOST_ERR_MODEL_FORMAT, tboost_model_load(cut.c_str(), nullptr, nullptr, nullptr, &m));
  EXPECT_NE(LastError().find(cut), std::string::npos) << LastError();
  EXPECT_EQ(m, nullptr);

  for (const char* f : {"/config.json", "/model.safetensors", "/cut.gguf"}) std::remove((dir + f).c_str());
  rmdir(dir.c_str());
}

TEST(ModelLoad, InfoJsonDescribesModelAndPlan) {
  Model m(Golden("llama_gqa"));
  const std::string info = ModelInfo(m.p);
  for (const char* part : {"\"architecture\":\"llama\"", "\"vocab_size\":640", "\"context_length\":512",
                           "\"eos_token_ids\":[2]", "\"bos_token_id\":1", "\"num_layers\":2", "\"head_dim\":16",
                           "\"format\":\"huggingface\"", "\"plan\":{", "\"flash_attention\""})
    EXPECT_NE(info.find(part), std::string::npos) << part << " not in " << info;
  // head_dim 24 cannot use FlashAttention: the plan says so.
  Model hd24(Golden("llama_hd24"));
  const std::string info24 = ModelInfo(hd24.p);
  EXPECT_NE(info24.find("\"standard_attention\""), std::string::npos) << info24;
  EXPECT_NE(info24.find("\"fallback\":true"), std::string::npos) << info24;
  // The config's disabled ops shape the model's plan.
  Config cfg{{"disabled_ops", "fuse_gate_up"}};
  Model m2(Golden("llama_gqa"), cfg.p);
  EXPECT_NE(ModelInfo(m2.p).find("fuse_gate_up disabled by the user"), std::string::npos);
  char small[10];
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_info_json(m.p, small, sizeof small, &need));
  EXPECT_EQ(need, info.size() + 1);
  EXPECT_EQ(std::string(small), info.substr(0, 9));
}

// ---- engine: requests and events -------------------------------------------------------------

TEST(Engine, SamplingParamsInitSetsDefaults) {
  tboost_sampling_params sp;
  std::memset(&sp, 0xab, sizeof sp);
  tboost_sampling_params_init(&sp);
  EXPECT_EQ(sp.struct_size, sizeof sp);
  EXPECT_EQ(sp.max_tokens, 16u);
  EXPECT_EQ(sp.temperature, 0.0f);
  EXPECT_EQ(sp.top_k, 0);
  EXPECT_EQ(sp.top_p, 1.0f);
  EXPECT_EQ(sp.min_p, 0.0f);
  EXPECT_EQ(sp.repetition_penalty, 1.0f);
  EXPECT_EQ(sp.presence_penalty, 0.0f);
  EXPECT_EQ(sp.frequency_penalty, 0.0f);
  EXPECT_EQ(sp.logprobs, -1);
  EXPECT_EQ(sp.priority, 0);
  EXPECT_EQ(sp.ignore_eos, 0u);
  EXPECT_EQ(sp.seed, 0u);
  EXPECT_EQ(sp.user_tag, 0u);
}

TEST(Engine, EnqueueRejectsBadRequestsByName) {
  Model m(Golden("llama_gqa"));
  Config cfg{{"threads", "1"}, {"kv_cache_blocks", "8"}, {"queue_limit", "3"}};
  Engine e(m.p, cfg.p);
  const Tokens ok{5, 6, 7};
  const size_t one = 1;
  tboost_request_id id = 0;
  auto enqueue = [&](const Tokens& p, const tboost_sampling_params& sp, const Tokens& stop_tokens = {},
                     const std::vector<size_t>& stop_lens = {}) {
    return tboost_engine_enqueue(e.p, p.data(), p.size(), &sp, stop_tokens.data(), stop_lens.data(),
                                 stop_lens.size(), &id);
  };
  auto with = [](std::function<void(tboost_sampling_params&)> f) {
    tboost_sampling_params sp = Params(4);
    f(sp);
    return sp;
  };
  struct Case {
    std::string what;
    std::function<tboost_status()> call;
    tboost_status want;
    std::string text;  // the message names the parameter
  };
  const std::vector<Case> cases = {
      {"empty prompt", [&] { return enqueue({}, Params(4)); }, TBOOST_ERR_INVALID_ARGUMENT, "`prompt`"},
      {"negative token", [&] { return enqueue({5, -2}, Params(4)); }, TBOOST_ERR_INVALID_ARGUMENT,
       "`prompt[1]` = -2 is negative"},
      {"token >= vocab", [&] { return enqueue({5, 640}, Params(4)); }, TBOOST_ERR_INVALID_ARGUMENT,
       "vocabulary size 640"},
      {"max_tokens 0", [&] { return enqueue(ok, Params(0)); }, TBOOST_ERR_INVALID_ARGUMENT, "max_tokens"},
      {"temperature", [&] { return enqueue(ok, with([](auto& p) { p.temperature = -1; })); },
       TBOOST_ERR_INVALID_ARGUMENT, "temperature"},
      {"temperature nan", [&] { return enqueue(ok, with([](auto& p) { p.temperature = NAN; })); },
       TBOOST_ERR_INVALID_ARGUMENT, "temperature"},
      {"top_k", [&] { return enqueue(ok, with([](auto& p) { p.top_k = -1; })); }, TBOOST_ERR_INVALID_ARGUMENT,
       "top_k"},
      {"top_p", [&] { return enqueue(ok, with([](auto& p) { p.top_p = 0; })); }, TBOOST_ERR_INVALID_ARGUMENT,
       "top_p"},
      {"min_p", [&] { return enqueue(ok, with([](auto& p) { p.min_p = 2; })); }, TBOOST_ERR_INVALID_ARGUMENT,
       "min_p"},
      {"repetition", [&] { return enqueue(ok, with([](auto& p) { p.repetition_penalty = 0; })); },
       TBOOST_ERR_INVALID_ARGUMENT, "repetition_penalty"},
      {"presence", [&] { return enqueue(ok, with([](auto& p) { p.presence_penalty = 3; })); },
       TBOOST_ERR_INVALID_ARGUMENT, "presence_penalty"},
      {"frequency", [&] { return enqueue(ok, with([](auto& p) { p.frequency_penalty = -3; })); },
       TBOOST_ERR_INVALID_ARGUMENT, "frequency_penalty"},
      {"logprobs", [&] { return enqueue(ok, with([](auto& p) { p.logprobs = -2; })); }, TBOOST_ERR_INVALID_ARGUMENT,
       "logprobs"},
      {"struct_size", [&] { return enqueue(ok, with([](auto& p) { p.struct_size = 8; })); },
       TBOOST_ERR_INVALID_ARGUMENT, "struct_size"},
      {"empty stop", [&] { return enqueue(ok, Params(4), {}, {0}); }, TBOOST_ERR_INVALID_ARGUMENT, "stop_lens[0]"},
      {"negative stop", [&] { return enqueue(ok, Params(4), {4, -9}, {2}); }, TBOOST_ERR_INVALID_ARGUMENT,
       "`stop_tokens[1]` = -9"},
      {"stop tokens NULL", [&] { return tboost_engine_enqueue(e.p, ok.data(), 3, nullptr, nullptr, &one, 1, &id); },
       TBOOST_ERR_NULL_POINTER, "`stop_tokens` is NULL"},
      {"kv capacity", [&] { return enqueue(ok, Params(200)); }, TBOOST_ERR_KV_CAPACITY, "whole KV cache has 8"},
  };
  for (auto& c : cases) {
    EXPECT_STATUS(c.want, c.call());
    EXPECT_NE(LastError().find(c.text), std::string::npos) << c.what << ": " << LastError();
  }
  // NULL params means the defaults.
  ASSERT_OK(tboost_engine_enqueue(e.p, ok.data(), ok.size(), nullptr, nullptr, nullptr, 0, &id));
  ASSERT_OK(enqueue(ok, Params(4)));
  ASSERT_OK(enqueue(ok, Params(4)));
  EXPECT_STATUS(TBOOST_ERR_QUEUE_FULL, enqueue(ok, Params(4)));
  EXPECT_NE(LastError().find("queue is full"), std::string::npos) << LastError();
  RunToCompletion(e.p);
  ASSERT_OK(enqueue(ok, Params(4)));  // room again
}

TEST(Engine, StreamsTokensWithTagsIndexesAndLogprobs) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  tboost_sampling_params sp = Params(7, 0.7f, 42);
  sp.user_tag = 0xfeedULL;
  sp.logprobs = 0;
  sp.priority = 5;
  const tboost_request_id a = Enqueue(e.p, Prompt(1, 9), sp);
  const tboost_request_id b = Enqueue(e.p, Prompt(2, 3), Params(5));
  EXPECT_GT(b, a);
  size_t n = 0;
  ASSERT_OK(tboost_engine_step(e.p, &n));
  EXPECT_EQ(n, 2u) << "both prompts fit one step and each yields its first token";
  // cap 0: how many are ready, nothing removed.
  size_t ready = 0;
  ASSERT_OK(tboost_engine_read(e.p, TBOOST_ANY_REQUEST, nullptr, sizeof(tboost_event), 0, &ready));
  EXPECT_EQ(ready, 2u);
  ASSERT_OK(tboost_engine_read(e.p, a, nullptr, sizeof(tboost_event), 0, &ready));
  EXPECT_EQ(ready, 1u);
  RunToCompletion(e.p);
  const auto ev_a = ReadAll(e.p, a);
  ExpectWellFormed(ev_a, a);
  ASSERT_EQ(ev_a.size(), 7u);
  for (auto& ev : ev_a) {
    EXPECT_EQ(ev.user_tag, 0xfeedULL);
    EXPECT_TRUE(std::isfinite(ev.logprob) && ev.logprob <= 0.0f) << ev.logprob;
    EXPECT_EQ(ev.error, TBOOST_OK);
  }
  EXPECT_EQ(ev_a.back().finish, TBOOST_FINISH_LENGTH);
  const auto ev_b = ReadAll(e.p, TBOOST_ANY_REQUEST);  // only b's are left
  ExpectWellFormed(ev_b, b);
  EXPECT_TRUE(std::isnan(ev_b[0].logprob)) << "no logprobs unless asked";
  // The same tokens through tboost_engine_output.
  size_t count = 0;
  tboost_finish_reason finish = TBOOST_FINISH_NONE;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_engine_output(e.p, a, nullptr, 0, &count, &finish));
  EXPECT_EQ(count, 7u);
  Tokens out(count);
  ASSERT_OK(tboost_engine_output(e.p, a, out.data(), out.size(), &count, &finish));
  EXPECT_EQ(out, TokensOf(ev_a));
  EXPECT_EQ(finish, TBOOST_FINISH_LENGTH);
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_output(e.p, 9999, out.data(), out.size(), &count, &finish));
  // Requests that did not fail have no error text.
  size_t need = 0;
  char text[8] = "x";
  ASSERT_OK(tboost_engine_request_error(e.p, a, text, sizeof text, &need));
  EXPECT_EQ(need, 1u);
  EXPECT_STREQ(text, "");
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_request_error(e.p, 4242, text, sizeof text, &need));
}

TEST(Engine, TopLogprobsTimingsAndPromptLogprobs) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  tboost_sampling_params sp = Params(4);
  sp.logprobs = 5;
  sp.prompt_logprobs = 1;
  const Tokens prompt = Prompt(4, 21);
  const tboost_request_id a = Enqueue(e.p, prompt, sp);
  tboost_sampling_params many = Params(2);
  many.logprobs = 50;  // more than an event carries: capped
  const tboost_request_id b = Enqueue(e.p, Prompt(5, 6), many);
  const tboost_request_id c = Enqueue(e.p, Prompt(6, 6), Params(2));  // no prompt logprobs
  RunToCompletion(e.p);
  const auto ev = ReadAll(e.p, a);
  ExpectWellFormed(ev, a);
  ASSERT_EQ(ev.size(), 4u);
  for (size_t i = 0; i < ev.size(); ++i) {
    ASSERT_EQ(ev[i].n_top, 5u) << "event " << i;
    EXPECT_EQ(ev[i].top_tokens[0], ev[i].token) << "greedy takes the most likely token";
    EXPECT_FLOAT_EQ(ev[i].top_logprobs[0], ev[i].logprob);
    for (int k = 1; k < 5; ++k) EXPECT_LE(ev[i].top_logprobs[k], ev[i].top_logprobs[k - 1]) << "event " << i;
    if (i + 1 < ev.size()) {
      EXPECT_EQ(ev[i].total_ms, 0.0) << "timings only on the last event";
      EXPECT_TRUE(std::isnan(ev[i].first_token_ms));
      EXPECT_EQ(ev[i].prompt_tokens, 0u);
    }
  }
  const tboost_event& last = ev.back();
  EXPECT_EQ(last.prompt_tokens, prompt.size());
  EXPECT_EQ(last.cached_prompt_tokens, 0u);
  EXPECT_EQ(last.preemptions, 0u);
  EXPECT_LE(0.0, last.queued_ms);
  EXPECT_LE(last.queued_ms, last.first_token_ms);
  EXPECT_LE(last.first_token_ms, last.total_ms);
  const auto ev_b = ReadAll(e.p, b);
  EXPECT_EQ(ev_b[0].n_top, (uint32_t)TBOOST_MAX_TOP_LOGPROBS);
  const auto ev_c = ReadAll(e.p, c);
  EXPECT_EQ(ev_c[0].n_top, 0u) << "no alternatives unless asked";

  // Prompt logprobs: one per prompt token, entry 0 NaN (no context), the rest finite and <= 0.
  size_t n = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_engine_prompt_logprobs(e.p, a, nullptr, 0, &n));
  ASSERT_EQ(n, prompt.size());
  std::vector<float> lp(n);
  ASSERT_OK(tboost_engine_prompt_logprobs(e.p, a, lp.data(), lp.size(), &n));
  EXPECT_TRUE(std::isnan(lp[0]));
  for (size_t i = 1; i < n; ++i) EXPECT_TRUE(std::isfinite(lp[i]) && lp[i] <= 0.0f) << i << ": " << lp[i];
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_prompt_logprobs(e.p, c, lp.data(), lp.size(), &n));
  EXPECT_NE(LastError().find("prompt_logprobs"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_prompt_logprobs(e.p, 4242, lp.data(), lp.size(), &n));
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, tboost_engine_prompt_logprobs(e.p, a, lp.data(), lp.size(), nullptr));

  // A host built against the first header (40-byte events, 64-byte params) still works.
  tboost_sampling_params v1 = Params(2);
  v1.struct_size = 64;
  v1.prompt_logprobs = 1;  // beyond a first-version struct: not read
  const tboost_request_id d = Enqueue(e.p, Prompt(7, 5), v1);
  RunToCompletion(e.p);
  alignas(8) unsigned char old[2][40];
  std::memset(old, 0xcd, sizeof old);
  ASSERT_OK(tboost_engine_read(e.p, d, reinterpret_cast<tboost_event*>(old), 40, 2, &n));
  ASSERT_EQ(n, 2u);
  tboost_event first{};
  std::memcpy(&first, old[0], 40);
  EXPECT_EQ(first.struct_size, 40u);
  EXPECT_EQ(first.index, 0u);
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_prompt_logprobs(e.p, d, lp.data(), lp.size(), &n));
}

TEST(Engine, LogitBiasBansAndForcesTokensAndChecksItsArrays) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  auto first = [&](const tboost_sampling_params& sp) {
    const tboost_request_id id = Enqueue(e.p, Prompt(8, 9), sp);
    RunToCompletion(e.p);
    return ReadAll(e.p, id).front();
  };
  tboost_sampling_params sp = Params(1);
  sp.logprobs = 2;
  const tboost_event plain = first(sp);
  const int32_t best = plain.top_tokens[0];
  const float ban = -INFINITY;
  sp.n_logit_bias = 1;
  sp.logit_bias_tokens = &best;
  sp.logit_bias_values = &ban;
  const tboost_event banned = first(sp);
  EXPECT_EQ(banned.token, plain.top_tokens[1]) << "the runner-up once the best is banned";
  EXPECT_FLOAT_EQ(banned.top_logprobs[0], plain.top_logprobs[0]) << "logprobs stay the raw model's";
  const int32_t forced_token = 17;
  const float push = 1000.0f;
  sp.logit_bias_tokens = &forced_token;
  sp.logit_bias_values = &push;
  EXPECT_EQ(first(sp).token, 17);
  // Bad arrays: each named.
  tboost_request_id id = 0;
  const Tokens prompt = Prompt(8, 9);
  sp.logit_bias_values = nullptr;
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &id));
  EXPECT_NE(LastError().find("logit_bias_values"), std::string::npos) << LastError();
  const int32_t outside = 640;
  sp.logit_bias_tokens = &outside;
  sp.logit_bias_values = &push;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &id));
  EXPECT_NE(LastError().find("logit_bias[0]"), std::string::npos) << LastError();
  const float nan = NAN;
  sp.logit_bias_tokens = &forced_token;
  sp.logit_bias_values = &nan;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &id));
  EXPECT_NE(LastError().find("logit_bias[0]"), std::string::npos) << LastError();
}

TEST(Engine, StructuredOutputMatchesItsGrammarAndBadGrammarsAreNamed) {
  // A model with a real tokenizer (Llama-2's SentencePiece vocabulary, random weights): the
  // mask alone must make the output match.
  Model m(SharedDir() + "/models/llama-2-tiny-random.gguf");
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  tboost_sampling_params sp = Params(16, 0.9f, 7);
  sp.ignore_eos = 0;
  sp.grammar = "(cat|dog)-[0-9]{3}";
  sp.grammar_kind = TBOOST_GRAMMAR_REGEX;
  const Tokens prompt{1, 450, 4996};
  const tboost_request_id id = Enqueue(e.p, prompt, sp);
  RunToCompletion(e.p);
  const auto ev = ReadAll(e.p, id);
  EXPECT_EQ(ev.back().finish, TBOOST_FINISH_EOS) << "a complete grammar ends the request";
  const Tokens out = TokensOf(ev);
  size_t need = 0;
  tboost_engine_detokenize(e.p, out.data(), out.size(), nullptr, 0, &need);
  std::string text(need, '\0');
  ASSERT_OK(tboost_engine_detokenize(e.p, out.data(), out.size(), text.data(), text.size(), &need));
  text.resize(need - 1);
  EXPECT_TRUE(text.size() == 7 && (text.rfind("cat-", 0) == 0 || text.rfind("dog-", 0) == 0) &&
              std::all_of(text.begin() + 4, text.end(), ::isdigit))
      << text;
  // The same language in llama.cpp's GBNF, converted: the same checks.
  sp.grammar = "root ::= (\"cat\" | \"dog\") \"-\" digit{3}\ndigit ::= [0-9]";
  sp.grammar_kind = TBOOST_GRAMMAR_GBNF;
  sp.seed = 8;
  const tboost_request_id gid = Enqueue(e.p, prompt, sp);
  RunToCompletion(e.p);
  const auto gev = ReadAll(e.p, gid);
  EXPECT_EQ(gev.back().finish, TBOOST_FINISH_EOS) << "a complete GBNF grammar ends the request";
  const Tokens gout = TokensOf(gev);
  tboost_engine_detokenize(e.p, gout.data(), gout.size(), nullptr, 0, &need);
  std::string gtext(need, '\0');
  ASSERT_OK(tboost_engine_detokenize(e.p, gout.data(), gout.size(), gtext.data(), gtext.size(), &need));
  gtext.resize(need - 1);
  EXPECT_TRUE(gtext.size() == 7 && (gtext.rfind("cat-", 0) == 0 || gtext.rfind("dog-", 0) == 0) &&
              std::all_of(gtext.begin() + 4, gtext.end(), ::isdigit))
      << gtext;
  // Bad grammars and kinds: the enqueue fails naming them; the engine goes on.
  tboost_request_id bad = 0;
  sp.grammar = "root ::= \"a\"\n  | [z-a]";
  sp.grammar_kind = TBOOST_GRAMMAR_GBNF;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &bad));
  EXPECT_NE(LastError().find("grammar (gbnf)"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("line 2 col 6"), std::string::npos) << LastError();
  sp.grammar = "start: \"a\" undefined_rule";
  sp.grammar_kind = TBOOST_GRAMMAR_LARK;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &bad));
  EXPECT_NE(LastError().find("grammar (lark)"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("undefined_rule"), std::string::npos) << LastError();
  sp.grammar = "{\"type\": ";
  sp.grammar_kind = TBOOST_GRAMMAR_JSON_SCHEMA;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &bad));
  EXPECT_NE(LastError().find("schema is not JSON"), std::string::npos) << LastError();
  sp.grammar_kind = 7;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &bad));
  EXPECT_NE(LastError().find("grammar_kind"), std::string::npos) << LastError();
  sp.grammar = nullptr;
  sp.grammar_kind = TBOOST_GRAMMAR_REGEX;
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER,
                tboost_engine_enqueue(e.p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &bad));
  const tboost_request_id ok = Enqueue(e.p, prompt, Params(3));
  RunToCompletion(e.p);
  EXPECT_EQ(ReadAll(e.p, ok).back().finish, TBOOST_FINISH_LENGTH);
  // A model without a tokenizer cannot build the token masks: said at enqueue.
  Model golden(Golden("llama_gqa"));
  Engine g(golden.p, cfg->p);
  sp.grammar = "a+";
  const Tokens small{5, 6, 7};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_engine_enqueue(g.p, small.data(), small.size(), &sp, nullptr, nullptr, 0, &bad));
  EXPECT_NE(LastError().find("tokenizer"), std::string::npos) << LastError();
}

TEST(Chat, TemplateRendersMessagesWithToolsAndNamesBadInput) {
  // A Hugging Face directory: the golden weights plus a tokenizer_config.json with a template.
  const std::string dir = TempDir();
  for (const char* f : {"/config.json", "/model.safetensors"}) WriteFile(dir + f, ReadFile(Golden("llama_gqa") + f));
  WriteFile(dir + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>", "chat_template":
    "{{ bos_token }}{% if tools %}[{{ tools | length }} tools: {{ tools[0].function.name }}]{% endif %}{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}<|{{ m.role }}|>{{ m.content }}{% if m.tool_calls %}(call {{ m.tool_calls[0].function.name }}){% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"})");
  tboost_model* raw = nullptr;
  ASSERT_OK(tboost_model_load(dir.c_str(), nullptr, nullptr, nullptr, &raw));
  auto render = [&](const char* json, bool gen, std::string* out) {
    size_t need = 0;
    const tboost_status s = tboost_model_chat_apply(raw, json, gen, nullptr, 0, &need);
    if (s != TBOOST_ERR_BUFFER_TOO_SMALL) return s;
    std::string text(need, '\0');
    const tboost_status s2 = tboost_model_chat_apply(raw, json, gen, text.data(), text.size(), &need);
    text.resize(need - 1);
    *out = text;
    return s2;
  };
  std::string text;
  ASSERT_OK(render(R"([{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}])", true, &text));
  // trim_blocks (as Hugging Face renders): the newline after a block tag is dropped.
  EXPECT_EQ(text, "<s><|system|>Be brief.<|user|>Hi<|assistant|>");
  ASSERT_OK(render(R"({"messages":[{"role":"user","content":"Weather?"},
      {"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"get_weather","arguments":{}}}]}],
      "tools":[{"type":"function","function":{"name":"get_weather","parameters":{}}}]})",
                   false, &text));
  EXPECT_EQ(text, "<s>[1 tools: get_weather]<|user|>Weather?<|assistant|>(call get_weather)");
  // Bad input: each named.
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, render("[{\"role\": ", true, &text));
  EXPECT_NE(LastError().find("messages_json"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("column"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, render(R"([{"content":"no role"}])", true, &text));
  EXPECT_NE(LastError().find("messages[0]"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, render(R"([{"role":"wizard","content":"x"}])", true, &text));
  EXPECT_NE(LastError().find("unknown role wizard"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, render(nullptr, true, &text));
  // No tokenizer here: no token ids, and no stop strings.
  size_t n_ids = 0;
  EXPECT_STATUS(TBOOST_ERR_NO_TOKENIZER,
                tboost_model_chat_tokens(raw, R"([{"role":"user","content":"Hi"}])", true, nullptr, 0, &n_ids));
  char stops[16];
  size_t need = 0;
  ASSERT_OK(tboost_model_chat_stops(raw, stops, sizeof stops, &need));
  EXPECT_STREQ(stops, "[]");
  tboost_model_free(raw);
  // A model without a template says so, naming the file.
  Model plain(Golden("llama_gqa"));
  EXPECT_STATUS(TBOOST_ERR_UNSUPPORTED, tboost_model_chat_apply(plain.p, "[]", true, nullptr, 0, &need));
  EXPECT_NE(LastError().find("chat template"), std::string::npos) << LastError();
  for (const char* f : {"/config.json", "/model.safetensors", "/tokenizer_config.json"}) std::remove((dir + f).c_str());
  rmdir(dir.c_str());
}

// Chat messages straight to token ids: the rendered text (a GGUF with a real Llama-2 vocabulary
// and no template of its own, so the built-in Llama 2 `[INST]` one) tokenized without BOS added.
TEST(Chat, TokensAreTheRenderedTextsIds) {
  Model m(SharedDir() + "/models/llama-2-tiny-random.gguf");
  const char* msgs = R"([{"role":"user","content":"Name three colours."}])";
  size_t need = 0;
  ASSERT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_chat_apply(m.p, msgs, true, nullptr, 0, &need));
  std::string text(need, '\0');
  ASSERT_OK(tboost_model_chat_apply(m.p, msgs, true, text.data(), text.size(), &need));
  text.resize(need - 1);
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  size_t n = 0;
  ASSERT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_engine_tokenize(e.p, text.data(), text.size(), false, nullptr, 0, &n));
  std::vector<int32_t> want(n);
  ASSERT_OK(tboost_engine_tokenize(e.p, text.data(), text.size(), false, want.data(), want.size(), &n));
  size_t got_n = 0;
  ASSERT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_chat_tokens(m.p, msgs, true, nullptr, 0, &got_n));
  ASSERT_EQ(got_n, want.size());
  std::vector<int32_t> got(got_n);
  ASSERT_OK(tboost_model_chat_tokens(m.p, msgs, true, got.data(), got.size(), &got_n));
  EXPECT_EQ(got, want);
  EXPECT_EQ(got.front(), 1) << "the template writes BOS (<s>, id 1) itself";
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_model_chat_tokens(m.p, "[{", true, nullptr, 0, &got_n));
  EXPECT_NE(LastError().find("messages_json"), std::string::npos) << LastError();
}

TEST(Engine, ReadRulesEventSizeCapAndUnknownIds) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  const tboost_request_id id = Enqueue(e.p, Prompt(3, 4), Params(3));
  RunToCompletion(e.p);
  size_t n = 0;
  tboost_event ev[4];
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_read(e.p, id, ev, 16, 4, &n));
  EXPECT_NE(LastError().find("event_size"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_read(e.p, 777, ev, sizeof(tboost_event), 4, &n));
  // A caller whose tboost_event is larger (a newer header) gets our fields at its stride.
  struct Bigger {
    tboost_event ev;
    uint64_t future[3];
  } big[4];
  std::memset(big, 0xcd, sizeof big);
  ASSERT_OK(tboost_engine_read(e.p, id, &big[0].ev, sizeof(Bigger), 1, &n));
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(big[0].ev.struct_size, sizeof(tboost_event));
  EXPECT_EQ(big[0].ev.index, 0u);
  EXPECT_EQ(big[0].future[0], 0xcdcdcdcdcdcdcdcdULL) << "bytes past our struct are left alone";
  ASSERT_OK(tboost_engine_read(e.p, id, &big[0].ev, sizeof(Bigger), 4, &n));
  ASSERT_EQ(n, 2u);
  EXPECT_EQ(big[1].ev.index, 2u);
  EXPECT_EQ(big[1].ev.finish, TBOOST_FINISH_LENGTH);
  ASSERT_OK(tboost_engine_read(e.p, id, ev, sizeof(tboost_event), 4, &n));
  EXPECT_EQ(n, 0u) << "each event is read once";
}

TEST(Engine, StopSequencesEndTheRequest) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  const Tokens prompt = Prompt(4, 6);
  const tboost_request_id free_run = Enqueue(e.p, prompt, Params(10));
  RunToCompletion(e.p);
  const Tokens full = TokensOf(ReadAll(e.p, free_run));
  ASSERT_EQ(full.size(), 10u);
  const Tokens stop{full[3], full[4]};
  size_t end = 0;  // where the stop sequence first completes
  for (size_t i = 1; i < full.size(); ++i)
    if (full[i - 1] == stop[0] && full[i] == stop[1]) {
      end = i + 1;
      break;
    }
  const tboost_request_id stopped = Enqueue(e.p, prompt, Params(10), {Tokens{999 % 640}, stop});
  RunToCompletion(e.p);
  const auto evs = ReadAll(e.p, stopped);
  ExpectWellFormed(evs, stopped);
  EXPECT_EQ(TokensOf(evs), Tokens(full.begin(), full.begin() + static_cast<long>(end)));
  EXPECT_EQ(evs.back().finish, TBOOST_FINISH_STOP_SEQUENCE);
}

// A draft model (its bf16 copy) beside llama_gqa gives the greedy tokens of the model alone; a
// draft whose vocabulary differs fails engine_new naming the key and the file.
TEST(Engine, DraftModelKeepsTheTokensAndABadOneIsNamed) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> plain(SmallConfig());
  Engine alone(m.p, plain->p);
  const Tokens prompt = Prompt(2, 9);
  const tboost_request_id a = Enqueue(alone.p, prompt, Params(16));
  RunToCompletion(alone.p);
  const Tokens want = TokensOf(ReadAll(alone.p, a));
  ASSERT_EQ(want.size(), 16u);

  std::unique_ptr<Config> cfg(SmallConfig());
  const std::string draft = Golden("llama_gqa_bf16");
  EXPECT_STATUS(TBOOST_OK, tboost_config_set_str(cfg->p, "spec_draft_model", draft.c_str()));
  EXPECT_STATUS(TBOOST_OK, tboost_config_set_int(cfg->p, "spec_draft_tokens", 4));
  Engine e(m.p, cfg->p);
  const tboost_request_id b = Enqueue(e.p, prompt, Params(16));
  RunToCompletion(e.p);
  EXPECT_EQ(TokensOf(ReadAll(e.p, b)), want);

  const std::string other = Golden("mistral");
  EXPECT_STATUS(TBOOST_OK, tboost_config_set_str(cfg->p, "spec_draft_model", other.c_str()));
  tboost_engine* bad = nullptr;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_new(m.p, cfg->p, &bad));
  EXPECT_EQ(bad, nullptr);
  EXPECT_NE(LastError().find("spec_draft_model"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("vocabulary"), std::string::npos) << LastError();
}

TEST(Engine, HasWorkStatsAndPlan) {
  Model m(Golden("llama_gqa"));
  Config cfg{{"threads", "1"}, {"kv_cache_blocks", "64"}, {"disabled_ops", "flash_attention"}};
  Engine e(m.p, cfg.p);
  bool work = true;
  ASSERT_OK(tboost_engine_has_work(e.p, &work));
  EXPECT_FALSE(work);
  size_t n = 99;
  ASSERT_OK(tboost_engine_step(e.p, &n));
  EXPECT_EQ(n, 0u) << "a step with nothing to do";
  Enqueue(e.p, Prompt(5, 20), Params(6));
  Enqueue(e.p, Prompt(6, 3), Params(4));
  ASSERT_OK(tboost_engine_has_work(e.p, &work));
  EXPECT_TRUE(work);
  RunToCompletion(e.p);
  ASSERT_OK(tboost_engine_has_work(e.p, &work));
  EXPECT_FALSE(work);
  tboost_stats st{};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_stats(e.p, &st));
  EXPECT_NE(LastError().find("struct_size"), std::string::npos) << LastError();
  st.struct_size = sizeof st;
  ASSERT_OK(tboost_engine_stats(e.p, &st));
  EXPECT_EQ(st.struct_size, sizeof st);
  EXPECT_EQ(st.block_size, 16u);
  EXPECT_EQ(st.kv_blocks_total, 64u);
  EXPECT_EQ(st.kv_blocks_used, 0u);
  EXPECT_EQ(st.prompt_tokens, 23u);
  EXPECT_EQ(st.generated_tokens, 10u);
  EXPECT_EQ(st.finished, 2u);
  EXPECT_EQ(st.waiting + st.running, 0u);
  EXPECT_GE(st.steps, 6u);
  EXPECT_EQ(st.events_pending, 10u);
  EXPECT_GT(st.total_step_ms, 0.0);
  const std::string plan = PlanJson(e.p);
  EXPECT_NE(plan.find("\"disabled\":[\"flash_attention\"]"), std::string::npos) << plan;
  EXPECT_NE(plan.find("\"choice\":\"standard_attention\""), std::string::npos) << plan;
  char small[5];
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_engine_plan_json(e.p, small, sizeof small, &need));
  EXPECT_EQ(need, plan.size() + 1);
}

// ---- tensor parallelism ------------------------------------------------------------------

Tokens GreedyTokens(tboost_engine* e, const Tokens& prompt, uint32_t n) {
  const tboost_request_id id = Enqueue(e, prompt, Params(n));
  RunToCompletion(e);
  Tokens out(n);
  size_t got = 0;
  tboost_finish_reason finish = TBOOST_FINISH_NONE;
  EXPECT_STATUS(TBOOST_OK, tboost_engine_output(e, id, out.data(), out.size(), &got, &finish));
  EXPECT_EQ(finish, TBOOST_FINISH_LENGTH);
  out.resize(got);
  return out;
}

TEST(TensorParallel, RankAndWorldWithoutMpiAndFinalizeIsANoOp) {
  Model m(Golden("llama_gqa"));
  Config one{{"threads", "1"}, {"kv_cache_blocks", "64"}};
  Engine e1(m.p, one.p);
  uint32_t rank = 9, world = 9;
  ASSERT_OK(tboost_engine_rank(e1.p, &rank, &world));
  EXPECT_EQ(rank, 0u);
  EXPECT_EQ(world, 1u);
  ASSERT_OK(tboost_engine_rank(e1.p, nullptr, nullptr));  // both outputs optional
  const Tokens want = GreedyTokens(e1.p, Prompt(3, 9), 6);

  // `tp` 2 with `comm` local: this engine leads, its second rank is a thread of it.
  Config two{{"threads", "2"}, {"kv_cache_blocks", "64"}, {"tp", "2"}, {"comm", "local"}};
  Engine e2(m.p, two.p);
  ASSERT_OK(tboost_engine_rank(e2.p, &rank, &world));
  EXPECT_EQ(rank, 0u);
  EXPECT_EQ(world, 2u);
  bool work = true;
  ASSERT_OK(tboost_engine_has_work(e2.p, &work));
  EXPECT_FALSE(work) << "a leader with nothing queued has no work";
  EXPECT_EQ(GreedyTokens(e2.p, Prompt(3, 9), 6), want);

  // No engine started MPI here: nothing to end, as often as asked.
  EXPECT_STATUS(TBOOST_OK, tboost_comm_finalize());
  EXPECT_STATUS(TBOOST_OK, tboost_comm_finalize());
}

// Set in the ranks `mpirun` starts from this binary (the test below): each runs one rank.
constexpr const char* kMpiRankEnv = "TBOOST_GTEST_MPI_RANK";

// One rank under mpirun: the follower learns it is one, is refused a request, and steps
// until the leader stops; the leader serves a greedy request. Each prints what it saw.
void MpiRank(Engine* e) {
  uint32_t rank = 9, world = 9;
  ASSERT_OK(tboost_engine_rank(e->p, &rank, &world));
  std::printf("mpi rank %u of %u\n", rank, world);
  if (rank == 0) {
    const Tokens got = GreedyTokens(e->p, Prompt(3, 9), 6);
    std::printf("mpi leader tokens:");
    for (int32_t t : got) std::printf(" %d", t);
    std::printf("\n");
  } else {
    const Tokens prompt = Prompt(3, 9);
    const tboost_sampling_params sp = Params(6);
    tboost_request_id id = 0;
    const tboost_status s = tboost_engine_enqueue(e->p, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &id);
    std::printf("mpi follower enqueue: %s: %s\n", Name(s).c_str(), LastError().c_str());
    bool work = false;
    ASSERT_OK(tboost_engine_has_work(e->p, &work));
    std::printf("mpi follower has work before: %d\n", work ? 1 : 0);
    int steps = 0;
    while (work) {
      ASSERT_OK(tboost_engine_step(e->p, nullptr));
      ++steps;
      ASSERT_OK(tboost_engine_has_work(e->p, &work));
    }
    const auto t0 = Clock::now();
    size_t n = 9;
    ASSERT_OK(tboost_engine_step(e->p, &n));
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    std::printf("mpi follower followed in %d step(s); a later step: %zu events, %s\n", steps, n,
                ms < 1000 ? "at once" : "waited");
  }
}

void MpiRankProcess() {
  {
    Model m(Golden("llama_gqa"));
    Config cfg{{"threads", "1"}, {"kv_cache_blocks", "64"}, {"comm", "mpi"}, {"comm_timeout_ms", "60000"}};
    Engine e(m.p, cfg.p);
    MpiRank(&e);
  }  // freeing rank 0's engine stops the followers
  ASSERT_OK(tboost_comm_finalize());
}

// `mpirun -np 2` on this binary, filtered to this test: the two processes' engines form a
// group over Open MPI, and the C ABI tells each host its part.
TEST(TensorParallel, UnderMpirunAFollowerKnowsItAndStepsUntilTheLeaderStops) {
  if (std::getenv(kMpiRankEnv) != nullptr) return MpiRankProcess();
  ASSERT_TRUE(IsFile("/usr/bin/mpirun")) << "mpirun is missing: run scripts/setup.sh (installs openmpi-bin)";
  Model m(Golden("llama_gqa"));
  Config one{{"threads", "1"}, {"kv_cache_blocks", "64"}};
  Tokens want;
  {
    Engine e(m.p, one.p);
    want = GreedyTokens(e.p, Prompt(3, 9), 6);
  }
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof self - 1), 0);
  // --allow-run-as-root and no cross-memory attach: containers; no leak check in the ranks:
  // Open MPI keeps memory to the end on purpose. `timeout` is the hard limit.
  const std::string cmd = std::string("ASAN_OPTIONS=detect_leaks=0 ") + kMpiRankEnv +
                          "=1 OMPI_MCA_btl_vader_single_copy_mechanism=none timeout -k 5 180 /usr/bin/mpirun "
                          "--allow-run-as-root --oversubscribe -x ASAN_OPTIONS -x " +
                          kMpiRankEnv + " -np 2 '" + self +
                          "' --gtest_filter=TensorParallel.UnderMpirunAFollowerKnowsItAndStepsUntilTheLeaderStops 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr) << cmd;
  std::string out;
  char line[4096];
  while (std::fgets(line, sizeof line, f) != nullptr) out += line;
  EXPECT_EQ(pclose(f), 0) << cmd << "\n" << out;
  EXPECT_NE(out.find("mpi rank 0 of 2"), std::string::npos) << out;
  EXPECT_NE(out.find("mpi rank 1 of 2"), std::string::npos) << out;
  EXPECT_NE(out.find("mpi follower enqueue: TBOOST_ERR_INVALID_ARGUMENT: "), std::string::npos) << out;
  EXPECT_NE(out.find("tensor-parallel rank 1, a follower: requests go to rank 0"), std::string::npos) << out;
  EXPECT_NE(out.find("mpi follower has work before: 1"), std::string::npos) << out;
  EXPECT_NE(out.find("mpi follower followed in 1 step(s); a later step: 0 events, at once"), std::string::npos)
      << out;
  std::string tokens = "mpi leader tokens:";
  for (int32_t t : want) tokens += " " + std::to_string(t);
  EXPECT_NE(out.find(tokens + "\n"), std::string::npos) << "want " << tokens << "\n" << out;
}

TEST(Engine, TokenizerlessModelsSayNoTokenizer) {
  Model m(Golden("llama_gqa"));
  Engine e(m.p, nullptr);
  size_t n = 0;
  int32_t ids[8];
  EXPECT_STATUS(TBOOST_ERR_NO_TOKENIZER, tboost_engine_tokenize(e.p, "hello", 5, true, ids, 8, &n));
  EXPECT_NE(LastError().find("no tokenizer"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_tokenize(e.p, "\xff\xfe", 2, false, ids, 8, &n));
  EXPECT_NE(LastError().find("UTF-8"), std::string::npos) << LastError();
  const int32_t toks[] = {5, 6};
  char text[16];
  EXPECT_STATUS(TBOOST_ERR_NO_TOKENIZER, tboost_engine_detokenize(e.p, toks, 2, text, sizeof text, &n));
  const int32_t bad[] = {5, -1};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_engine_detokenize(e.p, bad, 2, text, sizeof text, &n));
  EXPECT_NE(LastError().find("`tokens[1]` = -1"), std::string::npos) << LastError();
}

// ---- cancel --------------------------------------------------------------------------------

TEST(Cancel, BeforeDuringAndAfterGeneration) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  // Before any step.
  const tboost_request_id before = Enqueue(e.p, Prompt(7, 5), Params(20));
  ASSERT_OK(tboost_engine_cancel(e.p, before));
  ASSERT_OK(tboost_engine_cancel(e.p, before));  // idempotent
  bool work = false;
  ASSERT_OK(tboost_engine_has_work(e.p, &work));
  EXPECT_TRUE(work) << "the cancellation still has to be reported";
  RunToCompletion(e.p);
  auto evs = ReadAll(e.p, before);
  ASSERT_EQ(evs.size(), 1u);
  EXPECT_EQ(evs[0].token, -1);
  EXPECT_EQ(evs[0].index, 0u);
  EXPECT_EQ(evs[0].finish, TBOOST_FINISH_CANCELLED);

  // During: after three tokens; its blocks are freed by the next step.
  const tboost_request_id during = Enqueue(e.p, Prompt(8, 40), Params(30));
  for (int i = 0; i < 3; ++i) ASSERT_OK(tboost_engine_step(e.p, nullptr));
  tboost_stats st{};
  st.struct_size = sizeof st;
  ASSERT_OK(tboost_engine_stats(e.p, &st));
  EXPECT_GT(st.kv_blocks_used, 0u);
  ASSERT_OK(tboost_engine_cancel(e.p, during));
  RunToCompletion(e.p);
  ASSERT_OK(tboost_engine_stats(e.p, &st));
  EXPECT_EQ(st.kv_blocks_used, 0u);
  ASSERT_OK(tboost_engine_cancel(e.p, during));  // still idempotent once cancelled
  evs = ReadAll(e.p, during);
  ExpectWellFormed(evs, during);
  EXPECT_EQ(TokensOf(evs).size(), 3u);
  EXPECT_EQ(evs.back().finish, TBOOST_FINISH_CANCELLED);
  ASSERT_OK(tboost_engine_stats(e.p, &st));
  EXPECT_EQ(st.cancelled, 2u);

  // After: a finished request cannot be cancelled; unknown ids neither.
  const tboost_request_id after = Enqueue(e.p, Prompt(9, 5), Params(2));
  RunToCompletion(e.p);
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_cancel(e.p, after));
  EXPECT_NE(LastError().find("already finished (length)"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_cancel(e.p, 123456));
  EXPECT_EQ(TokensOf(ReadAll(e.p, after)).size(), 2u);
}

TEST(Cancel, WhileAnotherThreadStepsEveryStreamEndsOnce) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  std::vector<tboost_request_id> ids;
  for (int k = 0; k < 12; ++k) ids.push_back(Enqueue(e.p, Prompt(k, 5 + k), Params(40)));
  std::atomic<bool> done{false};
  std::thread stepper([&] {
    while (!done.load()) {
      const tboost_status s = tboost_engine_step(e.p, nullptr);
      EXPECT_EQ(Name(s), "TBOOST_OK") << LastError();
    }
  });
  std::vector<tboost_status> cancel_status(ids.size(), TBOOST_ERR_NOT_FOUND);
  for (size_t i = 0; i < ids.size(); i += 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const tboost_status s = tboost_engine_cancel(e.p, ids[i]);
    EXPECT_TRUE(s == TBOOST_OK || s == TBOOST_ERR_NOT_FOUND) << Name(s);
    cancel_status[i] = s;
  }
  for (;;) {
    bool work = false;
    ASSERT_OK(tboost_engine_has_work(e.p, &work));
    if (!work) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  done = true;
  stepper.join();
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto evs = ReadAll(e.p, ids[i]);
    ExpectWellFormed(evs, ids[i]);
    const auto f = evs.back().finish;
    if (i % 2 == 1) {
      EXPECT_EQ(f, TBOOST_FINISH_LENGTH);
    } else if (cancel_status[i] == TBOOST_OK) {
      EXPECT_EQ(f, TBOOST_FINISH_CANCELLED) << "cancel returned OK, so the stream ends cancelled";
    } else {
      EXPECT_EQ(f, TBOOST_FINISH_LENGTH) << "cancel said NOT_FOUND: it had finished";
    }
  }
  tboost_stats st{};
  st.struct_size = sizeof st;
  ASSERT_OK(tboost_engine_stats(e.p, &st));
  EXPECT_EQ(st.kv_blocks_used, 0u);
}

// ---- threads -------------------------------------------------------------------------------

TEST(Threads, ConcurrentStepIsBusy) {
  if (!TBOOST_TEST_FAULT_INJECTION) {
    GTEST_SKIP() << "needs libtboost built with -DTBOOST_FAULT_INJECTION=ON (scripts/test-embedding.sh does)";
  }
  Model m(Golden("llama_gqa"));
  // test.* keys: only in a library built with TBOOST_FAULT_INJECTION (test-embedding.sh does).
  Config cfg{{"threads", "1"}, {"test.step_delay_ms", "400"}};
  Engine e(m.p, cfg.p);
  std::atomic<bool> entering{false};
  tboost_status first = TBOOST_ERR_INTERNAL;
  std::thread slow([&] {
    entering = true;
    first = tboost_engine_step(e.p, nullptr);
  });
  while (!entering.load()) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_STATUS(TBOOST_ERR_BUSY, tboost_engine_step(e.p, nullptr));
  EXPECT_NE(LastError().find("another thread is stepping"), std::string::npos) << LastError();
  // Other calls go on while the step runs.
  tboost_request_id id = Enqueue(e.p, Prompt(1, 4), Params(2));
  EXPECT_STATUS(TBOOST_OK, tboost_engine_cancel(e.p, id));
  slow.join();
  EXPECT_EQ(Name(first), "TBOOST_OK");
}

TEST(Threads, EnqueueFromEightThreadsWhileOneSteps) {
  Model m(Golden("llama_gqa"));
  Config cfg{{"threads", "1"}, {"kv_cache_blocks", "256"}, {"max_seqs", "12"}, {"max_batched_tokens", "48"}};
  Engine e(m.p, cfg.p);
  constexpr int kThreads = 8, kPerThread = 4;
  std::atomic<int> submitting{kThreads};
  std::mutex mu;
  std::map<int, tboost_request_id> ids;  // k -> id
  std::thread stepper([&] {
    for (;;) {
      const int left = submitting.load();
      bool work = false;
      ASSERT_OK(tboost_engine_has_work(e.p, &work));
      if (work) ASSERT_OK(tboost_engine_step(e.p, nullptr));
      else if (left == 0) return;
      else std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int k = t * kPerThread + i;
        tboost_sampling_params sp = Params(6, k % 3 == 0 ? 0.9f : 0.0f, 17 + k);
        sp.user_tag = k;
        const tboost_request_id id = Enqueue(e.p, Prompt(k, 3 + k % 9), sp);
        std::lock_guard<std::mutex> lock(mu);
        ids[k] = id;
      }
      submitting.fetch_sub(1);
    });
  for (auto& t : threads) t.join();
  stepper.join();
  ASSERT_EQ(ids.size(), static_cast<size_t>(kThreads * kPerThread));
  // Each request alone on a fresh engine gives the same tokens (request-level determinism).
  Config ref_cfg{{"threads", "1"}, {"kv_cache_blocks", "64"}};
  Engine ref(m.p, ref_cfg.p);
  for (auto& [k, id] : ids) {
    const auto evs = ReadAll(e.p, id);
    ExpectWellFormed(evs, id);
    for (auto& ev : evs) EXPECT_EQ(ev.user_tag, static_cast<uint64_t>(k));
    const tboost_request_id rid = Enqueue(ref.p, Prompt(k, 3 + k % 9), Params(6, k % 3 == 0 ? 0.9f : 0.0f, 17 + k));
    RunToCompletion(ref.p);
    EXPECT_EQ(TokensOf(evs), TokensOf(ReadAll(ref.p, rid))) << "request " << k;
  }
}

TEST(Threads, WaitTimesOutWakesOnEventsAndReturnsWhenFreed) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  Engine e(m.p, cfg->p);
  size_t n = 99;
  const auto t0 = Clock::now();
  ASSERT_OK(tboost_engine_wait(e.p, TBOOST_ANY_REQUEST, 60, &n));
  EXPECT_EQ(n, 0u);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(55));
  EXPECT_STATUS(TBOOST_ERR_NOT_FOUND, tboost_engine_wait(e.p, 5555, 10, &n));

  const tboost_request_id id = Enqueue(e.p, Prompt(2, 5), Params(3));
  size_t woke = 0;
  tboost_status ws = TBOOST_ERR_INTERNAL;
  auto t1 = Clock::now();
  std::thread waiter([&] { ws = tboost_engine_wait(e.p, id, 20000, &woke); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_OK(tboost_engine_step(e.p, nullptr));
  waiter.join();
  EXPECT_EQ(Name(ws), "TBOOST_OK");
  EXPECT_EQ(woke, 1u);
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(10));

  // A thread blocked in wait returns when the engine is freed.
  tboost_engine* raw = e.release();
  tboost_status freed = TBOOST_OK;
  std::atomic<bool> started{false};
  std::thread blocked([&] {
    started = true;
    freed = tboost_engine_wait(raw, TBOOST_ANY_REQUEST + 0, 20000, nullptr);
  });
  while (!started.load()) std::this_thread::yield();
  // Drain what is ready so the waiter really blocks.
  ReadAll(raw, TBOOST_ANY_REQUEST);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  t1 = Clock::now();
  ASSERT_OK(tboost_engine_free(raw));
  blocked.join();
  EXPECT_TRUE(freed == TBOOST_ERR_INVALID_HANDLE || freed == TBOOST_OK) << Name(freed);
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(10));
}

TEST(Lifecycle, DestroyWithRequestsInFlight) {
  Model m(Golden("llama_gqa"));
  std::unique_ptr<Config> cfg(SmallConfig());
  for (int round = 0; round < 3; ++round) {
    tboost_engine* e = nullptr;
    ASSERT_OK(tboost_engine_new(m.p, cfg->p, &e));
    for (int k = 0; k < 10; ++k) Enqueue(e, Prompt(k, 10 + k), Params(50));
    for (int s = 0; s < round * 2; ++s) ASSERT_OK(tboost_engine_step(e, nullptr));
    ASSERT_OK(tboost_engine_free(e));  // waiting, running and unread events all go
    EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_engine_step(e, nullptr));
  }
  // Many engines on one model, freed in any order.
  std::vector<tboost_engine*> engines(4, nullptr);
  for (auto& e : engines) ASSERT_OK(tboost_engine_new(m.p, cfg->p, &e));
  for (auto* e : engines) Enqueue(e, Prompt(1, 5), Params(3));
  ASSERT_OK(tboost_engine_free(engines[2]));
  ASSERT_OK(tboost_engine_free(engines[0]));
  RunToCompletion(engines[1]);
  ASSERT_OK(tboost_engine_free(engines[3]));
  ASSERT_OK(tboost_engine_free(engines[1]));
}

TEST(Lifecycle, PanicIsAStatusAndPoisonsOnlyItsEngine) {
  if (!TBOOST_TEST_FAULT_INJECTION) {
    GTEST_SKIP() << "needs libtboost built with -DTBOOST_FAULT_INJECTION=ON (scripts/test-embedding.sh does)";
  }
  Model m(Golden("llama_gqa"));
  Config cfg{{"threads", "1"}, {"kv_cache_blocks", "32"}, {"test.panic_at_step", "2"}};
  Engine bad(m.p, cfg.p);
  Engine good(m.p, nullptr);
  const tboost_request_id id = Enqueue(bad.p, Prompt(1, 4), Params(5));
  ASSERT_OK(tboost_engine_step(bad.p, nullptr));
  EXPECT_STATUS(TBOOST_ERR_PANIC, tboost_engine_step(bad.p, nullptr));
  EXPECT_NE(LastError().find("panics on purpose"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("poisoned"), std::string::npos) << LastError();
  const Tokens p{3, 4};
  tboost_sampling_params sp = Params(2);
  tboost_request_id id2 = 0;
  size_t n = 0;
  bool work = false;
  tboost_event ev[2];
  tboost_stats st{};
  st.struct_size = sizeof st;
  char buf[64];
  int32_t toks[4];
  for (tboost_status s : {tboost_engine_step(bad.p, nullptr),
                          tboost_engine_enqueue(bad.p, p.data(), 2, &sp, nullptr, nullptr, 0, &id2),
                          tboost_engine_cancel(bad.p, id), tboost_engine_has_work(bad.p, &work),
                          tboost_engine_read(bad.p, id, ev, sizeof(tboost_event), 2, &n),
                          tboost_engine_wait(bad.p, id, 0, &n), tboost_engine_output(bad.p, id, toks, 4, &n, nullptr),
                          tboost_engine_request_error(bad.p, id, buf, sizeof buf, &n),
                          tboost_engine_stats(bad.p, &st), tboost_engine_plan_json(bad.p, buf, sizeof buf, &n),
                          tboost_engine_tokenize(bad.p, "a", 1, false, toks, 4, &n),
                          tboost_engine_detokenize(bad.p, toks, 0, buf, sizeof buf, &n)})
    EXPECT_EQ(Name(s), "TBOOST_ERR_POISONED");
  Enqueue(good.p, Prompt(1, 4), Params(5));
  RunToCompletion(good.p);
  ASSERT_OK(tboost_engine_free(bad.release()));
}

// ---- equality with the Rust API ------------------------------------------------------------

struct CliResult {
  Tokens tokens;
  std::string finish;
};

// Runs `tboost batch` (the Rust API) on JSONL requests and parses its per-request lines.
std::vector<CliResult> RunCli(const std::string& model, const std::vector<std::string>& lines,
                              const std::string& extra_args = "") {
  const char* env = std::getenv("TBOOST_CLI");
  const std::string cli = env != nullptr ? env : TBOOST_CLI_DEFAULT;
  EXPECT_TRUE(IsFile(cli)) << cli << " is missing: build it with `cargo build --bin tboost` or set TBOOST_CLI";
  const std::string dir = TempDir();
  const std::string req = dir + "/requests.jsonl";
  std::string body;
  for (auto& l : lines) body += l + "\n";
  WriteFile(req, body);
  const std::string cmd =
      cli + " batch --model '" + model + "' --requests '" + req + "' --kv-blocks 256 --threads 2 --max-batched-tokens 64" +
      extra_args;
  std::vector<CliResult> out;
  FILE* f = popen(cmd.c_str(), "r");
  EXPECT_NE(f, nullptr) << cmd;
  if (f == nullptr) return out;
  char line[1 << 16];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    const std::string s(line);
    const auto ids = s.find("\"generated_ids\":[");
    if (ids == std::string::npos) continue;
    CliResult r;
    std::stringstream nums(s.substr(ids + 17, s.find(']', ids) - ids - 17));
    std::string tok;
    while (std::getline(nums, tok, ','))
      if (!tok.empty()) r.tokens.push_back(std::stoi(tok));
    const auto fr = s.find("\"finish_reason\":\"");
    r.finish = s.substr(fr + 17, s.find('"', fr + 17) - fr - 17);
    out.push_back(r);
  }
  EXPECT_EQ(pclose(f), 0) << cmd;
  std::remove(req.c_str());
  rmdir(dir.c_str());
  return out;
}

TEST(RustApi, SameTokensAsTheRustEngineOnGoldenModels) {
  struct Req {
    Tokens prompt;
    tboost_sampling_params sp;
    std::vector<Tokens> stops;
    std::string json;
  };
  for (const char* name : {"llama_gqa", "llama_hd24", "mistral", "mixtral", "qwen2"}) {
    SCOPED_TRACE(name);
    std::vector<Req> reqs;
    for (int k = 0; k < 6; ++k) {
      Req r;
      r.prompt = Prompt(k, 3 + 5 * k);
      r.sp = Params(8 + k);
      // The CLI's default temperature is 1 (the Rust SamplingParams default): say 0 for greedy.
      std::string extra = ",\"temperature\":0";
      if (k % 3 == 1) {
        r.sp.temperature = 0.9f;
        r.sp.seed = 100 + k;
        r.sp.top_k = 40;
        r.sp.top_p = 0.9f;
        extra = ",\"temperature\":0.9,\"seed\":" + std::to_string(100 + k) + ",\"top_k\":40,\"top_p\":0.9";
      } else if (k % 3 == 2) {
        r.sp.temperature = 1.0f;
        r.sp.seed = 7;
        r.sp.min_p = 0.05f;
        r.sp.repetition_penalty = 1.3f;
        r.sp.presence_penalty = 0.5f;
        r.sp.frequency_penalty = 0.25f;
        extra =
            ",\"temperature\":1.0,\"seed\":7,\"min_p\":0.05,\"repetition_penalty\":1.3,"
            "\"presence_penalty\":0.5,\"frequency_penalty\":0.25";
      }
      if (k == 3) {
        r.stops = {Tokens{11, 12}, Tokens{r.prompt[0]}};
        extra += ",\"stop\":[[11,12],[" + std::to_string(r.prompt[0]) + "]]";
      }
      std::string toks;
      for (size_t j = 0; j < r.prompt.size(); ++j) toks += (j ? "," : "") + std::to_string(r.prompt[j]);
      r.json = "{\"tokens\":[" + toks + "],\"max_tokens\":" + std::to_string(8 + k) + ",\"ignore_eos\":true" + extra + "}";
      reqs.push_back(r);
    }
    std::vector<std::string> lines;
    for (auto& r : reqs) lines.push_back(r.json);
    const auto want = RunCli(Golden(name), lines);
    ASSERT_EQ(want.size(), reqs.size());

    Model m(Golden(name));
    Config cfg{{"threads", "2"}, {"kv_cache_blocks", "256"}, {"max_batched_tokens", "64"}};
    Engine e(m.p, cfg.p);
    std::vector<tboost_request_id> ids;
    for (auto& r : reqs) ids.push_back(Enqueue(e.p, r.prompt, r.sp, r.stops));
    RunToCompletion(e.p);
    for (size_t i = 0; i < reqs.size(); ++i) {
      const auto evs = ReadAll(e.p, ids[i]);
      ExpectWellFormed(evs, ids[i]);
      EXPECT_EQ(TokensOf(evs), want[i].tokens) << "request " << i;
      EXPECT_EQ(tboost_finish_reason_name(evs.back().finish), want[i].finish) << "request " << i;
    }
  }
}

// ---- the Ascend backend through the C ABI, on the CANN SIMULATOR (not an NPU) ---------------

std::string AscendSimulator() {
  const char* env = std::getenv("TBOOST_ASCEND_SIM");
  return env != nullptr ? env : TBOOST_ASCEND_SIM_DEFAULT;
}

// `backend` = "ascend" through the config keys: the plan names FusedInferAttentionScore and the
// simulator, and the tokens equal the Rust engine's (`tboost batch --backend ascend`) on the same
// simulated device. ctest runs each test in its own process, so this one points the CANN search
// path at the simulator for itself (the backend `auto` never picks the simulator anyway).
TEST(Ascend, BackendKeyRunsOnTheSimulatorWithTheRustEnginesTokens) {
  const std::string sim = AscendSimulator();
  ASSERT_TRUE(IsFile(sim + "/lib64/libascendcl.so"))
      << "the CANN simulator is not at " << sim
      << ": build it with scripts/build-ascend-sim.sh and set TBOOST_ASCEND_SIM to the directory it prints";
  ASSERT_EQ(setenv("ASCEND_HOME_PATH", sim.c_str(), 1), 0);
  Config cfg{{"backend", "ascend"}, {"threads", "2"}, {"kv_cache_blocks", "8"}, {"max_batched_tokens", "64"}};
  Model m(Golden("llama_gqa"), cfg.p);
  Engine e(m.p, cfg.p);
  ASSERT_NE(e.p, nullptr) << LastError();
  const std::string plan = PlanJson(e.p);
  EXPECT_NE(plan.find("\"backend\":\"ascend\""), std::string::npos) << plan.substr(0, 400);
  EXPECT_NE(plan.find("FusedInferAttentionScore"), std::string::npos);
  EXPECT_NE(plan.find("SIMULATOR"), std::string::npos);
  std::vector<Tokens> prompts;
  std::vector<std::string> lines;
  for (int k = 0; k < 4; ++k) {
    prompts.push_back(Prompt(k, 3 + 5 * k));
    std::string toks;
    for (size_t j = 0; j < prompts.back().size(); ++j) toks += (j ? "," : "") + std::to_string(prompts.back()[j]);
    lines.push_back("{\"tokens\":[" + toks + "],\"max_tokens\":8,\"ignore_eos\":true,\"temperature\":0}");
  }
  const auto want = RunCli(Golden("llama_gqa"), lines, " --backend ascend --block-size 128");
  ASSERT_EQ(want.size(), prompts.size());
  std::vector<tboost_request_id> ids;
  for (auto& p : prompts) ids.push_back(Enqueue(e.p, p, Params(8)));
  RunToCompletion(e.p);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto evs = ReadAll(e.p, ids[i]);
    ExpectWellFormed(evs, ids[i]);
    EXPECT_EQ(TokensOf(evs), want[i].tokens) << "request " << i;
    EXPECT_EQ(tboost_finish_reason_name(evs.back().finish), want[i].finish) << "request " << i;
  }
}

// ---- random calls from several threads -----------------------------------------------------

// A bounded, seeded random mix of valid and invalid calls from several threads (one of them
// stepping) on shared handles. Whatever happens, every call returns a known status and the
// process neither crashes nor (under ASan) touches memory it should not.
TEST(Fuzz, SeededRandomCallsNeverCrash) {
  Model m(Golden("llama_gqa"));
  Config cfg{{"threads", "1"}, {"kv_cache_blocks", "48"}, {"max_seqs", "8"}, {"max_batched_tokens", "32"},
             {"queue_limit", "24"}};
  Engine e(m.p, cfg.p);
  tboost_engine* dead = nullptr;
  ASSERT_OK(tboost_engine_new(m.p, cfg.p, &dead));
  ASSERT_OK(tboost_engine_free(dead));  // a freed handle, used below on purpose
  std::atomic<uint64_t> max_id{1};
  std::atomic<int> calls{0};
  constexpr int kThreads = 4, kOps = 1500;
  auto known = [](tboost_status s) { return s >= TBOOST_OK && s <= TBOOST_ERR_REENTRANT; };
  auto worker = [&](int t) {
    std::mt19937_64 rng(0x7b005700ULL + static_cast<uint64_t>(t));
    auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
    for (int op = 0; op < kOps; ++op) {
      tboost_engine* target = pick(20) == 0 ? dead : e.p;
      const tboost_request_id id = rng() % (max_id.load() + 3);
      tboost_status s = TBOOST_OK;
      switch (pick(11)) {
        case 0: {
          Tokens prompt(static_cast<size_t>(pick(40)));
          for (auto& tok : prompt) tok = pick(10) == 0 ? 700 - pick(1400) : pick(640);
          tboost_sampling_params sp = Params(static_cast<uint32_t>(pick(30)), pick(3) == 0 ? -1.0f : 0.7f, rng());
          sp.top_k = pick(8) - 1;
          sp.logprobs = pick(4) - 2;
          if (pick(10) == 0) sp.struct_size = static_cast<uint32_t>(pick(80));
          Tokens stop(static_cast<size_t>(pick(3)), static_cast<int32_t>(pick(640)));
          std::vector<size_t> lens;
          if (!stop.empty()) lens.push_back(stop.size());
          tboost_request_id got = 0;
          s = tboost_engine_enqueue(target, prompt.data(), prompt.size(), pick(10) == 0 ? nullptr : &sp, stop.data(),
                                    lens.data(), lens.size(), &got);
          if (s == TBOOST_OK) {
            uint64_t cur = max_id.load();
            while (got > cur && !max_id.compare_exchange_weak(cur, got)) {
            }
          }
          break;
        }
        case 1:
          s = tboost_engine_cancel(target, id);
          break;
        case 2: {
          const size_t cap = static_cast<size_t>(pick(5));
          const size_t size = pick(8) == 0 ? static_cast<size_t>(pick(64)) : sizeof(tboost_event);
          std::vector<unsigned char> buf(cap * std::max<size_t>(size, 1));
          size_t n = 0;
          s = tboost_engine_read(target, pick(2) ? TBOOST_ANY_REQUEST : id,
                                 cap ? reinterpret_cast<tboost_event*>(buf.data()) : nullptr, size, cap, &n);
          if (s == TBOOST_OK && cap) {
            EXPECT_LE(n, cap);
          }
          break;
        }
        case 3: {
          size_t n = 0;
          s = tboost_engine_wait(target, pick(2) ? TBOOST_ANY_REQUEST : id, static_cast<uint32_t>(pick(3)), &n);
          break;
        }
        case 4: {
          tboost_stats st{};
          st.struct_size = pick(6) == 0 ? 4 : sizeof st;
          s = tboost_engine_stats(target, &st);
          break;
        }
        case 5: {
          const size_t cap = static_cast<size_t>(pick(12));
          std::vector<int32_t> toks(cap);
          size_t n = 0;
          tboost_finish_reason f;
          s = tboost_engine_output(target, id, cap ? toks.data() : nullptr, cap, &n, &f);
          break;
        }
        case 6: {
          const size_t cap = static_cast<size_t>(pick(300));
          std::vector<char> buf(cap);
          size_t need = 0;
          s = pick(2) ? tboost_engine_plan_json(target, cap ? buf.data() : nullptr, cap, &need)
                      : tboost_engine_request_error(target, id, cap ? buf.data() : nullptr, cap, &need);
          if (cap && s != TBOOST_ERR_INVALID_HANDLE) {
            EXPECT_LT(std::strlen(buf.data()), cap);
          }
          break;
        }
        case 7: {
          bool work = false;
          s = tboost_engine_has_work(target, &work);
          break;
        }
        case 8: {
          size_t n = 0;
          int32_t toks[4];
          s = pick(2) ? tboost_engine_tokenize(target, "abc", 3, true, toks, 4, &n)
                      : tboost_engine_detokenize(target, toks, 0, nullptr, 0, &n);
          break;
        }
        case 9: {
          size_t need = 0;
          char buf[16];
          s = tboost_last_error(pick(2) ? buf : nullptr, pick(2) ? sizeof buf : 0, &need);
          break;
        }
        default:
          s = tboost_engine_step(target, nullptr);  // mostly BUSY against the stepper
          break;
      }
      EXPECT_TRUE(known(s)) << "status " << s;
      ++calls;
    }
  };
  std::atomic<bool> stop{false};
  std::thread stepper([&] {
    while (!stop.load()) {
      const tboost_status s = tboost_engine_step(e.p, nullptr);
      EXPECT_TRUE(s == TBOOST_OK || s == TBOOST_ERR_BUSY) << Name(s) << ": " << LastError();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  stop = true;
  stepper.join();
  EXPECT_EQ(calls.load(), kThreads * kOps);
  RunToCompletion(e.p);
  tboost_stats st{};
  st.struct_size = sizeof st;
  ASSERT_OK(tboost_engine_stats(e.p, &st));
  EXPECT_EQ(st.kv_blocks_used, 0u);
  EXPECT_EQ(st.waiting + st.running, 0u);
}

// ---- operator API ---------------------------------------------------------------------

// A contiguous tensor over a whole buffer.
tboost_tensor Tensor(tboost_buffer* b, std::vector<uint64_t> shape) {
  tboost_tensor t{};
  EXPECT_STATUS(TBOOST_OK, tboost_tensor_init(&t, b, shape.data(), shape.size()));
  return t;
}

struct OpBackend {
  tboost_backend* p = nullptr;
  OpBackend() { EXPECT_STATUS(TBOOST_OK, tboost_backend_open("cpu", 1, &p)); }
  ~OpBackend() { tboost_backend_free(p); }
  tboost_buffer* Alloc(tboost_dtype d, std::vector<uint64_t> shape) {
    tboost_buffer* b = nullptr;
    EXPECT_STATUS(TBOOST_OK, tboost_backend_alloc(p, d, shape.data(), shape.size(), &b));
    bufs.push_back(b);
    return b;
  }
  tboost_buffer* Weight(std::vector<uint64_t> shape, const std::vector<float>& v) {
    tboost_buffer* b = nullptr;
    EXPECT_STATUS(TBOOST_OK, tboost_backend_upload_weight(p, TBOOST_DTYPE_F32, shape.data(), shape.size(), v.data(),
                                                          v.size() * sizeof(float), &b));
    bufs.push_back(b);
    return b;
  }
  void Put(const tboost_tensor& t, std::vector<float> v) {
    EXPECT_STATUS(TBOOST_OK, tboost_backend_copy(p, &t, v.data(), v.size() * sizeof(float), TBOOST_COPY_HOST_TO_BACKEND));
  }
  std::vector<float> Get(const tboost_tensor& t, size_t n) {
    std::vector<float> v(n);
    EXPECT_STATUS(TBOOST_OK, tboost_backend_copy(p, &t, v.data(), n * sizeof(float), TBOOST_COPY_BACKEND_TO_HOST));
    return v;
  }
  std::vector<tboost_buffer*> bufs;
  void FreeBuffers() {
    for (auto* b : bufs) EXPECT_STATUS(TBOOST_OK, tboost_buffer_free(b));
    bufs.clear();
  }
};

// RMSNorm parameters over 4 values with eps 0, gain and activations of `d`.
tboost_norm_params Norm4(tboost_dtype d) {
  tboost_norm_params np{};
  np.struct_size = sizeof np;
  np.gain_dtype = d;
  np.dim = 4;
  np.eps = 0.0f;
  np.act_dtype = d;
  return np;
}

double Silu(double v) { return v / (1.0 + std::exp(-v)); }

// The matmul cases' parameters: `n` outputs of `k` inputs, weight dtype `w`, activations `act`
// (-1: the backend's), exact, no bias, the default tiling. Their values: x (2 x 3) = kMmX,
// weight = kMmW, so x · wᵀ = (6, -0.5; -1, -2), exact even in f16; up = kMmUp, x · upᵀ =
// (1.5, 3; 0, 1).
tboost_matmul_params MatmulParams(int32_t w, uint64_t n, uint64_t k, int32_t act) {
  tboost_matmul_params mp{};
  mp.struct_size = sizeof mp;
  mp.weight_dtype = w;
  mp.n = n;
  mp.k = k;
  mp.act_dtype = act;
  return mp;
}
const std::vector<float> kMmX = {1, 1, 1, 2, 0, -1}, kMmW = {1, 2, 3, -1, 0.5f, 0}, kMmUp = {0.5f, 0, 1, 1, 1, 1};
const std::vector<float> kMmY = {6, -0.5f, -1, -2};

// TBOOST_OP_MATMUL_SWIGLU over those values (2 outputs of 3 inputs), and its result in double.
tboost_matmul_swiglu_params SwigluParams(int32_t w, int32_t act) {
  tboost_matmul_swiglu_params sp{};
  sp.struct_size = sizeof sp;
  sp.weight_dtype = w;
  sp.n = 2;
  sp.k = 3;
  sp.act_dtype = act;
  return sp;
}
const std::vector<double> kSwigluY = {Silu(6) * 1.5, Silu(-0.5) * 3, Silu(-1) * 0, Silu(-2) * 1};

// Attention: one head of 16 over a paged cache of `block` tokens per block, scale 1.
tboost_attention_params Attn16(int32_t kind, uint32_t block, tboost_dtype d, uint64_t max_context) {
  tboost_attention_params ap{};
  ap.struct_size = sizeof ap;
  ap.kind = kind;
  ap.heads = 1;
  ap.kv_heads = 1;
  ap.head_dim = 16;
  ap.block_size = block;
  ap.kv_dtype = d;
  ap.act_dtype = d;
  ap.max_context = max_context;
  ap.scale = 1.0f;
  return ap;
}

// The attention cases' data: one block of `block` positions holding k0 = 2·e0, k1 = -2·e0,
// v0 = (0, 1, ..., 15), v1 = 1; query rows q0 = e0 (sees position 0 only: causal) and
// q1 = 0.5·e0 (scores 1 and -1). `want`: row 0 = v0, row 1 = w0·v0 + (1 - w0)·v1 with
// w0 = softmax(1, -1)[0].
struct AttnCase {
  std::vector<float> q = std::vector<float>(32, 0.0f), k, v;
  std::vector<double> want;
  explicit AttnCase(size_t block) : k(block * 16, 0.0f), v(block * 16, 0.0f) {
    q[0] = 1.0f;
    q[16] = 0.5f;
    k[0] = 2.0f;
    k[16] = -2.0f;
    const double w0 = std::exp(1.0) / (std::exp(1.0) + std::exp(-1.0));
    for (int d = 0; d < 16; ++d) {
      v[d] = static_cast<float>(d);
      v[16 + d] = 1.0f;
      want.push_back(d);
    }
    for (int d = 0; d < 16; ++d) want.push_back(w0 * d + (1.0 - w0));
  }
};

// MoE routing of kLogits (2 tokens, 3 experts) to the top 2, renormalized: kRouteIds and, as
// e^a / (e^a + e^b) = 1 / (1 + e^(b - a)), kRouteW.
tboost_moe_route_params Route3(tboost_dtype d) {
  tboost_moe_route_params rp{};
  rp.struct_size = sizeof rp;
  rp.experts = 3;
  rp.top_k = 2;
  rp.act_dtype = d;
  return rp;
}
const std::vector<float> kLogits = {1, 3, 2, 0, 1, 5};
const std::vector<uint32_t> kRouteIds = {1, 2, 2, 1};
const std::vector<double> kRouteW = {1 / (1 + std::exp(-1.0)), 1 / (1 + std::exp(1.0)), 1 / (1 + std::exp(-4.0)),
                                     1 / (1 + std::exp(4.0))};

// Grouped experts, hidden 2, inter 1: kExperts holds gate, up and down of each; one token
// x = (1, 2) through both experts with weights (0.25, 0.75) gives kGroupedY.
tboost_moe_grouped_params Grouped2(int32_t w, int32_t act) {
  tboost_moe_grouped_params gp{};
  gp.struct_size = sizeof gp;
  gp.experts = 2;
  gp.top_k = 2;
  gp.weight_dtype = w;
  gp.hidden = 2;
  gp.inter = 1;
  gp.act_dtype = act;
  return gp;
}
const std::vector<std::vector<float>> kExperts[] = {{{1, 0}, {0, 1}, {1, 2}}, {{0, 1}, {1, 1}, {-1, 1}}};
const double kH0 = Silu(1.0) * 2.0, kH1 = Silu(2.0) * 3.0;
const std::vector<double> kGroupedY = {0.25 * kH0 - 0.75 * kH1, 0.25 * 2 * kH0 + 0.75 * kH1};

TEST(OpApi, MatmulThroughTheCApiEqualsAHandComputation) {
  OpBackend be;
  const size_t m = 2, k = 3, n = 2;
  tboost_matmul_params mp = MatmulParams(TBOOST_DTYPE_F32, n, k, -1);
  mp.bias = 1;
  tboost_op* op = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MATMUL, &mp, &op));
  bool ok = false;
  size_t need = 0;
  char why[128];
  ASSERT_OK(tboost_op_supports(op, &ok, why, sizeof why, &need));
  EXPECT_TRUE(ok);
  EXPECT_STREQ(why, "");
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {m, k}), {m, k});
  tboost_tensor w = Tensor(be.Weight({n, k}, kMmW), {n, k});
  tboost_tensor bias = Tensor(be.Weight({n}, {10, -10}), {n});
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {m, n}), {m, n});
  be.Put(x, kMmX);
  tboost_tensor ins[] = {x, w, bias};
  size_t ws = 99;
  ASSERT_OK(tboost_op_workspace_size(op, ins, 3, &y, 1, &ws));
  EXPECT_EQ(ws, 0u);
  ASSERT_OK(tboost_op_execute(op, ins, 3, &y, 1, nullptr));
  // y = x · wᵀ + b: row 0 = (1+2+3+10, -1+0.5+0-10), row 1 = (2-3+10, -2+0-10).
  EXPECT_EQ(be.Get(y, m * n), (std::vector<float>{16, -10.5f, 9, -12}));

  // A bad shape is TBOOST_ERR_INVALID_ARGUMENT naming the op and the tensor.
  tboost_tensor bad_x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {m, 4}), {m, 4});
  tboost_tensor bad_ins[] = {bad_x, w, bias};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(op, bad_ins, 3, &y, 1, nullptr));
  EXPECT_NE(LastError().find("`matmul.x`: shape [2, 4]: expected [*, 3]"), std::string::npos) << LastError();
  // A wrong tensor count.
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(op, ins, 2, &y, 1, nullptr));
  EXPECT_NE(LastError().find("`matmul.inputs`: got 2 tensors, expected 3"), std::string::npos) << LastError();
  // Strides that are not contiguous name the stride.
  tboost_tensor strided = x;
  strided.strides[0] = 7;
  tboost_tensor strided_ins[] = {strided, w, bias};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(op, strided_ins, 3, &y, 1, nullptr));
  EXPECT_NE(LastError().find("stride 7 of dimension 0"), std::string::npos) << LastError();
  ASSERT_OK(tboost_op_free(op));
  be.FreeBuffers();
}

TEST(OpApi, RmsnormThroughTheCApiEqualsAHandComputation) {
  OpBackend be;
  tboost_norm_params np = Norm4(TBOOST_DTYPE_F32);
  tboost_op* op = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_RMSNORM, &np, &op));
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4}), {1, 4});
  tboost_tensor g = Tensor(be.Weight({4}, {1, 2, 1, 0.5f}), {4});
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4}), {1, 4});
  // x = (1, 1, 3, 5): mean square (1+1+9+25)/4 = 9, rms 3.
  be.Put(x, {1, 1, 3, 5});
  tboost_tensor ins[] = {x, g};
  ASSERT_OK(tboost_op_execute(op, ins, 2, &y, 1, nullptr));
  const std::vector<float> got = be.Get(y, 4), want = {1.0f / 3, 2.0f / 3, 1.0f, 5.0f / 6};
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << i;
  // A gain of the wrong dtype is named.
  tboost_tensor x16 = Tensor(be.Alloc(TBOOST_DTYPE_F16, {1, 4}), {1, 4});
  tboost_tensor bad[] = {x16, g};
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(op, bad, 2, &y, 1, nullptr));
  EXPECT_NE(LastError().find("`rmsnorm.x`: dtype f16: expected f32"), std::string::npos) << LastError();
  ASSERT_OK(tboost_op_free(op));
  be.FreeBuffers();
}

TEST(OpApi, BadHandlesAndParamsGiveTheDocumentedStatus) {
  OpBackend be;
  tboost_op* op = nullptr;
  tboost_norm_params np{};
  np.struct_size = sizeof np;
  np.dim = 4;
  np.act_dtype = -1;
  // A freed operation, a bogus backend, a freed buffer.
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_RMSNORM, &np, &op));
  ASSERT_OK(tboost_op_free(op));
  bool ok = false;
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_op_supports(op, &ok, nullptr, 0, nullptr));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_op_execute(op, nullptr, 0, nullptr, 0, nullptr));
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_op_free(op));
  auto* bogus = reinterpret_cast<tboost_backend*>(&np);
  tboost_buffer* b = nullptr;
  const uint64_t shape[] = {4};
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_backend_alloc(bogus, TBOOST_DTYPE_F32, shape, 1, &b));
  EXPECT_STATUS(TBOOST_ERR_NULL_POINTER, tboost_backend_alloc(be.p, TBOOST_DTYPE_F32, shape, 1, nullptr));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_backend_alloc(be.p, 99, shape, 1, &b));
  ASSERT_OK(tboost_backend_alloc(be.p, TBOOST_DTYPE_F32, shape, 1, &b));
  tboost_tensor t = Tensor(b, {4});
  ASSERT_OK(tboost_buffer_free(b));
  float host[4] = {};
  EXPECT_STATUS(TBOOST_ERR_INVALID_HANDLE, tboost_backend_copy(be.p, &t, host, sizeof host, TBOOST_COPY_BACKEND_TO_HOST));
  // Unknown kinds, zero sizes and wrong struct sizes are invalid arguments.
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, 1234, &np, &op));
  tboost_norm_params zero = np;
  zero.dim = 0;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_RMSNORM, &zero, &op));
  EXPECT_NE(LastError().find("rmsnorm.dim"), std::string::npos) << LastError();
  tboost_norm_params small = np;
  small.struct_size = 4;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_RMSNORM, &small, &op));
  tboost_backend* none = nullptr;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_backend_open("tpu", 1, &none));
  EXPECT_EQ(none, nullptr);
}

TEST(OpApi, AttentionWithATileThroughTheCApi) {
  OpBackend be;
  // One sequence of two rows over two positions, one head of 16, block_size 4.
  tboost_attention_params ap = Attn16(TBOOST_ATTENTION_FLASH, 4, TBOOST_DTYPE_F32, 64);
  ap.tile_kv = 16;
  tboost_op* op = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_ATTENTION, &ap, &op));
  const AttnCase c(4);
  tboost_tensor tq = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 16}), {2, 16});
  tboost_tensor tk = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4, 1, 16}), {1, 4, 1, 16});
  tboost_tensor tv = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4, 1, 16}), {1, 4, 1, 16});
  be.Put(tq, c.q);
  be.Put(tk, c.k);
  be.Put(tv, c.v);
  tboost_buffer* sb = be.Alloc(TBOOST_DTYPE_U32, {1, 3});
  tboost_buffer* bb = be.Alloc(TBOOST_DTYPE_U32, {1, 1});
  tboost_tensor ts = Tensor(sb, {1, 3}), tb = Tensor(bb, {1, 1});
  uint32_t seqs[3] = {0, 2, 2}, table[1] = {0};
  ASSERT_OK(tboost_backend_copy(be.p, &ts, seqs, sizeof seqs, TBOOST_COPY_HOST_TO_BACKEND));
  ASSERT_OK(tboost_backend_copy(be.p, &tb, table, sizeof table, TBOOST_COPY_HOST_TO_BACKEND));
  tboost_tensor out = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 16}), {2, 16});
  tboost_tensor ins[] = {tq, tk, tv, ts, tb};
  ASSERT_OK(tboost_op_execute(op, ins, 5, &out, 1, nullptr));
  const std::vector<float> got = be.Get(out, 32);
  for (int i = 0; i < 32; ++i) EXPECT_NEAR(got[i], c.want[i], 1e-5) << i;
  ASSERT_OK(tboost_op_free(op));
  // A tile the kernel does not take, and flash with a head_dim it does not take.
  ap.tile_kv = 48;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_ATTENTION, &ap, &op));
  EXPECT_NE(LastError().find("`flash_attention.tile_kv`: 48 is not a power of two in 16..=256"), std::string::npos)
      << LastError();
  ap.tile_kv = 0;
  ap.head_dim = 24;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_ATTENTION, &ap, &op));
  bool ok = true;
  char why[128];
  size_t need = 0;
  ASSERT_OK(tboost_op_supports(op, &ok, why, sizeof why, &need));
  EXPECT_FALSE(ok);
  EXPECT_STREQ(why, "head_dim=24 is not a multiple of 16");
  EXPECT_STATUS(TBOOST_ERR_UNSUPPORTED, tboost_op_execute(op, ins, 5, &out, 1, nullptr));
  ASSERT_OK(tboost_op_free(op));
  be.FreeBuffers();
}

TEST(OpApi, AttentionTileIsAnEngineKeyReportedInThePlan) {
  Config cfg;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "tiling.attention.tile_kv", 48));
  EXPECT_NE(LastError().find("tile_kv=48 is not a power of two in 16..=256"), std::string::npos) << LastError();
  ASSERT_OK(tboost_config_set_int(cfg.p, "tiling.attention.tile_kv", 128));
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_config_to_json(cfg.p, nullptr, 0, &need));
  std::string json(need, '\0');
  ASSERT_OK(tboost_config_to_json(cfg.p, json.data(), json.size(), &need));
  EXPECT_NE(json.find("\"tiling.attention.tile_kv\":128"), std::string::npos) << json;
  ASSERT_OK(tboost_config_set_str(cfg.p, "backend", "cpu"));
  Model m(Golden("mistral"), cfg.p);
  ASSERT_NE(m.p, nullptr);
  need = 0;
  EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_model_info_json(m.p, nullptr, 0, &need));
  std::string info(need, '\0');
  ASSERT_OK(tboost_model_info_json(m.p, info.data(), info.size(), &need));
  EXPECT_NE(info.find("\"attention_tile_kv\":128"), std::string::npos) << info;
}

TEST(OpApi, EmbedAndRopeThroughTheCApi) {
  OpBackend be;
  tboost_embed_params ep{};
  ep.struct_size = sizeof ep;
  ep.table_dtype = TBOOST_DTYPE_F32;
  ep.vocab = 3;
  ep.hidden = 4;
  ep.act_dtype = -1;
  tboost_op* emb = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_EMBED, &ep, &emb));
  tboost_tensor table = Tensor(be.Weight({3, 4}, {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}), {3, 4});
  tboost_tensor ids = Tensor(be.Alloc(TBOOST_DTYPE_U32, {2}), {2});
  uint32_t id_v[2] = {2, 0};
  ASSERT_OK(tboost_backend_copy(be.p, &ids, id_v, sizeof id_v, TBOOST_COPY_HOST_TO_BACKEND));
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 4}), {2, 4});
  tboost_tensor ein[] = {ids, table};
  ASSERT_OK(tboost_op_execute(emb, ein, 2, &y, 1, nullptr));
  EXPECT_EQ(be.Get(y, 8), (std::vector<float>{20, 21, 22, 23, 0, 1, 2, 3}));
  id_v[0] = 3;  // out of range
  ASSERT_OK(tboost_backend_copy(be.p, &ids, id_v, sizeof id_v, TBOOST_COPY_HOST_TO_BACKEND));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(emb, ein, 2, &y, 1, nullptr));
  EXPECT_NE(LastError().find("ids[0] = 3 is not below vocab 3"), std::string::npos) << LastError();
  ASSERT_OK(tboost_op_free(emb));

  // RoPE on one head of 2: position 0 is the identity, position 1 rotates by 1 radian.
  tboost_rope_params rp{};
  rp.struct_size = sizeof rp;
  rp.heads = 1;
  rp.head_dim = 2;
  rp.rot_dim = 0;
  rp.theta = 10000.0;
  rp.style = 0;
  rp.act_dtype = TBOOST_DTYPE_F32;
  tboost_op* rope = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_ROPE, &rp, &rope));
  tboost_tensor pos = Tensor(be.Alloc(TBOOST_DTYPE_U32, {2}), {2});
  uint32_t pos_v[2] = {0, 1};
  ASSERT_OK(tboost_backend_copy(be.p, &pos, pos_v, sizeof pos_v, TBOOST_COPY_HOST_TO_BACKEND));
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 1, 2}), {2, 1, 2});
  be.Put(x, {1, 0, 1, 0});
  size_t ws_bytes = 0;
  ASSERT_OK(tboost_op_workspace_size(rope, &pos, 1, &x, 1, &ws_bytes));
  EXPECT_EQ(ws_bytes, 2u * 2u * 1u * sizeof(float));
  tboost_tensor ws = Tensor(be.Alloc(TBOOST_DTYPE_F32, {ws_bytes / sizeof(float)}), {ws_bytes / sizeof(float)});
  ASSERT_OK(tboost_op_execute(rope, &pos, 1, &x, 1, &ws));
  const std::vector<float> got = be.Get(x, 4);
  EXPECT_NEAR(got[0], 1.0, 1e-6);
  EXPECT_NEAR(got[1], 0.0, 1e-6);
  EXPECT_NEAR(got[2], std::cos(1.0), 1e-6);
  EXPECT_NEAR(got[3], std::sin(1.0), 1e-6);
  ASSERT_OK(tboost_op_free(rope));
  rp.style = 7;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_ROPE, &rp, &rope));
  be.FreeBuffers();
}

// TBOOST_OP_MATMUL_SWIGLU: y = silu(x · gateᵀ) * (x · upᵀ) in one kernel, against a hand
// computation in double (f32 dot products of 3 exact terms, then silu and the product: within
// 1e-6 relative).
TEST(OpApi, MatmulSwigluThroughTheCApiEqualsAHandComputation) {
  OpBackend be;
  tboost_matmul_swiglu_params sp = SwigluParams(TBOOST_DTYPE_F32, -1);
  tboost_op* op = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MATMUL_SWIGLU, &sp, &op));
  bool ok = false;
  char why[128];
  ASSERT_OK(tboost_op_supports(op, &ok, why, sizeof why, nullptr));
  EXPECT_TRUE(ok) << why;
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 3}), {2, 3});
  tboost_tensor gate = Tensor(be.Weight({2, 3}, kMmW), {2, 3});
  tboost_tensor up = Tensor(be.Weight({2, 3}, kMmUp), {2, 3});
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 2}), {2, 2});
  be.Put(x, kMmX);
  tboost_tensor ins[] = {x, gate, up};
  ASSERT_OK(tboost_op_execute(op, ins, 3, &y, 1, nullptr));
  const std::vector<float> got = be.Get(y, 4);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], kSwigluY[i], 1e-6 * std::max(1.0, std::fabs(kSwigluY[i]))) << i;
  ASSERT_OK(tboost_op_free(op));
  // The same case with a tiling gives the same bits; a tiling out of range and a struct_size
  // below the first version are refused at creation, naming what is wrong.
  sp.tiling.panel_rows = 16;
  sp.tiling.act_rows = 1;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MATMUL_SWIGLU, &sp, &op));
  tboost_tensor y2 = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 2}), {2, 2});
  ASSERT_OK(tboost_op_execute(op, ins, 3, &y2, 1, nullptr));
  EXPECT_EQ(be.Get(y2, 4), got);
  ASSERT_OK(tboost_op_free(op));
  sp.tiling.act_rows = 0;
  sp.tiling.panel_rows = 24;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_MATMUL_SWIGLU, &sp, &op));
  EXPECT_NE(LastError().find("`matmul_swiglu.panel_rows`: 24 is not a multiple of 16 in 16..=4096"), std::string::npos)
      << LastError();
  sp.tiling.panel_rows = 0;
  sp.struct_size = 40;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_MATMUL_SWIGLU, &sp, &op));
  EXPECT_NE(LastError().find("below the 48 bytes of its first version"), std::string::npos) << LastError();
  be.FreeBuffers();
}

// The CPU kernels' work split: engine keys tiling.matmul.* / tiling.moe.* and op parameters
// (tboost_matmul_tiling, tboost_moe_tiling). Values out of range are TBOOST_ERR_INVALID_ARGUMENT
// naming the key or the op and field with the accepted range, and leave the config unchanged;
// values in range are reported by the config and by the plan, and change no bit.
TEST(OpApi, TilingKeysAndOpFieldsAreRangeCheckedAndReported) {
  Config cfg;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "tiling.matmul.panel_rows", 20));
  EXPECT_NE(LastError().find("`tiling.matmul.panel_rows`: panel_rows=20 is not a multiple of 16 in 16..=4096"),
            std::string::npos)
      << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "tiling.matmul.panel_rows", 8192));
  EXPECT_NE(LastError().find("`tiling.matmul.panel_rows` = 8192 is out of range [16, 4096]"), std::string::npos)
      << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_str(cfg.p, "tiling.moe.parallel_expert_batches", "0"));
  EXPECT_NE(LastError().find("`tiling.moe.parallel_expert_batches` = 0 is out of range [1, 64]"), std::string::npos)
      << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT,
                tboost_config_set_int(cfg.p, "tiling.matmul.decode_task_min_bytes", 5000));
  EXPECT_NE(LastError().find("decode_task_min_bytes=5000 is not a multiple of 1024 in 4096..=16777216"),
            std::string::npos)
      << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_config_set_int(cfg.p, "tiling.matmul.panel", 32));
  EXPECT_NE(LastError().find("unknown config key `tiling.matmul.panel`"), std::string::npos) << LastError();
  size_t need = 0;
  tboost_config_to_json(cfg.p, nullptr, 0, &need);
  std::string json(need, '\0');
  ASSERT_OK(tboost_config_to_json(cfg.p, json.data(), json.size(), &need));
  EXPECT_NE(json.find("\"tiling.matmul.panel_rows\":\"auto\""), std::string::npos) << json;
  ASSERT_OK(tboost_config_set_int(cfg.p, "tiling.matmul.panel_rows", 32));
  ASSERT_OK(tboost_config_set_str(cfg.p, "tiling.moe.expert_batch_tokens", "4"));
  tboost_config_to_json(cfg.p, nullptr, 0, &need);
  json.assign(need, '\0');
  ASSERT_OK(tboost_config_to_json(cfg.p, json.data(), json.size(), &need));
  EXPECT_NE(json.find("\"tiling.matmul.panel_rows\":32"), std::string::npos) << json;
  EXPECT_NE(json.find("\"tiling.moe.expert_batch_tokens\":4"), std::string::npos) << json;
  ASSERT_OK(tboost_config_set_str(cfg.p, "backend", "cpu"));
  Model m(Golden("mixtral"), cfg.p);
  ASSERT_NE(m.p, nullptr);
  need = 0;
  tboost_model_info_json(m.p, nullptr, 0, &need);
  std::string info(need, '\0');
  ASSERT_OK(tboost_model_info_json(m.p, info.data(), info.size(), &need));
  // Key order inside an object is not part of the contract: look for each key in its object.
  const auto object = [&](const char* key) {
    const size_t at = info.find(std::string("\"") + key + "\":{");
    return at == std::string::npos ? std::string() : info.substr(at, info.find('}', at) - at + 1);
  };
  const std::string mt = object("matmul_tiling"), moe = object("moe_tiling");
  for (const char* t : {"\"panel_rows\":32", "\"act_rows\":null", "\"tasks_per_thread\":null"})
    EXPECT_NE(mt.find(t), std::string::npos) << t << " not in " << mt;
  for (const char* t : {"\"expert_batch_tokens\":4", "\"parallel_expert_batches\":null"})
    EXPECT_NE(moe.find(t), std::string::npos) << t << " not in " << moe;

  // The op parameter: out of range named at creation; a version-1 struct_size (40) takes the
  // defaults; in range, the hand computation of MatmulThroughTheCApiEqualsAHandComputation.
  OpBackend be;
  tboost_matmul_params mp = MatmulParams(TBOOST_DTYPE_F32, 2, 3, -1);
  mp.tiling.tasks_per_thread = 65;
  tboost_op* op = nullptr;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_MATMUL, &mp, &op));
  EXPECT_NE(LastError().find("`matmul.tasks_per_thread`: 65 is not in 1..=64"), std::string::npos) << LastError();
  tboost_matmul_params v1 = mp;
  v1.struct_size = 40;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MATMUL, &v1, &op));
  ASSERT_OK(tboost_op_free(op));
  mp.tiling.tasks_per_thread = 1;
  mp.tiling.panel_rows = 16;
  mp.tiling.act_rows = 1;
  mp.tiling.decode_task_min_bytes = 4096;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MATMUL, &mp, &op));
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 3}), {2, 3});
  tboost_tensor w = Tensor(be.Weight({2, 3}, kMmW), {2, 3});
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 2}), {2, 2});
  be.Put(x, kMmX);
  tboost_tensor ins[] = {x, w};
  ASSERT_OK(tboost_op_execute(op, ins, 2, &y, 1, nullptr));
  EXPECT_EQ(be.Get(y, 4), kMmY);
  ASSERT_OK(tboost_op_free(op));
  tboost_moe_grouped_params gp = Grouped2(TBOOST_DTYPE_F32, -1);
  gp.tiling.expert_batch_tokens = 70000;
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_create(be.p, TBOOST_OP_MOE_GROUPED, &gp, &op));
  EXPECT_NE(LastError().find("`moe_grouped.expert_batch_tokens`: 70000 is not in 1..=65536"), std::string::npos)
      << LastError();
  be.FreeBuffers();
}

}  // namespace

// MoE routing and grouped experts through the C ABI, against hand computations.
TEST(OpApi, MoeRouteAndGroupedThroughTheCApi) {
  OpBackend be;
  // Routing: softmax over 3 experts, the best 2 renormalized.
  tboost_moe_route_params rp = Route3(TBOOST_DTYPE_F32);
  tboost_op* route = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MOE_ROUTE, &rp, &route));
  tboost_tensor logits = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 3}), {2, 3});
  tboost_tensor ids = Tensor(be.Alloc(TBOOST_DTYPE_U32, {2, 2}), {2, 2});
  tboost_tensor wts = Tensor(be.Alloc(TBOOST_DTYPE_F32, {2, 2}), {2, 2});
  be.Put(logits, kLogits);
  tboost_tensor routed[] = {ids, wts};
  ASSERT_OK(tboost_op_execute(route, &logits, 1, routed, 2, nullptr));
  std::vector<uint32_t> got_ids(4);
  ASSERT_OK(tboost_backend_copy(be.p, &ids, got_ids.data(), 16, TBOOST_COPY_BACKEND_TO_HOST));
  EXPECT_EQ(got_ids, kRouteIds);
  const std::vector<float> w = be.Get(wts, 4);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(w[i], kRouteW[i], 1e-6) << i;

  // Grouped experts (kExperts): one token x = (1, 2) through both.
  tboost_moe_grouped_params gp = Grouped2(TBOOST_DTYPE_F32, TBOOST_DTYPE_F32);
  tboost_op* moe = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_MOE_GROUPED, &gp, &moe));
  std::vector<tboost_tensor> ins;
  ins.push_back(Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 2}), {1, 2}));
  ins.push_back(Tensor(be.Alloc(TBOOST_DTYPE_U32, {1, 2}), {1, 2}));
  ins.push_back(Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 2}), {1, 2}));
  for (const auto& e : kExperts) {  // uploaded consecutively: gate, up, down of each expert
    ins.push_back(Tensor(be.Weight({1, 2}, e[0]), {1, 2}));
    ins.push_back(Tensor(be.Weight({1, 2}, e[1]), {1, 2}));
    ins.push_back(Tensor(be.Weight({2, 1}, e[2]), {2, 1}));
  }
  be.Put(ins[0], {1, 2});
  uint32_t tok_ids[] = {0, 1};
  ASSERT_OK(tboost_backend_copy(be.p, &ins[1], tok_ids, sizeof tok_ids, TBOOST_COPY_HOST_TO_BACKEND));
  be.Put(ins[2], {0.25f, 0.75f});
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 2}), {1, 2});
  ASSERT_OK(tboost_op_execute(moe, ins.data(), ins.size(), &y, 1, nullptr));
  const std::vector<float> got_y = be.Get(y, 2);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(got_y[i], kGroupedY[i], 1e-5) << i;
  // An expert id out of range is refused, naming the tensor; one tensor short likewise.
  uint32_t bad_ids[] = {0, 2};
  ASSERT_OK(tboost_backend_copy(be.p, &ins[1], bad_ids, sizeof bad_ids, TBOOST_COPY_HOST_TO_BACKEND));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(moe, ins.data(), ins.size(), &y, 1, nullptr));
  EXPECT_NE(LastError().find("moe_grouped"), std::string::npos) << LastError();
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_op_execute(moe, ins.data(), ins.size() - 1, &y, 1, nullptr));
  ASSERT_OK(tboost_op_free(moe));
  ASSERT_OK(tboost_op_free(route));
  be.FreeBuffers();
}

// Custom graphs: a callback (x * 2) -> residual add with x -> RMSNorm, fused into add_rmsnorm.
static int32_t DoubleIt(void* ud, const float* const* in, const size_t* in_lens, size_t n_in, float* const* out,
                        const size_t* out_lens, size_t n_out) {
  *static_cast<int*>(ud) += 1;
  if (n_in != 1 || n_out != 1 || in_lens[0] != out_lens[0]) return 7;
  for (size_t i = 0; i < in_lens[0]; i++) out[0][i] = 2 * in[0][i];
  return 0;
}

static int32_t Fails(void*, const float* const*, const size_t*, size_t, float* const*, const size_t*, size_t) {
  return 42;
}

TEST(OpApi, GraphRunsACallbackAndFusedAddNorm) {
  OpBackend be;
  tboost_norm_params np = Norm4(TBOOST_DTYPE_F32);
  tboost_op* norm = nullptr;
  ASSERT_OK(tboost_op_create(be.p, TBOOST_OP_RMSNORM, &np, &norm));
  tboost_graph* g = nullptr;
  ASSERT_OK(tboost_graph_create(be.p, &g));
  uint64_t shape[] = {1, 4};
  ASSERT_OK(tboost_graph_add_input(g, "x", TBOOST_DTYPE_F32, shape, 2));
  tboost_tensor gain = Tensor(be.Weight({4}, {1, 1, 1, 2}), {4});
  ASSERT_OK(tboost_graph_add_constant(g, "gain", &gain));
  int calls = 0;
  const char* cb_in[] = {"x"};
  const char* cb_out[] = {"d"};
  size_t nd[] = {2};
  ASSERT_OK(tboost_graph_add_callback(g, DoubleIt, &calls, cb_in, 1, cb_out, nd, shape, 1));
  ASSERT_OK(tboost_graph_add_add(g, TBOOST_DTYPE_F32, "x", "d", "h"));
  const char* n_in[] = {"h", "gain"};
  const char* n_out[] = {"y"};
  ASSERT_OK(tboost_graph_add_op(g, norm, n_in, 2, n_out, 1));
  ASSERT_OK(tboost_op_free(norm));
  const char* outs[] = {"y"};
  ASSERT_OK(tboost_graph_set_outputs(g, outs, 1));
  ASSERT_OK(tboost_graph_build(g));
  char rep[256];
  size_t need = 0;
  ASSERT_OK(tboost_graph_fusions(g, rep, sizeof rep, &need));
  EXPECT_NE(std::string(rep).find("add_rmsnorm"), std::string::npos) << rep;
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4}), {1, 4});
  tboost_tensor y = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4}), {1, 4});
  be.Put(x, {1, -1, 1, -1});
  ASSERT_OK(tboost_graph_run(g, &x, 1, &y, 1));
  // h = x + 2x = (3, -3, 3, -3); rms = 3; y = h / 3 * gain.
  EXPECT_EQ(be.Get(y, 4), (std::vector<float>{1, -1, 1, -2}));
  EXPECT_EQ(calls, 1);
  // Wrong tensor count.
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_graph_run(g, &x, 1, &y, 0));
  ASSERT_OK(tboost_graph_free(g));
  be.FreeBuffers();
}

TEST(OpApi, GraphBadNameAndFailingCallbackAreErrors) {
  OpBackend be;
  uint64_t shape[] = {1, 4};
  size_t nd[] = {2};
  tboost_graph* g = nullptr;
  ASSERT_OK(tboost_graph_create(be.p, &g));
  ASSERT_OK(tboost_graph_add_input(g, "x", TBOOST_DTYPE_F32, shape, 2));
  const char* bad_in[] = {"nope"};
  const char* cb_out[] = {"d"};
  ASSERT_OK(tboost_graph_add_callback(g, DoubleIt, nullptr, bad_in, 1, cb_out, nd, shape, 1));
  const char* outs[] = {"d"};
  ASSERT_OK(tboost_graph_set_outputs(g, outs, 1));
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_graph_build(g));
  EXPECT_NE(LastError().find("callback#1"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("'nope' is unknown"), std::string::npos) << LastError();
  ASSERT_OK(tboost_graph_free(g));

  ASSERT_OK(tboost_graph_create(be.p, &g));
  ASSERT_OK(tboost_graph_add_input(g, "x", TBOOST_DTYPE_F32, shape, 2));
  const char* cb_in[] = {"x"};
  ASSERT_OK(tboost_graph_add_callback(g, Fails, nullptr, cb_in, 1, cb_out, nd, shape, 1));
  ASSERT_OK(tboost_graph_set_outputs(g, outs, 1));
  ASSERT_OK(tboost_graph_build(g));
  tboost_tensor x = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4}), {1, 4});
  tboost_tensor d = Tensor(be.Alloc(TBOOST_DTYPE_F32, {1, 4}), {1, 4});
  EXPECT_STATUS(TBOOST_ERR_INVALID_ARGUMENT, tboost_graph_run(g, &x, 1, &d, 1));
  EXPECT_NE(LastError().find("returned 42"), std::string::npos) << LastError();
  ASSERT_OK(tboost_graph_free(g));
  be.FreeBuffers();
}

// ---- every operator kind through the C ABI on the Ascend backend, on the CANN SIMULATOR -----
//
// Not an NPU: ascend-sim computes each aclnn op's documented math in f64 and rounds its
// outputs to f16. Each kind runs in f16 against a hand computation in double; the tolerance is
// stated per case as a number of f16 roundings (unit 2^-11 relative) of the largest magnitude
// the result goes through. Where the backend does not take a kind or a case, the test asserts
// tboost_op_supports's reason (the plan's Unsupported text: for attention it is checked against
// the plan of llama_hd24 on the same backend) and that execute is TBOOST_ERR_UNSUPPORTED.

static uint16_t ToHalf(float f) {  // normal values only
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return static_cast<uint16_t>(sign);
  const uint32_t exp = ((x >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (exp << 10) | ((x >> 13) & 0x3ff));
}
static float FromHalf(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const uint32_t v = (exp == 0 && mant == 0) ? sign : sign | ((exp - 15 + 127) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}

constexpr double kF16 = 1.0 / 2048;  // 2^-11, the f16 unit roundoff

// Points the CANN search path of this process (ctest runs each case in its own) at the simulator.
bool UseSimulator() {
  const std::string sim = AscendSimulator();
  EXPECT_TRUE(IsFile(sim + "/lib64/libascendcl.so"))
      << "the CANN simulator is not at " << sim
      << ": build it with scripts/build-ascend-sim.sh and set TBOOST_ASCEND_SIM to the directory it prints";
  return IsFile(sim + "/lib64/libascendcl.so") && setenv("ASCEND_HOME_PATH", sim.c_str(), 1) == 0;
}

// The Ascend backend on the simulator, with f16 buffers in and out. One at a time: the simulator
// keeps one device per process.
struct AscendSim {
  tboost_backend* be = nullptr;
  std::vector<tboost_buffer*> bufs;
  std::vector<tboost_op*> ops;
  AscendSim() {
    if (UseSimulator()) EXPECT_STATUS(TBOOST_OK, tboost_backend_open("ascend", 1, &be));
  }
  ~AscendSim() {
    for (auto* o : ops) EXPECT_STATUS(TBOOST_OK, tboost_op_free(o));
    for (auto* b : bufs) EXPECT_STATUS(TBOOST_OK, tboost_buffer_free(b));
    tboost_backend_free(be);
  }
  // An f16 buffer (or weight) holding `v`, as a contiguous tensor.
  tboost_tensor Half(std::vector<uint64_t> shape, const std::vector<float>& v, bool weight = false) {
    std::vector<uint16_t> h;
    for (float f : v) h.push_back(ToHalf(f));
    tboost_buffer* b = nullptr;
    if (weight) {
      EXPECT_STATUS(TBOOST_OK, tboost_backend_upload_weight(be, TBOOST_DTYPE_F16, shape.data(), shape.size(), h.data(),
                                                            h.size() * 2, &b));
    } else {
      EXPECT_STATUS(TBOOST_OK, tboost_backend_alloc(be, TBOOST_DTYPE_F16, shape.data(), shape.size(), &b));
      tboost_tensor t = Tensor(b, shape);
      EXPECT_STATUS(TBOOST_OK, tboost_backend_copy(be, &t, h.data(), h.size() * 2, TBOOST_COPY_HOST_TO_BACKEND));
    }
    bufs.push_back(b);
    return Tensor(b, shape);
  }
  tboost_tensor Zeros(std::vector<uint64_t> shape) {
    size_t n = 1;
    for (auto d : shape) n *= d;
    return Half(shape, std::vector<float>(n, 0.0f));
  }
  tboost_tensor U32(std::vector<uint64_t> shape, std::vector<uint32_t> v) {
    tboost_buffer* b = nullptr;
    EXPECT_STATUS(TBOOST_OK, tboost_backend_alloc(be, TBOOST_DTYPE_U32, shape.data(), shape.size(), &b));
    bufs.push_back(b);
    tboost_tensor t = Tensor(b, shape);
    EXPECT_STATUS(TBOOST_OK, tboost_backend_copy(be, &t, v.data(), v.size() * 4, TBOOST_COPY_HOST_TO_BACKEND));
    return t;
  }
  std::vector<float> Get(const tboost_tensor& t) {
    size_t n = 1;
    for (uint32_t i = 0; i < t.ndim; ++i) n *= t.shape[i];
    std::vector<uint16_t> h(n);
    EXPECT_STATUS(TBOOST_OK, tboost_backend_copy(be, &t, h.data(), n * 2, TBOOST_COPY_BACKEND_TO_HOST));
    std::vector<float> f;
    for (uint16_t v : h) f.push_back(FromHalf(v));
    return f;
  }
  tboost_op* Op(tboost_op_kind kind, const void* params) {
    tboost_op* op = nullptr;
    EXPECT_STATUS(TBOOST_OK, tboost_op_create(be, kind, params, &op));
    if (op != nullptr) ops.push_back(op);
    return op;
  }
  // tboost_op_supports's answer: "" when the backend takes the case, else its reason.
  std::string Why(const tboost_op* op) {
    bool ok = false;
    size_t need = 0;
    EXPECT_STATUS(TBOOST_ERR_BUFFER_TOO_SMALL, tboost_op_supports(op, &ok, nullptr, 0, &need));
    std::string why(need, '\0');
    EXPECT_STATUS(TBOOST_OK, tboost_op_supports(op, &ok, why.data(), why.size(), &need));
    why.pop_back();
    EXPECT_EQ(ok, why.empty()) << why;
    return why;
  }
  // Runs a case the backend takes and waits for it.
  void Run(const tboost_op* op, std::vector<tboost_tensor> ins, std::vector<tboost_tensor> outs) {
    EXPECT_EQ(Why(op), "");
    EXPECT_STATUS(TBOOST_OK, tboost_op_execute(op, ins.data(), ins.size(), outs.data(), outs.size(), nullptr));
    EXPECT_STATUS(TBOOST_OK, tboost_backend_synchronize(be));
  }
  // A case the backend refuses: supports gives `why`, execute is TBOOST_ERR_UNSUPPORTED with it.
  void Refused(const tboost_op* op, const std::string& why, std::vector<tboost_tensor> ins,
               std::vector<tboost_tensor> outs) {
    EXPECT_EQ(Why(op), why);
    EXPECT_STATUS(TBOOST_ERR_UNSUPPORTED,
                  tboost_op_execute(op, ins.data(), ins.size(), outs.data(), outs.size(), nullptr));
    EXPECT_NE(LastError().find(why), std::string::npos) << LastError();
  }
};

// `got` within `rounds` f16 roundings of `scale` of each `want`.
void ExpectF16(const std::vector<float>& got, const std::vector<double>& want, double rounds, double scale,
               const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rounds * kF16 * scale) << what << " [" << i << "]";
}

const char* const kNoTiling = " is not the default (unset) on ascend, whose kernels choose their own tiling";

// Matmul in f16 (exact products), a GGUF weight, fast precision and a CPU tiling (refused with
// their reasons), and the fused matmul + SwiGLU.
TEST(AscendOps, MatmulQuantizedWeightAndMatmulSwiglu) {
  AscendSim a;
  ASSERT_NE(a.be, nullptr);
  tboost_matmul_params mp = MatmulParams(TBOOST_DTYPE_F16, 2, 3, TBOOST_DTYPE_F16);
  tboost_op* mm = a.Op(TBOOST_OP_MATMUL, &mp);
  tboost_tensor x = a.Half({2, 3}, kMmX);
  tboost_tensor w = a.Half({2, 3}, kMmW, true);
  tboost_tensor y = a.Zeros({2, 2});
  a.Run(mm, {x, w}, {y});
  EXPECT_EQ(a.Get(y), kMmY);  // exact in f16

  // A Q8_0 weight runs through aclnnWeightQuantBatchMatmulV2, kept quantized. k = 64, two rows
  // of two blocks: row 0 is (scale 1, quants 1..32) then (scale 0.5, quants 2), row 1 is scale 1,
  // quants -1. With x all ones: 528 + 32 = 560 and -64, exact in f16.
  auto q8_block = [](std::vector<uint8_t>& out, float scale, auto quant) {
    const uint16_t d = ToHalf(scale);
    out.push_back(static_cast<uint8_t>(d & 0xff));
    out.push_back(static_cast<uint8_t>(d >> 8));
    for (int i = 0; i < 32; ++i) out.push_back(static_cast<uint8_t>(static_cast<int8_t>(quant(i))));
  };
  std::vector<uint8_t> q8;
  q8_block(q8, 1.0f, [](int i) { return i + 1; });
  q8_block(q8, 0.5f, [](int) { return 2; });
  q8_block(q8, 1.0f, [](int) { return -1; });
  q8_block(q8, 1.0f, [](int) { return -1; });
  uint64_t qshape[] = {2, 64};
  tboost_buffer* qb = nullptr;
  ASSERT_OK(tboost_backend_upload_weight(a.be, TBOOST_DTYPE_Q8_0, qshape, 2, q8.data(), q8.size(), &qb));
  a.bufs.push_back(qb);
  tboost_matmul_params qp = mp;
  qp.weight_dtype = TBOOST_DTYPE_Q8_0;
  qp.k = 64;
  tboost_tensor qx = a.Half({1, 64}, std::vector<float>(64, 1.0f));
  tboost_tensor qy = a.Zeros({1, 2});
  a.Run(a.Op(TBOOST_OP_MATMUL, &qp), {qx, Tensor(qb, {2, 64})}, {qy});
  EXPECT_EQ(a.Get(qy), (std::vector<float>{560, -64}));
  // k = 32 is one group: the op's antiquantGroupSize must be below k.
  std::vector<uint8_t> q8one(q8.begin(), q8.begin() + 34);
  q8one.insert(q8one.end(), q8.begin() + 68, q8.begin() + 102);
  uint64_t oneshape[] = {2, 32};
  tboost_buffer* ob = nullptr;
  ASSERT_OK(tboost_backend_upload_weight(a.be, TBOOST_DTYPE_Q8_0, oneshape, 2, q8one.data(), q8one.size(), &ob));
  a.bufs.push_back(ob);
  qp.k = 32;
  a.Refused(a.Op(TBOOST_OP_MATMUL, &qp),
            "cols=32 is not a multiple of 32 above 32 and at most 65535 (antiquantGroupSize 32 must lie in [32, k-1])",
            {a.Zeros({1, 32}), Tensor(ob, {2, 32})}, {a.Zeros({1, 2})});
  tboost_matmul_params fast = mp;
  fast.precision = 1;
  a.Refused(a.Op(TBOOST_OP_MATMUL, &fast),
            "precision=fast is not exact (no int8 activation path: the quantized matmuls are not declared)", {x, w},
            {y});
  tboost_matmul_params tiled = mp;
  tiled.tiling.panel_rows = 32;
  a.Refused(a.Op(TBOOST_OP_MATMUL, &tiled), std::string("panel_rows=32") + kNoTiling, {x, w}, {y});

  // matmul_swiglu: x · gateᵀ and x · upᵀ are exact in f16; silu and the product round to f16
  // at most twice each: 4 roundings of the largest result (< 9).
  tboost_matmul_swiglu_params sp = SwigluParams(TBOOST_DTYPE_F16, TBOOST_DTYPE_F16);
  tboost_op* sw = a.Op(TBOOST_OP_MATMUL_SWIGLU, &sp);
  tboost_tensor up = a.Half({2, 3}, kMmUp, true);
  tboost_tensor h = a.Zeros({2, 2});
  a.Run(sw, {x, w, up}, {h});
  ExpectF16(a.Get(h), kSwigluY, 4, 9, "matmul_swiglu");
  sp.tiling.act_rows = 2;
  a.Refused(a.Op(TBOOST_OP_MATMUL_SWIGLU, &sp), std::string("act_rows=2") + kNoTiling, {x, w, up}, {h});
}

// RMSNorm, the fused residual add + RMSNorm, SwiGLU, the embedding gather and RoPE (partial
// rotary refused), in f16.
TEST(AscendOps, NormsSwigluEmbedAndRope) {
  AscendSim a;
  ASSERT_NE(a.be, nullptr);
  tboost_norm_params np = Norm4(TBOOST_DTYPE_F16);
  tboost_tensor gain = a.Half({4}, {1, 2, 1, 0.5f}, true);
  // rms of (1, 1, 3, 5) is 3: y = x / 3 * gain; one rounding of the inputs' exact values, the
  // f16 output's rounding and one for the rsqrt: 3 roundings of the largest output (1).
  tboost_tensor nx = a.Half({1, 4}, {1, 1, 3, 5});
  tboost_tensor ny = a.Zeros({1, 4});
  a.Run(a.Op(TBOOST_OP_RMSNORM, &np), {nx, gain}, {ny});
  const std::vector<double> normed = {1.0 / 3, 2.0 / 3, 1.0, 5.0 / 6};
  ExpectF16(a.Get(ny), normed, 3, 1, "rmsnorm");
  // add_rmsnorm: residual (0, 1, 1, 1) += x (1, 0, 2, 4) is (1, 1, 3, 5), exact; then as above.
  tboost_tensor ax = a.Half({1, 4}, {1, 0, 2, 4});
  tboost_tensor res = a.Half({1, 4}, {0, 1, 1, 1});
  tboost_tensor ay = a.Zeros({1, 4});
  a.Run(a.Op(TBOOST_OP_ADD_RMSNORM, &np), {ax, gain}, {res, ay});
  EXPECT_EQ(a.Get(res), (std::vector<float>{1, 1, 3, 5}));
  ExpectF16(a.Get(ay), normed, 3, 1, "add_rmsnorm");

  // swiglu: silu(gate) * up, 2 roundings of the largest result (|silu(2)| < 2).
  tboost_swiglu_params sw{};
  sw.struct_size = sizeof sw;
  sw.act_dtype = TBOOST_DTYPE_F16;
  tboost_tensor g = a.Half({1, 4}, {0, 1, -1, 2});
  tboost_tensor u = a.Half({1, 4}, {1, 2, 3, -1});
  tboost_tensor sy = a.Zeros({1, 4});
  a.Run(a.Op(TBOOST_OP_SWIGLU, &sw), {g, u}, {sy});
  ExpectF16(a.Get(sy), {0, Silu(1) * 2, Silu(-1) * 3, -Silu(2)}, 2, 2, "swiglu");

  // embed: rows copied exactly (the values are exact in f16).
  tboost_embed_params ep{};
  ep.struct_size = sizeof ep;
  ep.table_dtype = TBOOST_DTYPE_F16;
  ep.vocab = 3;
  ep.hidden = 4;
  ep.act_dtype = TBOOST_DTYPE_F16;
  tboost_tensor table = a.Half({3, 4}, {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}, true);
  tboost_tensor ids = a.U32({2}, {2, 0});
  tboost_tensor ey = a.Zeros({2, 4});
  a.Run(a.Op(TBOOST_OP_EMBED, &ep), {ids, table}, {ey});
  EXPECT_EQ(a.Get(ey), (std::vector<float>{20, 21, 22, 23, 0, 1, 2, 3}));

  // rope, half split, 2 heads of 4, theta 10000 (frequencies 1 and 1/100), positions 0 and 1:
  // position 0 is the identity; position 1 rotates dims (0, 2) by 1 radian and (1, 3) by 0.01.
  // The tables are f16: 3 roundings of values at most 1.
  tboost_rope_params rp{};
  rp.struct_size = sizeof rp;
  rp.heads = 2;
  rp.head_dim = 4;
  rp.theta = 10000.0;
  rp.act_dtype = TBOOST_DTYPE_F16;
  tboost_tensor pos = a.U32({2}, {0, 1});
  const std::vector<float> row = {1, 0, 0, 0, 0, 1, 0, 0};
  std::vector<float> xv = row;
  xv.insert(xv.end(), row.begin(), row.end());
  tboost_tensor rx = a.Half({2, 2, 4}, xv);
  a.Run(a.Op(TBOOST_OP_ROPE, &rp), {pos}, {rx});
  std::vector<double> want(row.begin(), row.end());
  for (double v : {std::cos(1.0), 0.0, std::sin(1.0), 0.0, 0.0, std::cos(0.01), 0.0, std::sin(0.01)}) want.push_back(v);
  ExpectF16(a.Get(rx), want, 3, 1, "rope");
  rp.rot_dim = 2;
  a.Refused(a.Op(TBOOST_OP_ROPE, &rp), "rot_dim=2 is not head_dim 4 (aclnnRotaryPositionEmbedding rotates the whole head)",
            {pos}, {rx});
}

// Attention over a paged f16 cache: flash prefill and paged decode against hand computations;
// standard attention, a head_dim FIA does not take (the plan of llama_hd24 on this backend gives
// the same reasons), a CPU tile and a prefill block size FIA does not take are refused.
TEST(AscendOps, AttentionFlashPagedDecodeAndRefusedCases) {
  const std::string standard =
      "kind=standard_attention is not flash_attention or paged_decode_attention (materialized-score attention has "
      "no declared aclnn op; FusedInferAttentionScore is the attention op)";
  const std::string hd24 = "head_dim=24 is not a multiple of 16 of at most 512 (FIA, fp16/bf16)";
  {
    AscendSim a;
    ASSERT_NE(a.be, nullptr);
    // FIA's paged prefill takes blocks of 128..512 tokens.
    tboost_attention_params ap = Attn16(TBOOST_ATTENTION_FLASH, 128, TBOOST_DTYPE_F16, 256);
    const AttnCase c(128);
    tboost_tensor kc = a.Half({1, 128, 1, 16}, c.k), vc = a.Half({1, 128, 1, 16}, c.v);
    tboost_tensor q = a.Half({2, 16}, c.q);
    tboost_tensor one_seq = a.U32({1, 3}, {0, 2, 2});
    tboost_tensor table = a.U32({1, 1}, {0});
    tboost_tensor out = a.Zeros({2, 16});
    // The softmax weights and the output round to f16 (P in f16, as FIA keeps it): 4 roundings
    // of the largest value (15).
    a.Run(a.Op(TBOOST_OP_ATTENTION, &ap), {q, kc, vc, one_seq, table}, {out});
    ExpectF16(a.Get(out), c.want, 4, 16, "flash_attention");

    // Paged decode: two sequences of one new row each over the same block, contexts 1 and 2.
    tboost_attention_params dp = ap;
    dp.kind = TBOOST_ATTENTION_PAGED_DECODE;
    tboost_tensor two_seqs = a.U32({2, 3}, {0, 1, 1, 1, 1, 2});
    tboost_tensor tables = a.U32({2, 1}, {0, 0});
    tboost_tensor dout = a.Zeros({2, 16});
    a.Run(a.Op(TBOOST_OP_ATTENTION, &dp), {q, kc, vc, two_seqs, tables}, {dout});
    ExpectF16(a.Get(dout), c.want, 4, 16, "paged_decode_attention");

    // Refused cases, with the reasons the plan gives (checked against the plan below).
    tboost_attention_params st = ap;
    st.kind = TBOOST_ATTENTION_STANDARD;
    a.Refused(a.Op(TBOOST_OP_ATTENTION, &st), standard, {q, kc, vc, one_seq, table}, {out});
    tboost_attention_params h24 = ap;
    h24.head_dim = 24;
    EXPECT_EQ(a.Why(a.Op(TBOOST_OP_ATTENTION, &h24)), hd24);
    tboost_attention_params tiled = ap;
    tiled.tile_kv = 16;
    a.Refused(a.Op(TBOOST_OP_ATTENTION, &tiled),
              "tile_kv=16 is not 64 on ascend (its attention kernel chooses its own tiling)", {q, kc, vc, one_seq, table},
              {out});
    tboost_attention_params small = ap;
    small.block_size = 16;
    EXPECT_EQ(a.Why(a.Op(TBOOST_OP_ATTENTION, &small)),
              "block_size=16 is not a multiple of 128 in 128..=512 (FIA's paged prefill)");
  }
  // The plan of llama_hd24 (head_dim 24) on the same backend records the same two reasons.
  Config cfg{{"backend", "ascend"}, {"threads", "1"}};
  Model m(Golden("llama_hd24"), cfg.p);
  ASSERT_NE(m.p, nullptr) << LastError();
  size_t need = 0;
  tboost_model_info_json(m.p, nullptr, 0, &need);
  std::string plan(need, '\0');
  ASSERT_OK(tboost_model_info_json(m.p, plan.data(), plan.size(), &need));
  EXPECT_NE(plan.find("flash_attention on ascend: " + hd24), std::string::npos) << plan.substr(0, 2000);
  EXPECT_NE(plan.find("standard_attention on ascend: " + standard), std::string::npos) << plan.substr(0, 2000);
}

// MoE routing (top-2 of 3, renormalized) and grouped experts against hand computations; an
// expert batching tiling is refused.
TEST(AscendOps, MoeRouteAndGrouped) {
  AscendSim a;
  ASSERT_NE(a.be, nullptr);
  tboost_moe_route_params rp = Route3(TBOOST_DTYPE_F16);
  tboost_tensor logits = a.Half({2, 3}, kLogits);
  tboost_tensor ids = a.U32({2, 2}, {9, 9, 9, 9});
  tboost_tensor wts = a.Zeros({2, 2});
  a.Run(a.Op(TBOOST_OP_MOE_ROUTE, &rp), {logits}, {ids, wts});
  std::vector<uint32_t> got_ids(4);
  ASSERT_OK(tboost_backend_copy(a.be, &ids, got_ids.data(), 16, TBOOST_COPY_BACKEND_TO_HOST));
  EXPECT_EQ(got_ids, kRouteIds);
  // Through an f32 softmax and an f16 output: 2 roundings.
  ExpectF16(a.Get(wts), kRouteW, 2, 1, "moe_route");

  // Grouped (kExperts), token x = (1, 2) through both with weights 0.25, 0.75: gate/up are
  // exact; silu, the product, down and the weighted sum round in f16: 8 roundings of the
  // largest intermediate (3·silu(2) < 6).
  tboost_moe_grouped_params gp = Grouped2(TBOOST_DTYPE_F16, TBOOST_DTYPE_F16);
  std::vector<tboost_tensor> ins = {a.Half({1, 2}, {1, 2}), a.U32({1, 2}, {0, 1}), a.Half({1, 2}, {0.25f, 0.75f})};
  for (const auto& e : kExperts) {  // uploaded consecutively: gate, up, down of each expert
    ins.push_back(a.Half({1, 2}, e[0], true));
    ins.push_back(a.Half({1, 2}, e[1], true));
    ins.push_back(a.Half({2, 1}, e[2], true));
  }
  tboost_tensor y = a.Zeros({1, 2});
  a.Run(a.Op(TBOOST_OP_MOE_GROUPED, &gp), ins, {y});
  ExpectF16(a.Get(y), kGroupedY, 8, 6, "moe_grouped");
  gp.tiling.parallel_expert_batches = 2;
  a.Refused(a.Op(TBOOST_OP_MOE_GROUPED, &gp), std::string("parallel_expert_batches=2") + kNoTiling, ins, {y});
}

// The engine keys tiling.matmul.* / tiling.moe.* on the Ascend backend: refused when the model is
// planned, naming the key, the slot and the backend (the CPU takes them, see
// OpApi.TilingKeysAndOpFieldsAreRangeCheckedAndReported).
TEST(AscendOps, TilingEngineKeysAreRefusedOnAscend) {
  ASSERT_TRUE(UseSimulator());
  Config cfg{{"backend", "ascend"}, {"threads", "1"}, {"tiling.matmul.act_rows", "8"}};
  // The load opens no backend; the plan (in the info and in every engine) refuses the key.
  Model m(Golden("llama_gqa"), cfg.p);
  size_t need = 0;
  EXPECT_STATUS(TBOOST_ERR_UNSUPPORTED, tboost_model_info_json(m.p, nullptr, 0, &need));
  EXPECT_NE(LastError().find(std::string("tiling.matmul.act_rows=8") + kNoTiling + " (layer 0: qkv runs"),
            std::string::npos)
      << LastError();
  tboost_engine* e = nullptr;
  EXPECT_STATUS(TBOOST_ERR_UNSUPPORTED, tboost_engine_new(m.p, cfg.p, &e));
  EXPECT_EQ(e, nullptr);
}
