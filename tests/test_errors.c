/* Version, error codes, names, messages and their per-thread storage. */
#include <pthread.h>

#include "testutil.h"

static const int all_codes[] = {KVT_OK,       KVT_EINVAL,   KVT_ENOMEM,    KVT_ENOSPC,
                                 KVT_ENOTSUP,  KVT_EIO,      KVT_ECORRUPT,  KVT_ENOENT,
                                 KVT_ERANGE,   KVT_EOVERFLOW, KVT_ESTATE,   KVT_EBUSY,
                                 KVT_ETIMEDOUT, KVT_EAGAIN,  KVT_EINTERNAL};

static void test_version(void **state)
{
    (void)state;
    assert_int_equal(kvt_version(), KVT_VERSION_NUMBER);
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", KVT_VERSION_MAJOR, KVT_VERSION_MINOR,
             KVT_VERSION_PATCH);
    assert_string_equal(kvt_version_string(), want);
    assert_int_equal(KVT_VERSION_NUMBER,
                     KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH);
}

static void test_codes_pinned(void **state)
{
    (void)state;
    /* Released values never change: this list is the ABI. */
    assert_int_equal(KVT_EINVAL, -1);
    assert_int_equal(KVT_ENOMEM, -2);
    assert_int_equal(KVT_ENOSPC, -3);
    assert_int_equal(KVT_ENOTSUP, -4);
    assert_int_equal(KVT_EIO, -5);
    assert_int_equal(KVT_ECORRUPT, -6);
    assert_int_equal(KVT_ENOENT, -7);
    assert_int_equal(KVT_ERANGE, -8);
    assert_int_equal(KVT_EOVERFLOW, -9);
    assert_int_equal(KVT_ESTATE, -10);
    assert_int_equal(KVT_EBUSY, -11);
    assert_int_equal(KVT_ETIMEDOUT, -12);
    assert_int_equal(KVT_EAGAIN, -13);
    assert_int_equal(KVT_EINTERNAL, -14);
}

static void test_names_and_text(void **state)
{
    (void)state;
    size_t n = sizeof all_codes / sizeof all_codes[0];
    for (size_t i = 0; i < n; i++) {
        const char *name = kvt_err_name(all_codes[i]);
        assert_non_null(name);
        assert_string_not_equal(name, "KVT_E?");
        assert_true(strncmp(name, "KVT_", 4) == 0);
        assert_string_not_equal(kvt_strerror(all_codes[i]), "unknown error code");
        for (size_t j = 0; j < i; j++) {
            assert_string_not_equal(name, kvt_err_name(all_codes[j]));
            assert_string_not_equal(kvt_strerror(all_codes[i]), kvt_strerror(all_codes[j]));
        }
    }
    assert_string_equal(kvt_err_name(KVT_EINVAL), "KVT_EINVAL");
    assert_string_equal(kvt_err_name(-999), "KVT_E?");
    assert_string_equal(kvt_err_name(5), "KVT_E?");
    assert_string_equal(kvt_strerror(-999), "unknown error code");
}

static void test_last_error(void **state)
{
    (void)state;
    kvt_clear_error();
    assert_string_equal(kvt_last_error(), "");
    TU_EXPECT_ERR(kvt_pool_create(NULL, NULL), KVT_EINVAL, "out");
    kvt_pool *p = (kvt_pool *)0x1;
    TU_EXPECT_ERR(kvt_pool_create(NULL, &p), KVT_EINVAL, "opts");
    assert_null(p); /* *out is cleared on failure */
    kvt_clear_error();
    assert_string_equal(kvt_last_error(), "");
}

static void *other_thread(void *arg)
{
    (void)arg;
    /* A fresh thread starts with no message, then gets its own. */
    int empty = kvt_last_error()[0] == '\0';
    kvt_geometry g = {0};
    int rc = kvt_geometry_validate(&g);
    int named = strstr(kvt_last_error(), "n_layers") != NULL;
    return (void *)(intptr_t)(empty && rc == KVT_EINVAL && named);
}

static void test_last_error_per_thread(void **state)
{
    (void)state;
    TU_EXPECT_ERR(kvt_pool_opts_init(NULL), KVT_EINVAL, "opts");
    pthread_t t;
    void *ok = NULL;
    assert_int_equal(pthread_create(&t, NULL, other_thread, NULL), 0);
    assert_int_equal(pthread_join(t, &ok), 0);
    assert_true((intptr_t)ok);
    /* The other thread's failure did not overwrite this thread's message. */
    assert_non_null(strstr(kvt_last_error(), "opts"));
}

static void test_dtype_and_features(void **state)
{
    (void)state;
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_F16), 2);
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_BF16), 2);
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_F32), 4);
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_DEFAULT), 0);
    assert_int_equal(kvt_dtype_size(77), 0);
    uint32_t f = kvt_build_features();
    assert_int_equal(f & ~(KVT_FEATURE_CUDA | KVT_FEATURE_NUMA | KVT_FEATURE_URING |
                           KVT_FEATURE_REMOTE), 0);
#ifdef KVT_TEST_EXPECT_CUDA
    assert_int_equal(!!(f & KVT_FEATURE_CUDA), KVT_TEST_EXPECT_CUDA);
#endif
#ifdef KVT_TEST_EXPECT_REDIS
    assert_int_equal(!!(f & KVT_FEATURE_REMOTE), KVT_TEST_EXPECT_REDIS);
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_version),
        cmocka_unit_test(test_codes_pinned),
        cmocka_unit_test(test_names_and_text),
        cmocka_unit_test(test_last_error),
        cmocka_unit_test(test_last_error_per_thread),
        cmocka_unit_test(test_dtype_and_features),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
