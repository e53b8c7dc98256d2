// A Go host embedding tboost through cgo: the same prompts and sampling as the C++ example
// (examples/cpp/main.cpp), submitted from goroutines while one goroutine steps; prints each
// request's tokens in the same "request k: ..." lines so the outputs can be compared.
// With CHAT_MODEL (a model with a tokenizer and a chat template), it also renders a chat with
// the model's template, generates a reply and prints its top alternatives and timings.
//
//	PKG_CONFIG_PATH=<prefix>/lib/pkgconfig go run . MODEL [THREADS] [PER_THREAD] [MAX_TOKENS] [CHAT_MODEL]
package main

/*
#cgo pkg-config: tboost
#include <stdlib.h>
#include <tboost.h>

// Goroutines move between OS threads between two cgo calls, and tboost's last error is
// per OS thread: so every call goes through a helper that reads the message inside the
// same C call that failed.
typedef struct {
	tboost_status status;
	char msg[1024];
} tb_result;

static tb_result tb_result_of(tboost_status s) {
	tb_result r;
	r.status = s;
	r.msg[0] = 0;
	if (s != TBOOST_OK) tboost_last_error(r.msg, sizeof r.msg, NULL);
	return r;
}

static tb_result tb_config_new(tboost_config **out) { return tb_result_of(tboost_config_new(out)); }
static tb_result tb_config_set_int(tboost_config *c, const char *k, int64_t v) {
	return tb_result_of(tboost_config_set_int(c, k, v));
}
static tb_result tb_model_load(const char *path, const tboost_config *c, tboost_model **out) {
	return tb_result_of(tboost_model_load(path, c, NULL, NULL, out));
}
static tb_result tb_engine_new(const tboost_model *m, const tboost_config *c, tboost_engine **out) {
	return tb_result_of(tboost_engine_new(m, c, out));
}
static tb_result tb_enqueue(tboost_engine *e, const int32_t *prompt, size_t n, const tboost_sampling_params *p,
                            tboost_request_id *id) {
	return tb_result_of(tboost_engine_enqueue(e, prompt, n, p, NULL, NULL, 0, id));
}
static tb_result tb_has_work(tboost_engine *e, bool *out) { return tb_result_of(tboost_engine_has_work(e, out)); }
static tb_result tb_step(tboost_engine *e) { return tb_result_of(tboost_engine_step(e, NULL)); }
static tb_result tb_wait(tboost_engine *e, tboost_request_id id, uint32_t ms, size_t *n) {
	return tb_result_of(tboost_engine_wait(e, id, ms, n));
}
static tb_result tb_read(tboost_engine *e, tboost_request_id id, tboost_event *ev, size_t cap, size_t *n) {
	return tb_result_of(tboost_engine_read(e, id, ev, sizeof(tboost_event), cap, n));
}
static tb_result tb_chat_apply(const tboost_model *m, const char *json, char *buf, size_t cap, size_t *need) {
	return tb_result_of(tboost_model_chat_apply(m, json, true, buf, cap, need));
}
static tb_result tb_chat_tokens(const tboost_model *m, const char *json, int32_t *out, size_t cap, size_t *n) {
	return tb_result_of(tboost_model_chat_tokens(m, json, true, out, cap, n));
}
static tb_result tb_chat_stops(const tboost_model *m, char *buf, size_t cap, size_t *need) {
	return tb_result_of(tboost_model_chat_stops(m, buf, cap, need));
}
static tb_result tb_tokenize(tboost_engine *e, const char *text, size_t len, int32_t *out, size_t cap, size_t *n) {
	return tb_result_of(tboost_engine_tokenize(e, text, len, false, out, cap, n));
}
static tb_result tb_detokenize(tboost_engine *e, const int32_t *ids, size_t n, char *buf, size_t cap, size_t *need) {
	return tb_result_of(tboost_engine_detokenize(e, ids, n, buf, cap, need));
}
static tb_result tb_stats(tboost_engine *e, tboost_stats *st) {
	st->struct_size = sizeof *st;
	return tb_result_of(tboost_engine_stats(e, st));
}
*/
import "C"

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

