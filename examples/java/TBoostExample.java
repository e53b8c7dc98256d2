// A Java host embedding tboost through JNA: the same prompts and sampling as the C++ example
// (examples/cpp/main.cpp), submitted from several threads while one thread steps; prints each
// request's tokens in the same "request k: ..." lines so the outputs can be compared.
//
//   javac -cp /usr/share/java/jna.jar -d out TBoostExample.java
//   java -cp out:/usr/share/java/jna.jar -Djna.library.path=<prefix>/lib TBoostExample MODEL
//
// size_t is mapped to long: 64-bit platforms only. Java platform threads stay on their OS
// thread, so reading tboost_last_error right after a failed call on the same thread is safe.
import com.sun.jna.Library;
import com.sun.jna.Native;
import com.sun.jna.Pointer;
import com.sun.jna.Structure;
import com.sun.jna.ptr.ByteByReference;
import com.sun.jna.ptr.LongByReference;
import com.sun.jna.ptr.PointerByReference;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.atomic.AtomicInteger;

public final class TBoostExample {
  /** The part of tboost.h this host uses. Every int return is a tboost_status. */
  public interface TBoost extends Library {
    TBoost LIB = Native.load("tboost", TBoost.class);

    String tboost_version();
    int tboost_abi_version();
    String tboost_status_name(int status);
    String tboost_finish_reason_name(int reason);
    int tboost_last_error(byte[] buf, long cap, LongByReference needed);

    int tboost_config_new(PointerByReference out);
    int tboost_config_set_int(Pointer cfg, String key, long value);
    int tboost_config_free(Pointer cfg);
    int tboost_model_load(String path, Pointer cfg, Pointer progress, Pointer userData, PointerByReference out);
    int tboost_model_free(Pointer model);
    int tboost_engine_new(Pointer model, Pointer cfg, PointerByReference out);
    int tboost_engine_free(Pointer engine);

    void tboost_sampling_params_init(SamplingParams params);
    int tboost_engine_enqueue(Pointer engine, int[] prompt, long nPrompt, SamplingParams params,
        Pointer stopTokens, Pointer stopLens, long nStop, LongByReference idOut);
    int tboost_engine_has_work(Pointer engine, ByteByReference out);
    int tboost_engine_step(Pointer engine, Pointer nEventsOut);
    int tboost_engine_wait(Pointer engine, long id, int timeoutMs, LongByReference nReady);
    int tboost_engine_read(Pointer engine, long id, Event[] events, long eventSize, long cap, LongByReference nOut);
    int tboost_engine_stats(Pointer engine, Stats out);
  }

  /** tboost_sampling_params (64 bytes, no padding). */
  @Structure.FieldOrder({"struct_size", "max_tokens", "temperature", "top_k", "top_p", "min_p",
      "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "priority",
      "ignore_eos", "seed", "user_tag"})
  public static class SamplingParams extends Structure {
    public int struct_size, max_tokens;
    public float temperature;
    public int top_k;
    public float top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    public int logprobs, priority, ignore_eos;
    public long seed, user_tag;
  }

  /** tboost_event (40 bytes). */
  @Structure.FieldOrder({"struct_size", "token", "request_id", "user_tag", "logprob", "index", "finish", "error"})
  public static class Event extends Structure {
    public int struct_size, token;
    public long request_id, user_tag;
    public float logprob;
    public int index, finish, error;
  }

  /** tboost_stats (144 bytes). */
  @Structure.FieldOrder({"struct_size", "block_size", "waiting", "running", "preempted", "preemptions_total",
      "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "prefix_cache_hit_tokens", "prompt_tokens",
      "generated_tokens", "computed_tokens", "steps", "finished", "cancelled", "events_pending",
      "last_step_ms", "total_step_ms"})
  public static class Stats extends Structure {
    public int struct_size, block_size;
    public long waiting, running, preempted, preemptions_total, kv_blocks_total, kv_blocks_used,
        kv_blocks_cached, prefix_cache_hit_tokens, prompt_tokens, generated_tokens, computed_tokens, steps,
        finished, cancelled, events_pending;
    public double last_step_ms, total_step_ms;
  }

  static final TBoost T = TBoost.LIB;

  static void check(int status, String what) {
    if (status == 0) return;
    byte[] buf = new byte[1024];
    T.tboost_last_error(buf, buf.length, null);  // same thread as the failed call
    int n = 0;
    while (n < buf.length && buf[n] != 0) n++;
    throw new IllegalStateException(what + ": " + T.tboost_status_name(status) + ": "
        + new String(buf, 0, n, StandardCharsets.UTF_8));
  }

