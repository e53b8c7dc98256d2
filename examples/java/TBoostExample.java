// A Java host embedding tboost through JNA: the same prompts and sampling as the C++ example
// (examples/cpp/main.cpp), submitted from several threads while one thread steps; prints each
// request's tokens in the same "request k: ..." lines so the outputs can be compared.
// With CHAT_MODEL (a model with a tokenizer and a chat template), it also renders a chat with
// the model's template, generates a reply and prints its top alternatives and timings.
//
//   javac -cp /usr/share/java/jna.jar -d out TBoostExample.java
//   java -cp out:/usr/share/java/jna.jar -Djna.library.path=<prefix>/lib TBoostExample MODEL \
//     [THREADS] [PER_THREAD] [MAX_TOKENS] [CHAT_MODEL]
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

    int tboost_model_chat_apply(Pointer model, String messagesJson, boolean addGenerationPrompt, byte[] buf,
        long cap, LongByReference needed);
    int tboost_model_chat_stops(Pointer model, byte[] buf, long cap, LongByReference needed);
    int tboost_model_chat_tokens(Pointer model, String messagesJson, boolean addGenerationPrompt, int[] tokens,
        long cap, LongByReference nOut);
    int tboost_engine_tokenize(Pointer engine, byte[] text, long textLen, boolean addSpecial, int[] tokens,
        long cap, LongByReference nOut);
    int tboost_engine_detokenize(Pointer engine, int[] tokens, long nTokens, byte[] buf, long cap,
        LongByReference needed);
  }

  /** tboost_sampling_params (second version, 104 bytes, no padding). */
  @Structure.FieldOrder({"struct_size", "max_tokens", "temperature", "top_k", "top_p", "min_p",
      "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "priority",
      "ignore_eos", "seed", "user_tag", "prompt_logprobs", "n_logit_bias", "logit_bias_tokens",
      "logit_bias_values", "grammar", "grammar_kind", "reserved"})
  public static class SamplingParams extends Structure {
    public int struct_size, max_tokens;
    public float temperature;
    public int top_k;
    public float top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    public int logprobs, priority, ignore_eos;
    public long seed, user_tag;
    public int prompt_logprobs, n_logit_bias;
    public Pointer logit_bias_tokens, logit_bias_values;
    public String grammar;  // JNA passes a NUL-terminated copy
    public int grammar_kind, reserved;
  }

  static final int TBOOST_GRAMMAR_JSON_SCHEMA = 1;

  /** tboost_event (second version, 240 bytes): top alternatives and, on the last event, timings. */
  @Structure.FieldOrder({"struct_size", "token", "request_id", "user_tag", "logprob", "index", "finish", "error",
      "n_top", "preemptions", "prompt_tokens", "cached_prompt_tokens", "queued_ms", "first_token_ms", "total_ms",
      "top_tokens", "top_logprobs"})
  public static class Event extends Structure {
    public int struct_size, token;
    public long request_id, user_tag;
    public float logprob;
    public int index, finish, error;
    public int n_top, preemptions, prompt_tokens, cached_prompt_tokens;
    public double queued_ms, first_token_ms, total_ms;
    public int[] top_tokens = new int[20];  // TBOOST_MAX_TOP_LOGPROBS
    public float[] top_logprobs = new float[20];
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

  /** A call that writes a NUL-terminated string: once for its size, once to fill it. */
  interface StringCall {
    int call(byte[] buf, long cap, LongByReference needed);
  }

  static String text(String what, StringCall f) {
    LongByReference need = new LongByReference();
    int s = f.call(null, 0, need);
    if (s != 4 /* TBOOST_ERR_BUFFER_TOO_SMALL */) check(s, what);
    byte[] buf = new byte[(int) need.getValue()];
    check(f.call(buf, buf.length, need), what);
    return new String(buf, 0, buf.length - 1, StandardCharsets.UTF_8);
  }

  static String lastText = "";

  /** Runs one request to its end; returns its last event, sets `lastText` to its text and
   *  appends the alternatives of its first token to `top`. */
  static Event generate(Pointer engine, int[] prompt, SamplingParams sp, StringBuilder top) {
    LongByReference id = new LongByReference();
    LongByReference n = new LongByReference();
    check(T.tboost_engine_enqueue(engine, prompt, prompt.length, sp, null, null, 0, id), "chat enqueue");
    List<Integer> reply = new ArrayList<>();
    Event[] ev = (Event[]) new Event().toArray(8);
    Event last = null;
    while (last == null || last.finish == 0) {
      check(T.tboost_engine_step(engine, null), "chat step");
      check(T.tboost_engine_read(engine, id.getValue(), ev, ev[0].size(), ev.length, n), "chat read");
      for (int e = 0; e < n.getValue(); e++) {
        if (ev[e].token >= 0) reply.add(ev[e].token);
        if (top.length() == 0) {
          for (int k = 0; k < ev[e].n_top; k++) {
            top.append(k > 0 ? ", " : "").append(ev[e].top_tokens[k])
                .append(String.format(" (%.3f)", ev[e].top_logprobs[k]));
          }
        }
        last = ev[e];
      }
    }
    int[] out = reply.stream().mapToInt(Integer::intValue).toArray();
    lastText = text("detokenize", (b, c, need) -> T.tboost_engine_detokenize(engine, out, out.length, b, c, need));
    return last;
  }

  /** Renders a chat with the model's template, generates a greedy reply, prints it with the
   *  alternatives of its first token and the request's timings. */
  static void chat(String path) {
    PointerByReference ref = new PointerByReference();
    check(T.tboost_config_new(ref), "config_new");
    Pointer cfg = ref.getValue();
    check(T.tboost_config_set_int(cfg, "kv_cache_blocks", 64), "kv_cache_blocks");
    check(T.tboost_model_load(path, cfg, null, null, ref), "chat model_load");
    Pointer model = ref.getValue();
    String messages = "[{\"role\":\"system\",\"content\":\"You are a terse assistant.\"},"
        + "{\"role\":\"user\",\"content\":\"Write a Java method that adds two ints.\"}]";
    String prompt = text("chat_apply", (b, c, n) -> T.tboost_model_chat_apply(model, messages, true, b, c, n));
    String stops = text("chat_stops", (b, c, n) -> T.tboost_model_chat_stops(model, b, c, n));
    // The same messages straight to token ids (no engine needed).
    int[] direct = new int[prompt.getBytes(StandardCharsets.UTF_8).length + 8];
    LongByReference nd = new LongByReference();
    check(T.tboost_model_chat_tokens(model, messages, true, direct, direct.length, nd), "chat_tokens");
    direct = java.util.Arrays.copyOf(direct, (int) nd.getValue());
    System.out.println("chat prompt: " + prompt.replace("\n", "\\n"));
    System.out.println("chat stops: " + stops);
    check(T.tboost_engine_new(model, cfg, ref), "chat engine_new");
    Pointer engine = ref.getValue();
    check(T.tboost_model_free(model), "model_free");
    check(T.tboost_config_free(cfg), "config_free");

    byte[] utf8 = prompt.getBytes(StandardCharsets.UTF_8);
    int[] ids = new int[utf8.length + 8];  // never more tokens than bytes
    LongByReference n = new LongByReference();
    // add_special false: the template wrote BOS itself where the model wants one.
    check(T.tboost_engine_tokenize(engine, utf8, utf8.length, false, ids, ids.length, n), "tokenize");
    int[] promptIds = java.util.Arrays.copyOf(ids, (int) n.getValue());
    if (!java.util.Arrays.equals(direct, promptIds)) {
      System.err.println("chat_tokens gave " + java.util.Arrays.toString(direct) + ", the rendered text tokenizes to "
          + java.util.Arrays.toString(promptIds));
      System.exit(1);
    }
    System.out.println("chat tokens: " + direct.length + " ids, as the rendered text's");
    SamplingParams sp = new SamplingParams();
    T.tboost_sampling_params_init(sp);
    sp.read();
    sp.max_tokens = 24;
    sp.logprobs = 3;
    StringBuilder top = new StringBuilder();
    Event last = generate(engine, promptIds, sp, top);
    System.out.println("chat reply: " + lastText.replace("\n", "\\n") + " (" + T.tboost_finish_reason_name(last.finish) + ")");
    System.out.println("chat first-token alternatives: " + top);
    System.out.println(String.format("chat timings: prompt %d tokens, queued %.1f ms, first token %.1f ms, total %.1f ms",
        last.prompt_tokens, last.queued_ms, last.first_token_ms, last.total_ms));

    // Structured output: the same conversation, the reply held to a JSON schema.
    T.tboost_sampling_params_init(sp);
    sp.read();
    sp.max_tokens = 64;
    sp.grammar = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":20},"
        + "\"args\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":3}},"
        + "\"required\":[\"name\",\"args\"],\"additionalProperties\":false}";
    sp.grammar_kind = TBOOST_GRAMMAR_JSON_SCHEMA;
    last = generate(engine, promptIds, sp, new StringBuilder());
    String json = lastText;
    // No JSON library in the JDK: check the shape the schema allows, {"name": "...", "args": [...]}.
    java.util.regex.Matcher mm = java.util.regex.Pattern
        .compile("\\{\\s*\"name\"\\s*:\\s*\"((?:[^\"\\\\]|\\\\.)*)\"\\s*,\\s*\"args\"\\s*:\\s*\\[(.*)\\]\\s*\\}", java.util.regex.Pattern.DOTALL)
        .matcher(json);
    if (!mm.matches() || last.finish != 2 /* TBOOST_FINISH_EOS */) {
      throw new IllegalStateException("structured reply does not validate: " + json);
    }
    int args = mm.group(2).trim().isEmpty() ? 0 : mm.group(2).split("\"\\s*,\\s*\"").length;
    System.out.println("chat json: " + json.replaceAll("\\s*\n\\s*", "") + " (valid: name \"" + mm.group(1) + "\", " + args
        + " args)");
    check(T.tboost_engine_free(engine), "engine_free");
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
    if (args.length > 4) chat(args[4]);
  }
}