func check(r C.tb_result, what string) {
	if r.status != C.TBOOST_OK {
		fmt.Fprintf(os.Stderr, "%s: %s: %s\n", what, C.GoString(C.tboost_status_name(C.int32_t(r.status))), C.GoString(&r.msg[0]))
		os.Exit(1)
	}
}

// promptFor is the C++ example's prompt_for.
func promptFor(k int) []int32 {
	p := make([]int32, 0, 4+3*k)
	for j := 0; j < 4+3*k; j++ {
		p = append(p, int32(3+(k*37+j*11)%500))
	}
	return p
}

func arg(i, def int) int {
	if len(os.Args) > i {
		if v, err := strconv.Atoi(os.Args[i]); err == nil {
			return v
		}
	}
	return def
}

// text calls f once to learn the size of its NUL-terminated answer, then again to fill it.
func text(what string, f func(buf *C.char, cap C.size_t, need *C.size_t) C.tb_result) string {
	var need C.size_t
	if r := f(nil, 0, &need); r.status != C.TBOOST_ERR_BUFFER_TOO_SMALL {
		check(r, what)
	}
	buf := (*C.char)(C.malloc(need))
	defer C.free(unsafe.Pointer(buf))
	check(f(buf, need, &need), what)
	return C.GoString(buf)
}

// generate runs one request to its end and returns its text, its last event and the
// alternatives of its first token.
func generate(engine *C.tboost_engine, ids []int32, sp *C.tboost_sampling_params) (string, C.tboost_event, []string) {
	var id C.tboost_request_id
	check(C.tb_enqueue(engine, (*C.int32_t)(unsafe.Pointer(&ids[0])), C.size_t(len(ids)), sp, &id), "chat enqueue")
	var reply []int32
	var last C.tboost_event
	var top []string
	for finished := false; !finished; {
		check(C.tb_step(engine), "chat step")
		var ev [8]C.tboost_event
		var got C.size_t
		check(C.tb_read(engine, id, &ev[0], 8, &got), "chat read")
		for _, e := range ev[:got] {
			if e.token >= 0 {
				reply = append(reply, int32(e.token))
			}
			if len(top) == 0 {
				for k := 0; k < int(e.n_top); k++ {
					top = append(top, fmt.Sprintf("%d (%.3f)", int32(e.top_tokens[k]), float32(e.top_logprobs[k])))
				}
			}
			last, finished = e, e.finish != C.TBOOST_FINISH_NONE
		}
	}
	reply = append(reply, 0)[:len(reply)] // a valid pointer even for an empty reply
	out := text("detokenize", func(b *C.char, c C.size_t, need *C.size_t) C.tb_result {
		return C.tb_detokenize(engine, (*C.int32_t)(unsafe.Pointer(&reply[:1][0])), C.size_t(len(reply)), b, c, need)
	})
	return out, last, top
}

