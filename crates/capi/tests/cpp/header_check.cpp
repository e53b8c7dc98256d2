// tboost.h compiles as strict C++17 (-std=c++17 -pedantic -Wall -Wextra -Werror), its
// enums have int32_t underlying types, and its structs are standard-layout C structs of
// the sizes of their first version.
#include "tboost.h"

#include <cstdint>
#include <type_traits>

static_assert(std::is_same_v<std::underlying_type_t<tboost_status>, int32_t>);
static_assert(std::is_same_v<std::underlying_type_t<tboost_finish_reason>, int32_t>);
static_assert(std::is_same_v<std::underlying_type_t<tboost_log_level>, int32_t>);
// Second versions: sampling params grew from 64 to 104 bytes, events from 40 to 240; the
// first version's fields keep their places.
static_assert(std::is_standard_layout_v<tboost_sampling_params> && sizeof(tboost_sampling_params) == 104);
static_assert(offsetof(tboost_sampling_params, user_tag) == 56 && offsetof(tboost_sampling_params, prompt_logprobs) == 64);
static_assert(std::is_standard_layout_v<tboost_event> && sizeof(tboost_event) == 240);
static_assert(offsetof(tboost_event, error) == 36 && offsetof(tboost_event, n_top) == 40);
static_assert(std::is_standard_layout_v<tboost_stats> && sizeof(tboost_stats) == 144);
static_assert(offsetof(tboost_event, request_id) == 8 && offsetof(tboost_stats, waiting) == 8);
static_assert(TBOOST_ANY_REQUEST == 0);
// Fields appended to a versioned struct start where its first version ended (the minimum
// struct_size tboost_op_create takes): 40 bytes for matmul and MoE-grouped parameters.
static_assert(offsetof(tboost_matmul_params, tiling) == 40 && sizeof(tboost_matmul_params) == 56);
static_assert(offsetof(tboost_moe_grouped_params, tiling) == 40 && sizeof(tboost_moe_grouped_params) == 48);
static_assert(sizeof(tboost_matmul_swiglu_params) == 48 && sizeof(tboost_matmul_tiling) == 16);

int tboost_header_check_cxx() {
  tboost_status (*step)(tboost_engine*, size_t*) = tboost_engine_step;
  return step != nullptr && TBOOST_OK == 0;
}
