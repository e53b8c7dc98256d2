/* tboost.h compiles as strict C99 (-std=c99 -pedantic -Wall -Wextra -Werror) and its types
 * are usable from C: every struct, enum and callback type appears below. */
#include "tboost.h"

#if TBOOST_ABI_VERSION < 1
#error "TBOOST_ABI_VERSION must be at least 1"
#endif

static bool on_progress(float progress, void *user_data) {
  (void)user_data;
  return progress >= 0.0f;
}

static void on_log(tboost_log_level level, const char *target, const char *message, void *user_data) {
  (void)level, (void)target, (void)message, (void)user_data;
}

int tboost_header_check_c(void);
int tboost_header_check_c(void) {
  tboost_sampling_params sp;
  tboost_event ev;
  tboost_stats st;
  tboost_progress_fn progress = on_progress;
  tboost_log_fn log = on_log;
  tboost_status s = TBOOST_OK;
  tboost_finish_reason f = TBOOST_FINISH_NONE;
  tboost_log_level l = TBOOST_LOG_INFO;
  tboost_request_id id = TBOOST_ANY_REQUEST;
  tboost_config *cfg = NULL;
  tboost_model *model = NULL;
  tboost_engine *engine = NULL;
  sp.struct_size = (uint32_t)sizeof sp;
  ev.struct_size = (uint32_t)sizeof ev;
  st.struct_size = (uint32_t)sizeof st;
  return (int)(sp.struct_size + ev.struct_size + st.struct_size) + (progress != NULL) + (log != NULL) + (int)s +
         (int)f + (int)l + (int)id + (cfg == NULL) + (model == NULL) + (engine == NULL) +
         (int)sizeof(TBOOST_VERSION_STRING) + TBOOST_VERSION_MAJOR + TBOOST_VERSION_MINOR + TBOOST_VERSION_PATCH;
}
