/* The public headers compile as strict C11 (this file is built with
 * -std=c11 -Wpedantic -Werror by the Makefile), every header on its own
 * and all together, and the FFI-relevant layout promises hold. */
#include "kvtier/common.h"
#include "kvtier/version.h"
#include "kvtier/pool.h"
#include "kvtier/policy.h"
#include "kvtier/kvtier.h"

#include <stddef.h>

#include "testutil.h"

/* Options structs begin with struct_size; fields are fixed-width. */
_Static_assert(offsetof(kvt_pool_opts, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_seq_opts, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_stats, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_seq_info, struct_size) == 0, "struct_size first");
_Static_assert(sizeof(kvt_geometry) == 32, "geometry is 8 x uint32");
_Static_assert(sizeof(kvt_dtype) == 4 && sizeof(kvt_backend) == 4, "enums are uint32_t");
_Static_assert(sizeof(kvt_seq_id) == 8, "ids are 64-bit");
_Static_assert(offsetof(kvt_policy_opts, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_policy_heads, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_policy_head_info, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_profiler_opts, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvt_profiler_head_stats, struct_size) == 0, "struct_size first");
_Static_assert(sizeof(kvt_head_class) == 4, "enums are uint32_t");

static void test_macros_initialise(void **state)
{
    (void)state;
    kvt_pool_opts o = KVT_POOL_OPTS_INIT;
    kvt_seq_opts s = KVT_SEQ_OPTS_INIT;
    assert_int_equal(o.struct_size, sizeof o);
    assert_int_equal(s.struct_size, sizeof s);
    kvt_policy_opts po = KVT_POLICY_OPTS_INIT;
    kvt_profiler_opts fo = KVT_PROFILER_OPTS_INIT;
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    assert_int_equal(po.struct_size, sizeof po);
    assert_int_equal(fo.struct_size, sizeof fo);
    assert_int_equal(so.struct_size, sizeof so);
    assert_null(so.policy);
    assert_null(so.profiler);
    assert_int_equal(KVT_VERSION_NUMBER, kvt_version());
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_macros_initialise)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
