/* A C99 host linked against libtboost.so: greedy generation for one prompt.
 *   tboost_c_consumer MODEL */
#include <stdio.h>

#include "tboost.h"

static int fail(const char *what, tboost_status s) {
  char msg[512];
  tboost_last_error(msg, sizeof msg, NULL);
  fprintf(stderr, "%s: %s: %s\n", what, tboost_status_name(s), msg);
  return 1;
}

int main(int argc, char **argv) {
  tboost_model *model = NULL;
  tboost_engine *engine = NULL;
  tboost_sampling_params sp;
  tboost_request_id id = 0;
  tboost_event ev[8];
  tboost_finish_reason finish = TBOOST_FINISH_NONE;
  const int32_t prompt[] = {5, 17, 42, 99, 7};
  bool work = true;
  size_t n = 0, i;
  tboost_status s;

  if (argc != 2) {
    fprintf(stderr, "usage: %s MODEL\n", argv[0]);
    return 2;
  }
  if (tboost_abi_version() != TBOOST_ABI_VERSION) {
    fprintf(stderr, "libtboost ABI %u, header ABI %d\n", tboost_abi_version(), TBOOST_ABI_VERSION);
    return 1;
  }
  if ((s = tboost_model_load(argv[1], NULL, NULL, NULL, &model)) != TBOOST_OK) return fail("model_load", s);
  if ((s = tboost_engine_new(model, NULL, &engine)) != TBOOST_OK) return fail("engine_new", s);
  tboost_model_free(model);
  tboost_sampling_params_init(&sp);
  sp.max_tokens = 6;
  sp.ignore_eos = 1;
  if ((s = tboost_engine_enqueue(engine, prompt, 5, &sp, NULL, NULL, 0, &id)) != TBOOST_OK) return fail("enqueue", s);
  printf("tokens:");
  while (finish == TBOOST_FINISH_NONE) {
    if ((s = tboost_engine_has_work(engine, &work)) != TBOOST_OK) return fail("has_work", s);
    if (work && (s = tboost_engine_step(engine, NULL)) != TBOOST_OK) return fail("step", s);
    if ((s = tboost_engine_read(engine, id, ev, sizeof ev[0], 8, &n)) != TBOOST_OK) return fail("read", s);
    for (i = 0; i < n; i++) {
      if (ev[i].token >= 0) printf(" %d", (int)ev[i].token);
      finish = ev[i].finish;
    }
    if (!work && n == 0) return fail("generation stopped without a final event", TBOOST_ERR_INTERNAL);
  }
  printf("\nfinish: %s\n", tboost_finish_reason_name(finish));
  return tboost_engine_free(engine) == TBOOST_OK ? 0 : 1;
}