// chat renders a conversation with the model's template, generates a greedy reply and prints
// it with the alternatives of its first token and the request's timings.
func chat(path string) {
	var cfg *C.tboost_config
	check(C.tb_config_new(&cfg), "config_new")
	key := C.CString("kv_cache_blocks")
	check(C.tb_config_set_int(cfg, key, 64), "kv_cache_blocks")
	C.free(unsafe.Pointer(key))
	cpath := C.CString(path)
	var model *C.tboost_model
	check(C.tb_model_load(cpath, cfg, &model), "chat model_load")
	C.free(unsafe.Pointer(cpath))
	messages := C.CString(`[{"role":"system","content":"You are a terse assistant."},` +
		`{"role":"user","content":"Write a Go function that adds two ints."}]`)
	prompt := text("chat_apply", func(b *C.char, c C.size_t, n *C.size_t) C.tb_result {
		return C.tb_chat_apply(model, messages, b, c, n)
	})
	// The same messages straight to token ids (no engine needed).
	direct := make([]int32, len(prompt)+8) // never more tokens than bytes
	var nd C.size_t
	check(C.tb_chat_tokens(model, messages, (*C.int32_t)(unsafe.Pointer(&direct[0])), C.size_t(len(direct)), &nd), "chat_tokens")
	direct = direct[:nd]
	C.free(unsafe.Pointer(messages))
	stops := text("chat_stops", func(b *C.char, c C.size_t, n *C.size_t) C.tb_result { return C.tb_chat_stops(model, b, c, n) })
	fmt.Printf("chat prompt: %q\nchat stops: %s\n", prompt, stops)
	var engine *C.tboost_engine
	check(C.tb_engine_new(model, cfg, &engine), "chat engine_new")
	C.tboost_model_free(model)
	C.tboost_config_free(cfg)

	ctext := C.CString(prompt)
	ids := make([]int32, len(prompt)+8) // never more tokens than bytes
	var n C.size_t
	// add_special false: the template wrote BOS itself where the model wants one.
	check(C.tb_tokenize(engine, ctext, C.size_t(len(prompt)), (*C.int32_t)(unsafe.Pointer(&ids[0])), C.size_t(len(ids)), &n), "tokenize")
	C.free(unsafe.Pointer(ctext))
	if fmt.Sprint(direct) != fmt.Sprint(ids[:n]) {
		fmt.Fprintf(os.Stderr, "chat_tokens gave %v, the rendered text tokenizes to %v\n", direct, ids[:n])
		os.Exit(1)
	}
	fmt.Printf("chat tokens: %d ids, as the rendered text's\n", len(direct))
	var sp C.tboost_sampling_params
	C.tboost_sampling_params_init(&sp)
	sp.max_tokens = 24
	sp.logprobs = 3
	reply, last, top := generate(engine, ids[:n], &sp)
	fmt.Printf("chat reply: %q (%s)\n", reply, C.GoString(C.tboost_finish_reason_name(C.int32_t(last.finish))))
	fmt.Printf("chat first-token alternatives: %s\n", strings.Join(top, ", "))
	fmt.Printf("chat timings: prompt %d tokens, queued %.1f ms, first token %.1f ms, total %.1f ms\n",
		uint32(last.prompt_tokens), float64(last.queued_ms), float64(last.first_token_ms), float64(last.total_ms))

	// Structured output: the same conversation, the reply held to a JSON schema.
	schema := C.CString(`{"type":"object","properties":{"name":{"type":"string","maxLength":20},` +
		`"args":{"type":"array","items":{"type":"string"},"maxItems":3}},"required":["name","args"],` +
		`"additionalProperties":false}`)
	C.tboost_sampling_params_init(&sp)
	sp.max_tokens = 64
	sp.grammar = schema
	sp.grammar_kind = C.TBOOST_GRAMMAR_JSON_SCHEMA
	structured, last, _ := generate(engine, ids[:n], &sp)
	C.free(unsafe.Pointer(schema))
	var v struct {
		Name string   `json:"name"`
		Args []string `json:"args"`
	}
	dec := json.NewDecoder(strings.NewReader(structured))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil || last.finish != C.TBOOST_FINISH_EOS {
		fmt.Fprintf(os.Stderr, "structured reply %q does not validate: %v\n", structured, err)
		os.Exit(1)
	}
	var compact bytes.Buffer
	_ = json.Compact(&compact, []byte(structured)) // it decoded above, so it compacts
	fmt.Printf("chat json: %s (valid: name %q, %d args)\n", compact.String(), v.Name, len(v.Args))
	C.tboost_engine_free(engine)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintf(os.Stderr, "usage: %s MODEL [THREADS=4] [REQUESTS_PER_THREAD=2] [MAX_TOKENS=12] [CHAT_MODEL]\n", os.Args[0])
		os.Exit(2)
	}
	threads, perThread, maxTokens := arg(2, 4), arg(3, 2), arg(4, 12)
	fmt.Printf("tboost %s (ABI %d) from Go\n", C.GoString(C.tboost_version()), uint32(C.tboost_abi_version()))

	var cfg *C.tboost_config
	check(C.tb_config_new(&cfg), "config_new")
	for _, kv := range []struct {
		k string
		v int64
	}{{"threads", 2}, {"kv_cache_blocks", 256}, {"max_seqs", 16}} {
		key := C.CString(kv.k)
		check(C.tb_config_set_int(cfg, key, C.int64_t(kv.v)), kv.k)
		C.free(unsafe.Pointer(key))
	}
	path := C.CString(os.Args[1])
	var model *C.tboost_model
	check(C.tb_model_load(path, cfg, &model), "model_load")
	C.free(unsafe.Pointer(path))
	var engine *C.tboost_engine
	check(C.tb_engine_new(model, cfg, &engine), "engine_new")
	C.tboost_model_free(model)
	C.tboost_config_free(cfg)

	var submitting int32 = int32(threads)
	done := make(chan struct{})
	go func() { // the step loop
		defer close(done)
		for {
			still := atomic.LoadInt32(&submitting) // read before has_work: no enqueue is missed
			var work C.bool
			check(C.tb_has_work(engine, &work), "has_work")
			if work {
				check(C.tb_step(engine), "step")
			} else if still == 0 {
				return
			} else {
				time.Sleep(time.Millisecond)
			}
		}
	}()

	var mu sync.Mutex
	outputs := map[int]string{}
	var wg sync.WaitGroup
	for t := 0; t < threads; t++ {
		wg.Add(1)
		go func(t int) {
			defer wg.Done()
			ids := map[C.tboost_request_id]int{}
			order := []C.tboost_request_id{}
			for i := 0; i < perThread; i++ {
				k := t*perThread + i
				var sp C.tboost_sampling_params
				C.tboost_sampling_params_init(&sp)
				sp.max_tokens = C.uint32_t(maxTokens)
				sp.ignore_eos = 1
				sp.user_tag = C.uint64_t(k)
				if k%2 == 1 {
					sp.temperature = 0.8
					sp.top_p = 0.95
					sp.seed = C.uint64_t(1000 + k)
				}
				prompt := promptFor(k) // copied by tboost before enqueue returns
				var id C.tboost_request_id
				check(C.tb_enqueue(engine, (*C.int32_t)(unsafe.Pointer(&prompt[0])), C.size_t(len(prompt)), &sp, &id), "enqueue")
				ids[id] = k
				order = append(order, id)
			}
			atomic.AddInt32(&submitting, -1)
			for _, id := range order {
				var toks []string
				finish := C.tboost_finish_reason(C.TBOOST_FINISH_NONE)
				var ev [16]C.tboost_event
				for finish == C.TBOOST_FINISH_NONE {
					var ready, got C.size_t
					check(C.tb_wait(engine, id, 1000, &ready), "wait")
					check(C.tb_read(engine, id, &ev[0], 16, &got), "read")
					for _, e := range ev[:got] {
						if e.token >= 0 {
							toks = append(toks, strconv.Itoa(int(e.token)))
						}
						finish = e.finish
					}
				}
				line := fmt.Sprintf("request %d: %s (%s)", ids[id], strings.Join(toks, " "),
					C.GoString(C.tboost_finish_reason_name(C.int32_t(finish))))
				mu.Lock()
				outputs[ids[id]] = line
				mu.Unlock()
			}
		}(t)
	}
	wg.Wait()
	<-done

	keys := make([]int, 0, len(outputs))
	for k := range outputs {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	for _, k := range keys {
		fmt.Println(outputs[k])
	}
	var st C.tboost_stats
	check(C.tb_stats(engine, &st), "stats")
	fmt.Printf("stats: %d steps, %d generated tokens, %d finished\n", uint64(st.steps), uint64(st.generated_tokens), uint64(st.finished))
	C.tboost_engine_free(engine)
	if len(os.Args) > 5 {
		chat(os.Args[5])
	}
}
