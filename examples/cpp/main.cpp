// A C++17 host embedding tboost: one model, one engine; prompts submitted from several
// threads; one thread runs the step loop; each submitter streams its requests' tokens as
// they arrive; at the end, every output and the engine's counters.
//
//   tboost_example <model dir or .gguf> [submitter threads] [requests per thread] [max tokens]
//
// The golden test models have no tokenizer, so prompts are token ids.
//
// Under mpirun it is one rank of a tensor-parallel group (the model split over the
// processes): TBOOST_COMM=mpi makes the engines talk over MPI, rank 0 runs the requests and
// prints as above, and every other rank follows it.
//
//   mpirun -np 2 -x TBOOST_COMM=mpi tboost_example <model> [...]
#include <tboost.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string last_error() {
  size_t need = 0;
  tboost_last_error(nullptr, 0, &need);
  std::string msg(need, '\0');
  tboost_last_error(msg.data(), msg.size(), nullptr);
  if (!msg.empty()) msg.pop_back();  // the NUL
  return msg;
}

// Every fallible call returns a status; the message is this thread's last error.
void check(tboost_status s, const char* what) {
  if (s != TBOOST_OK) {
    std::fprintf(stderr, "%s: %s: %s\n", what, tboost_status_name(s), last_error().c_str());
    std::exit(1);
  }
}

// The same prompts and sampling as the Go and Java examples, so their outputs can be compared.
std::vector<int32_t> prompt_for(int k) {
  std::vector<int32_t> p;
  for (int j = 0; j < 4 + 3 * k; ++j) p.push_back(3 + (k * 37 + j * 11) % 500);
  return p;
}

struct Output {
  std::vector<int32_t> tokens;
  tboost_finish_reason finish = TBOOST_FINISH_NONE;
  std::string error;  // why, when finish is TBOOST_FINISH_ERROR
};

