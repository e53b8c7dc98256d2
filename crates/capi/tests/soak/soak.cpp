// Soak test of the C ABI: many requests from many threads with random priorities, sampling,
// stop sequences and cancels, while one thread steps. Built with AddressSanitizer (leaks
// are LeakSanitizer's job at exit) by scripts/soak.sh; not part of scripts/test.sh.
//
//   tboost_soak MODEL [REQUESTS=10000] [THREADS=8] [SEED=1]
//
// Asserts, and prints what it counted:
// - every request gets exactly one finish event, the last one of its stream, with token
//   indices 0, 1, 2... before it; nothing is left to read at the end;
// - the header's cancel contract: tboost_engine_cancel returning TBOOST_OK means the stream
//   ends with a `cancelled` event, and a second cancel while the first is in flight returns
//   TBOOST_OK too; TBOOST_ERR_NOT_FOUND means the request had already finished otherwise;
// - the KV cache is empty at the end (tboost_engine_stats: kv_blocks_used = 0) and no
//   request is waiting or running;
// - resident memory is flat: sampled when 10%, 50% and 100% of the requests are done, it
//   grows by at most TBOOST_SOAK_RSS_GROWTH_MB (default 32) from 10% to 100% and by at
//   most half of that from 50% to 100%.
// Exit status 0 when all hold; 1 with the violations listed otherwise.
#include <tboost.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string last_error() {
  size_t need = 0;
  tboost_last_error(nullptr, 0, &need);
  std::string msg(need, '\0');
  tboost_last_error(msg.data(), msg.size(), nullptr);
  if (!msg.empty()) msg.pop_back();
  return msg;
}

void check(tboost_status s, const char* what) {
  if (s != TBOOST_OK) {
    std::fprintf(stderr, "soak: %s: %s: %s\n", what, tboost_status_name(s), last_error().c_str());
    std::exit(1);
  }
}

long rss_kib() {
  long pages_total = 0, pages_resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  if (std::fscanf(f, "%ld %ld", &pages_total, &pages_resident) != 2) pages_resident = -1;
  std::fclose(f);
  return pages_resident * (sysconf(_SC_PAGESIZE) / 1024);
}

std::mutex g_violations_mu;
std::vector<std::string> g_violations;
uint64_t g_violation_count = 0;

void violation(const std::string& v) {
  std::lock_guard<std::mutex> g(g_violations_mu);
  if (g_violations.size() < 20) g_violations.push_back(v);
  g_violation_count++;
  if (g_violations.size() == 1) std::fprintf(stderr, "soak: first violation: %s\n", v.c_str());
}

struct Counters {
  std::atomic<uint64_t> enqueued{0}, queue_full_retries{0}, finish_events{0}, token_events{0};
  std::atomic<uint64_t> cancel_ok{0}, cancel_not_found{0}, cancel_second_ok{0};
  std::atomic<uint64_t> by_reason[6] = {};
  std::atomic<uint64_t> done{0};
};