  /** The C++ example's prompt_for. */
  static int[] promptFor(int k) {
    int[] p = new int[4 + 3 * k];
    for (int j = 0; j < p.length; j++) p[j] = 3 + (k * 37 + j * 11) % 500;
    return p;
  }

  public static void main(String[] args) throws Exception {
    if (args.length < 1) {
      System.err.println("usage: TBoostExample MODEL [THREADS=4] [REQUESTS_PER_THREAD=2] [MAX_TOKENS=12]");
      System.exit(2);
    }
    final int threads = args.length > 1 ? Integer.parseInt(args[1]) : 4;
    final int perThread = args.length > 2 ? Integer.parseInt(args[2]) : 2;
    final int maxTokens = args.length > 3 ? Integer.parseInt(args[3]) : 12;
    System.out.println("tboost " + T.tboost_version() + " (ABI " + T.tboost_abi_version() + ") from Java");

    PointerByReference ref = new PointerByReference();
    check(T.tboost_config_new(ref), "config_new");
    Pointer cfg = ref.getValue();
    check(T.tboost_config_set_int(cfg, "threads", 2), "threads");
    check(T.tboost_config_set_int(cfg, "kv_cache_blocks", 256), "kv_cache_blocks");
    check(T.tboost_config_set_int(cfg, "max_seqs", 16), "max_seqs");
    check(T.tboost_model_load(args[0], cfg, null, null, ref), "model_load");
    Pointer model = ref.getValue();
    check(T.tboost_engine_new(model, cfg, ref), "engine_new");
    final Pointer engine = ref.getValue();
    check(T.tboost_model_free(model), "model_free");
    check(T.tboost_config_free(cfg), "config_free");

    final AtomicInteger submitting = new AtomicInteger(threads);
    Thread stepper = new Thread(() -> {
      ByteByReference work = new ByteByReference();
      for (;;) {
        int still = submitting.get();  // read before has_work: no enqueue is missed
        check(T.tboost_engine_has_work(engine, work), "has_work");
        if (work.getValue() != 0) {
          check(T.tboost_engine_step(engine, null), "step");
        } else if (still == 0) {
          return;
        } else {
          try { Thread.sleep(1); } catch (InterruptedException e) { return; }
        }
      }
    });
    stepper.start();

    final Map<Integer, String> outputs = new TreeMap<>();
    List<Thread> submitters = new ArrayList<>();
    for (int t = 0; t < threads; t++) {
      final int thread = t;
      Thread s = new Thread(() -> {
        Map<Long, Integer> mine = new TreeMap<>();
        for (int i = 0; i < perThread; i++) {
          int k = thread * perThread + i;
          SamplingParams sp = new SamplingParams();
          T.tboost_sampling_params_init(sp);
          sp.read();
          sp.max_tokens = maxTokens;
          sp.ignore_eos = 1;
          sp.user_tag = k;
          if (k % 2 == 1) {
            sp.temperature = 0.8f;
            sp.top_p = 0.95f;
            sp.seed = 1000 + k;
          }
          int[] prompt = promptFor(k);
          LongByReference id = new LongByReference();
          check(T.tboost_engine_enqueue(engine, prompt, prompt.length, sp, null, null, 0, id), "enqueue");
          mine.put(id.getValue(), k);
        }
        submitting.decrementAndGet();
        Event[] ev = (Event[]) new Event().toArray(16);
        int eventSize = ev[0].size();
        for (Map.Entry<Long, Integer> req : mine.entrySet()) {
          StringBuilder toks = new StringBuilder();
          int finish = 0;
          while (finish == 0) {
            LongByReference n = new LongByReference();
            check(T.tboost_engine_wait(engine, req.getKey(), 1000, n), "wait");
            check(T.tboost_engine_read(engine, req.getKey(), ev, eventSize, ev.length, n), "read");
            for (int e = 0; e < n.getValue(); e++) {
              if (ev[e].token >= 0) toks.append(' ').append(ev[e].token);
              finish = ev[e].finish;
            }
          }
          String line = "request " + req.getValue() + ":" + toks + " (" + T.tboost_finish_reason_name(finish) + ")";
          synchronized (outputs) {
            outputs.put(req.getValue(), line);
          }
        }
      });
      submitters.add(s);
      s.start();
    }
    for (Thread s : submitters) s.join();
    stepper.join();
    for (String line : outputs.values()) System.out.println(line);
    Stats st = new Stats();
    st.struct_size = st.size();
    check(T.tboost_engine_stats(engine, st), "stats");
    System.out.println("stats: " + st.steps + " steps, " + st.generated_tokens + " generated tokens, "
        + st.finished + " finished");
    check(T.tboost_engine_free(engine), "engine_free");
  }
}