std::string request_error(tboost_engine* engine, tboost_request_id id) {
  size_t need = 0;  // asking for the size "fails" with TBOOST_ERR_BUFFER_TOO_SMALL
  if (tboost_engine_request_error(engine, id, nullptr, 0, &need) == TBOOST_OK) return "";
  std::string msg(need, '\0');
  check(tboost_engine_request_error(engine, id, msg.data(), msg.size(), nullptr), "request_error");
  if (!msg.empty()) msg.pop_back();  // the NUL
  return msg;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL [THREADS=4] [REQUESTS_PER_THREAD=2] [MAX_TOKENS=12]\n", argv[0]);
    return 2;
  }
  const int n_threads = argc > 2 ? std::atoi(argv[2]) : 4;
  const int per_thread = argc > 3 ? std::atoi(argv[3]) : 2;
  const uint32_t max_tokens = argc > 4 ? static_cast<uint32_t>(std::atoi(argv[4])) : 12;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // tokens stream out line by line, also into a pipe
  std::printf("tboost %s (ABI %u)\n", tboost_version(), tboost_abi_version());

  // Options are string keys; the same config serves the model (plan) and the engine.
  tboost_config* cfg = nullptr;
  check(tboost_config_new(&cfg), "config_new");
  check(tboost_config_set_int(cfg, "threads", 2), "threads");
  check(tboost_config_set_int(cfg, "kv_cache_blocks", 256), "kv_cache_blocks");
  check(tboost_config_set_int(cfg, "max_seqs", 16), "max_seqs");

  auto progress = [](float p, void*) -> bool {
    std::printf("loading: %3.0f%%\n", p * 100.0f);
    return true;  // false would cancel the load
  };
  tboost_model* model = nullptr;
  check(tboost_model_load(argv[1], cfg, progress, nullptr, &model), "model_load");
  tboost_engine* engine = nullptr;
  check(tboost_engine_new(model, cfg, &engine), "engine_new");
  check(tboost_model_free(model), "model_free");  // the engine keeps what it needs
  check(tboost_config_free(cfg), "config_free");

  // A tensor-parallel follower (a rank other than 0 under mpirun) takes no requests: it steps
  // while it has work, i.e. runs the leader's steps until the leader's engine is freed.
  uint32_t rank = 0, world = 1;
  check(tboost_engine_rank(engine, &rank, &world), "rank");
  if (world > 1) std::printf("tensor parallel: rank %u of %u\n", rank, world);
  if (rank != 0) {
    bool following = true;
    while (following) {
      check(tboost_engine_step(engine, nullptr), "step (following rank 0)");
      check(tboost_engine_has_work(engine, &following), "has_work");
    }
    check(tboost_engine_free(engine), "engine_free");
    check(tboost_comm_finalize(), "comm_finalize");  // ends MPI: every rank, after its engines
    return 0;
  }

  size_t n = 0;
  if (tboost_engine_tokenize(engine, "Hello", 5, true, nullptr, 0, &n) == TBOOST_ERR_NO_TOKENIZER)
    std::printf("this model has no tokenizer: prompts are token ids\n");

  std::mutex print_mu;
  std::map<int, Output> outputs;  // by prompt number k
  std::atomic<int> submitting{n_threads};

  // The step loop: one thread, stepping while there is work, until every submitter is done.
  std::thread stepper([&] {
    for (;;) {
      const int still_submitting = submitting.load();  // read before has_work: no enqueue is missed
      bool work = false;
      check(tboost_engine_has_work(engine, &work), "has_work");
      if (work) {
        check(tboost_engine_step(engine, nullptr), "step");
      } else if (still_submitting == 0) {
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  });

  // Submitters: enqueue their prompts, then stream their own requests' events.
  std::vector<std::thread> submitters;
  for (int t = 0; t < n_threads; ++t) {
    submitters.emplace_back([&, t] {
      std::map<tboost_request_id, int> mine;  // request id -> k
      for (int i = 0; i < per_thread; ++i) {
        const int k = t * per_thread + i;
        tboost_sampling_params sp;
        tboost_sampling_params_init(&sp);
        sp.max_tokens = max_tokens;
        sp.ignore_eos = 1;
        sp.user_tag = static_cast<uint64_t>(k);
        if (k % 2 == 1) {  // odd prompts sample, with their own seed
          sp.temperature = 0.8f;
          sp.top_p = 0.95f;
          sp.seed = 1000 + static_cast<uint64_t>(k);
        }
        const std::vector<int32_t> prompt = prompt_for(k);
        tboost_request_id id = 0;
        check(tboost_engine_enqueue(engine, prompt.data(), prompt.size(), &sp, nullptr, nullptr, 0, &id), "enqueue");
        mine[id] = k;
      }
      submitting.fetch_sub(1);
      for (auto& [id, k] : mine) {
        Output out;
        while (out.finish == TBOOST_FINISH_NONE) {
          size_t ready = 0;
          check(tboost_engine_wait(engine, id, 1000, &ready), "wait");
          tboost_event ev[16];
          size_t got = 0;
          check(tboost_engine_read(engine, id, ev, sizeof(tboost_event), 16, &got), "read");
          for (size_t e = 0; e < got; ++e) {
            if (ev[e].token >= 0) out.tokens.push_back(ev[e].token);
            out.finish = ev[e].finish;
            std::lock_guard<std::mutex> lock(print_mu);
            if (ev[e].token >= 0) std::printf("  [request %d] token %d: %d\n", k, ev[e].index, ev[e].token);
          }
        }
        if (out.finish == TBOOST_FINISH_ERROR) out.error = request_error(engine, id);
        std::lock_guard<std::mutex> lock(print_mu);
        outputs[k] = out;
      }
    });
  }
  for (auto& s : submitters) s.join();
  stepper.join();

  for (auto& [k, out] : outputs) {
    std::printf("request %d:", k);
    for (int32_t tok : out.tokens) std::printf(" %d", tok);
    std::printf(" (%s)\n", tboost_finish_reason_name(out.finish));
    if (out.finish == TBOOST_FINISH_ERROR) std::printf("  request %d failed: %s\n", k, out.error.c_str());
  }
  tboost_stats st;
  st.struct_size = sizeof st;
  check(tboost_engine_stats(engine, &st), "stats");
  std::printf("stats: %llu steps, %llu prompt + %llu generated tokens, %llu finished, %.1f ms stepping\n",
              static_cast<unsigned long long>(st.steps), static_cast<unsigned long long>(st.prompt_tokens),
              static_cast<unsigned long long>(st.generated_tokens), static_cast<unsigned long long>(st.finished),
              st.total_step_ms);
  check(tboost_engine_free(engine), "engine_free");  // on rank 0 this also stops the followers
  check(tboost_comm_finalize(), "comm_finalize");   // a no-op unless the engine started MPI
  return 0;
}