struct Pending {
  tboost_request_id id = 0;
  int cancel_mode = 0;  // 0 none, 1 right after enqueue, 2 after the first event, 3 after a few
  tboost_status cancel_status = TBOOST_OK;
  bool cancelled = false;
  bool finished = false;
  uint32_t next_index = 0;
  uint32_t max_tokens = 0;
  size_t events = 0;
  size_t read_at_cancel = 0;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--leak-self-test") == 0) {
    // Leaks one block on purpose: scripts/soak.sh checks that LeakSanitizer reports it, so
    // a soak that reports no leaks is known to be one that would have.
    static void* volatile sink;
    sink = std::malloc(4096);
    std::memset(sink, 1, 4096);
    sink = nullptr;
    return 0;
  }
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL [REQUESTS=10000] [THREADS=8] [SEED=1]\n", argv[0]);
    return 2;
  }
  const char* model_path = argv[1];
  const uint64_t n_requests = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 10000;
  const int n_threads = argc > 3 ? std::atoi(argv[3]) : 8;
  const uint64_t seed = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 1;
  const char* growth_env = std::getenv("TBOOST_SOAK_RSS_GROWTH_MB");
  const long growth_mib = growth_env != nullptr ? std::atol(growth_env) : 32;

  tboost_config* cfg = nullptr;
  check(tboost_config_new(&cfg), "config_new");
  check(tboost_config_set_int(cfg, "threads", 2), "threads");
  check(tboost_config_set_int(cfg, "kv_cache_blocks", 64), "kv_cache_blocks");  // tight: preemptions
  check(tboost_config_set_int(cfg, "block_size", 16), "block_size");
  check(tboost_config_set_int(cfg, "max_seqs", 24), "max_seqs");
  check(tboost_config_set_int(cfg, "max_batched_tokens", 192), "max_batched_tokens");
  check(tboost_config_set_int(cfg, "queue_limit", 64), "queue_limit");
  tboost_model* model = nullptr;
  check(tboost_model_load(model_path, cfg, nullptr, nullptr, &model), "model_load");
  tboost_engine* engine = nullptr;
  check(tboost_engine_new(model, cfg, &engine), "engine_new");
  // TBOOST_TP=2 soaks a tensor-parallel engine (local ranks); say which one this is.
  uint32_t rank = 0, world = 0;
  check(tboost_engine_rank(engine, &rank, &world), "engine_rank");
  std::printf("soak: tensor-parallel ranks %u (this host is rank %u)\n", world, rank);
  // Prompts use ids below the model's vocabulary size (from its info JSON).
  size_t need = 0;
  tboost_model_info_json(model, nullptr, 0, &need);
  std::string info(need, '\0');
  check(tboost_model_info_json(model, info.data(), info.size(), nullptr), "model_info_json");
  const size_t at = info.find("\"vocab_size\":");
  const int vocab = at == std::string::npos ? 0 : std::atoi(info.c_str() + at + std::strlen("\"vocab_size\":"));
  if (vocab < 4) {
    std::fprintf(stderr, "soak: no usable vocab_size in the model info: %s\n", info.c_str());
    return 1;
  }
  check(tboost_model_free(model), "model_free");
  check(tboost_config_free(cfg), "config_free");

  Counters c;
  std::atomic<int> submitting{n_threads};
  long rss_at[3] = {0, 0, 0};
  std::atomic<int> rss_stage{0};
  const auto t0 = std::chrono::steady_clock::now();

  std::thread stepper([&] {
    uint64_t busy = 0;
    for (;;) {
      const int still = submitting.load();
      bool work = false;
      check(tboost_engine_has_work(engine, &work), "has_work");
      if (work) {
        const tboost_status s = tboost_engine_step(engine, nullptr);
        if (s == TBOOST_ERR_BUSY) {
          ++busy;
          continue;
        }
        check(s, "step");
      } else if (still == 0) {
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      // RSS at 10%, 50% and 100% of the requests done.
      const uint64_t done = c.done.load();
      const int stage = rss_stage.load();
      const uint64_t marks[3] = {n_requests / 10, n_requests / 2, n_requests};
      if (stage < 3 && done >= marks[stage]) {
        rss_at[stage] = rss_kib();
        rss_stage.store(stage + 1);
      }
    }
    if (busy != 0) violation("tboost_engine_step returned TBOOST_ERR_BUSY with a single stepping thread");
  });

  std::vector<std::thread> submitters;
  for (int t = 0; t < n_threads; ++t) {
    submitters.emplace_back([&, t] {
      std::mt19937_64 rng(seed * 1000003 + t);
      auto below = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
      const uint64_t mine = n_requests / n_threads + (static_cast<uint64_t>(t) < n_requests % n_threads ? 1 : 0);
      uint64_t submitted = 0;
      while (submitted < mine) {
        // A window of requests in flight at once, then drain it.
        std::vector<Pending> window;
        const uint64_t w = std::min<uint64_t>(1 + below(8), mine - submitted);
        for (uint64_t k = 0; k < w; ++k) {
          std::vector<int32_t> prompt(1 + below(48));
          for (auto& tok : prompt) tok = 3 + static_cast<int32_t>(below(vocab - 3));
          tboost_sampling_params sp;
          tboost_sampling_params_init(&sp);
          sp.max_tokens = 1 + static_cast<uint32_t>(below(24));
          sp.priority = static_cast<int32_t>(below(7)) - 3;
          sp.ignore_eos = below(2);
          sp.user_tag = (static_cast<uint64_t>(t) << 32) | submitted;
          if (below(2) == 1) {
            sp.temperature = 0.9f;
            sp.top_p = 0.9f;
            sp.seed = rng();
          }
          std::vector<int32_t> stop_tokens;
          std::vector<size_t> stop_lens;
          if (below(4) == 0) {
            stop_tokens = {static_cast<int32_t>(3 + below(vocab - 3))};
            stop_lens = {1};
          }
          Pending p;
          for (;;) {
            const tboost_status s = tboost_engine_enqueue(engine, prompt.data(), prompt.size(), &sp,
                                                          stop_tokens.empty() ? nullptr : stop_tokens.data(),
                                                          stop_lens.empty() ? nullptr : stop_lens.data(),
                                                          stop_lens.size(), &p.id);
            if (s == TBOOST_ERR_QUEUE_FULL) {
              c.queue_full_retries++;
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
              continue;
            }
            check(s, "enqueue");
            break;
          }
          c.enqueued++;
          submitted++;
          p.max_tokens = sp.max_tokens;
          p.cancel_mode = below(4) == 0 ? 1 + static_cast<int>(below(3)) : 0;
          window.push_back(p);
        }
        auto cancel = [&](Pending& p) {
          p.cancelled = true;
          p.read_at_cancel = p.events;
          p.cancel_status = tboost_engine_cancel(engine, p.id);
          if (p.cancel_status == TBOOST_OK) {
            c.cancel_ok++;
            // Idempotent while in flight (and after: "already cancelled returns TBOOST_OK").
            const tboost_status again = tboost_engine_cancel(engine, p.id);
            if (again == TBOOST_OK) {
              c.cancel_second_ok++;
            } else {
              violation("request " + std::to_string(p.id) + ": a second cancel returned " +
                        tboost_status_name(again) + " after the first returned TBOOST_OK");
            }
          } else if (p.cancel_status == TBOOST_ERR_NOT_FOUND) {
            c.cancel_not_found++;
          } else {
            violation("request " + std::to_string(p.id) + ": cancel returned " + tboost_status_name(p.cancel_status));
          }
        };
        for (auto& p : window) {
          if (p.cancel_mode == 1) cancel(p);
        }
        // Drain: read each request's events until its finish event.
        for (auto& p : window) {
          const auto start = std::chrono::steady_clock::now();
          while (!p.finished) {
            size_t ready = 0;
            const tboost_status ws = tboost_engine_wait(engine, p.id, 100, &ready);
            if (ws != TBOOST_OK) {
              violation("request " + std::to_string(p.id) + ": wait returned " + tboost_status_name(ws) + ": " +
                        last_error());
              p.finished = true;
              break;
            }
            if (std::chrono::steady_clock::now() - start > std::chrono::seconds(120)) {
              violation("request " + std::to_string(p.id) + ": no finish event within 120 s (" +
                        std::to_string(p.events) + " events so far)");
              p.finished = true;
              break;
            }
            tboost_event ev[16];
            size_t n = 0;
            check(tboost_engine_read(engine, p.id, ev, sizeof(tboost_event), 16, &n), "read");
            for (size_t i = 0; i < n; ++i) {
              const tboost_event& e = ev[i];
              p.events++;
              if (p.finished) {
                violation("request " + std::to_string(p.id) + ": an event after its finish event");
                continue;
              }
              if (e.request_id != p.id) violation("request " + std::to_string(p.id) + ": an event of another id");
              if (e.token >= 0) {
                c.token_events++;
                if (e.index != p.next_index) {
                  violation("request " + std::to_string(p.id) + ": token index " + std::to_string(e.index) +
                            ", expected " + std::to_string(p.next_index));
                }
                p.next_index++;
              }
              if (e.finish != TBOOST_FINISH_NONE) {
                p.finished = true;
                c.finish_events++;
                if (e.finish >= 0 && e.finish < 6) c.by_reason[e.finish]++;
                if (p.cancelled && p.cancel_status == TBOOST_OK && e.finish != TBOOST_FINISH_CANCELLED) {
                  violation("request " + std::to_string(p.id) +
                            ": tboost_engine_cancel returned TBOOST_OK but the stream ended with `" +
                            tboost_finish_reason_name(e.finish) + "` (" + std::to_string(p.next_index) +
                            " tokens of max " + std::to_string(p.max_tokens) + "; cancelled " +
                            (p.cancel_mode == 1 ? std::string("right after enqueue")
                                                : "when " + std::to_string(p.read_at_cancel) + " events had been read") +
                            "), not `cancelled`");
                }
                if (p.cancelled && p.cancel_status == TBOOST_ERR_NOT_FOUND && e.finish == TBOOST_FINISH_CANCELLED) {
                  violation("request " + std::to_string(p.id) +
                            ": cancel returned TBOOST_ERR_NOT_FOUND but the stream ended with `cancelled`");
                }
                if (!p.cancelled && e.finish == TBOOST_FINISH_CANCELLED) {
                  violation("request " + std::to_string(p.id) + ": `cancelled` without a cancel");
                }
                if (e.finish == TBOOST_FINISH_ERROR) {
                  violation("request " + std::to_string(p.id) + ": finished with an error");
                }
              }
            }
            if (!p.finished && !p.cancelled && p.cancel_mode >= 2 && p.events >= static_cast<size_t>(p.cancel_mode - 1)) {
              cancel(p);
            }
          }
          c.done++;
        }
      }
      submitting--;
    });
  }
  for (auto& th : submitters) th.join();
  stepper.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rss_stage.load() < 3) rss_at[2] = rss_kib();

  // Nothing may be left to read, and the cache must be empty.
  size_t left = 0;
  check(tboost_engine_read(engine, TBOOST_ANY_REQUEST, nullptr, sizeof(tboost_event), 0, &left), "read any");
  if (left != 0) violation(std::to_string(left) + " events left unread after every request finished");
  tboost_stats st{};
  st.struct_size = sizeof st;
  check(tboost_engine_stats(engine, &st), "stats");
  if (st.kv_blocks_used != 0) violation(std::to_string(st.kv_blocks_used) + " KV blocks still in use at the end");
  if (st.waiting != 0 || st.running != 0) {
    violation("at the end " + std::to_string(st.waiting) + " requests wait and " + std::to_string(st.running) + " run");
  }
  if (c.finish_events.load() != n_requests) {
    violation(std::to_string(c.finish_events.load()) + " finish events for " + std::to_string(n_requests) +
              " requests");
  }
  const long g_all = (rss_at[2] - rss_at[0]) / 1024, g_late = (rss_at[2] - rss_at[1]) / 1024;
  if (g_all > growth_mib || g_late > growth_mib / 2) {
    violation("RSS grew by " + std::to_string(g_all) + " MiB from 10% to 100% and " + std::to_string(g_late) +
              " MiB from 50% to 100% (limits " + std::to_string(growth_mib) + " and " +
              std::to_string(growth_mib / 2) + " MiB)");
  }

  std::printf("soak: %llu requests from %d threads in %.1f s (%llu steps, %llu preemptions, %llu queue-full retries)\n",
              static_cast<unsigned long long>(c.enqueued.load()), n_threads, secs,
              static_cast<unsigned long long>(st.steps), static_cast<unsigned long long>(st.preemptions_total),
              static_cast<unsigned long long>(c.queue_full_retries.load()));
  std::printf("soak: finish events %llu: length %llu, eos %llu, stop_sequence %llu, cancelled %llu, error %llu; "
              "%llu token events\n",
              static_cast<unsigned long long>(c.finish_events.load()),
              static_cast<unsigned long long>(c.by_reason[TBOOST_FINISH_LENGTH].load()),
              static_cast<unsigned long long>(c.by_reason[TBOOST_FINISH_EOS].load()),
              static_cast<unsigned long long>(c.by_reason[TBOOST_FINISH_STOP_SEQUENCE].load()),
              static_cast<unsigned long long>(c.by_reason[TBOOST_FINISH_CANCELLED].load()),
              static_cast<unsigned long long>(c.by_reason[TBOOST_FINISH_ERROR].load()),
              static_cast<unsigned long long>(c.token_events.load()));
  std::printf("soak: cancels: %llu returned OK (second cancel OK: %llu), %llu NOT_FOUND (already finished)\n",
              static_cast<unsigned long long>(c.cancel_ok.load()),
              static_cast<unsigned long long>(c.cancel_second_ok.load()),
              static_cast<unsigned long long>(c.cancel_not_found.load()));
  std::printf("soak: engine stats: finished %llu, cancelled %llu, kv_blocks_used %llu of %llu, events_pending %llu\n",
              static_cast<unsigned long long>(st.finished), static_cast<unsigned long long>(st.cancelled),
              static_cast<unsigned long long>(st.kv_blocks_used), static_cast<unsigned long long>(st.kv_blocks_total),
              static_cast<unsigned long long>(st.events_pending));
  std::printf("soak: RSS at 10%% / 50%% / 100%% of requests: %ld / %ld / %ld MiB\n", rss_at[0] / 1024,
              rss_at[1] / 1024, rss_at[2] / 1024);

  check(tboost_engine_free(engine), "engine_free");
  if (!g_violations.empty()) {
    std::printf("soak: %llu violation(s), the first %zu:\n", static_cast<unsigned long long>(g_violation_count),
                g_violations.size());
    for (const auto& v : g_violations) std::printf("  %s\n", v.c_str());
    return 1;
  }
  std::printf("soak: all checks held\n");
  return 0;
}
