# libkvtier - plain GNU make build.
#
#   make                 library (build/lib) and programs (build/bin)
#   make check           all tests              make check-asan      ASan + UBSan
#   make check-tsan      ThreadSanitizer over the threaded tests
#   make check-valgrind  tests under valgrind   make demo            kvtier-decode, embedded model
#   make fuzz            libFuzzer on the profile parser, GGUF reader and sequence
#                        stream reader (FUZZ_TIME s each)
#   make abi-check       ABI vs lib/libkvtier.abi   make abi-dump     rewrite the baseline
#   make install / uninstall  (PREFIX, LIBDIR, INCLUDEDIR, MANDIR, BINDIR, DESTDIR)
#   make check-gpu       CUDA kernel tests on the GPU (+ compute-sanitizer)
#   CUDA=0 turns the CUDA backend off (default: on when nvcc is found)
#   WERROR=1 turns warnings into errors (CI)    O=DIR builds elsewhere (default build)

VERSION_MAJOR := $(shell sed -n 's/^\#define KVT_VERSION_MAJOR \([0-9]*\).*/\1/p' include/kvtier/version.h)
VERSION_MINOR := $(shell sed -n 's/^\#define KVT_VERSION_MINOR \([0-9]*\).*/\1/p' include/kvtier/version.h)
VERSION_PATCH := $(shell sed -n 's/^\#define KVT_VERSION_PATCH \([0-9]*\).*/\1/p' include/kvtier/version.h)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR).$(VERSION_PATCH)

PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
MANDIR     ?= $(PREFIX)/share/man
BINDIR     ?= $(PREFIX)/bin
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
DESTDIR    ?=

.DEFAULT_GOAL := all

O      ?= build
CC     ?= cc
CXX    ?= c++
CFLAGS ?= -O2 -g
CXXFLAGS ?= -O2 -g
LDFLAGS ?=
SAN    ?=
WERROR ?= 0

CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/nvcc))
# The build directory remembers CUDA=0/1 given on a command line
# ($(O)/build.mk), so a later `make install` or `make check` in it builds
# the same library instead of detecting nvcc again.
ifeq ($(origin CUDA),command line)
ifneq ($(shell cat $(O)/build.mk 2>/dev/null),CUDA := $(CUDA))
$(shell mkdir -p $(O) && echo 'CUDA := $(CUDA)' > $(O)/build.mk)
endif
else
-include $(O)/build.mk
endif
ifeq ($(origin CUDA),undefined)
CUDA := $(if $(NVCC),1,0)
endif
NVCC_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90
NVCC_WARN := -Xcompiler -Wall,-Wextra $(if $(filter 1,$(WERROR)),-Werror all-warnings -Xcompiler -Werror)

LIBNAME  := libkvtier
SONAME   := $(LIBNAME).so.$(VERSION_MAJOR)
SOFILE   := $(LIBNAME).so.$(VERSION)

WARN := -Wall -Wextra -Wshadow -Wconversion -Wstrict-prototypes -Wmissing-prototypes \
        -Wno-sign-conversion
ifeq ($(WERROR),1)
WARN += -Werror
endif
comma := ,
# SAN=1: ASan + UBSan; SAN=thread: ThreadSanitizer (check-tsan).
SANFLAGS := $(if $(filter thread,$(SAN)),-fsanitize=thread -fno-omit-frame-pointer,$(if $(SAN),-fsanitize=address$(comma)undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined))

# ---- dependencies: found with pkg-config, installed when possible ----------
# name-in-pkg-config:debian-package
LIB_DEPS  := liburing:liburing-dev numa:libnuma-dev
TEST_DEPS := cmocka:libcmocka-dev
# The example decoder's matrix products (not the library's).
DECODE_DEPS := openblas:libopenblas-dev

# $(call kvt_deps,deps,output-file): checks, installs (root + apt-get) or
# stops with the exact command, then records the flags.
define kvt_deps
	@mkdir -p $(dir $(2))
	@missing=""; command -v pkg-config >/dev/null 2>&1 || missing="pkg-config"; \
	for d in $(1); do pc=$${d%%:*}; pkg=$${d#*:}; \
	  pkg-config --exists $$pc 2>/dev/null || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "kvtier: installing missing packages:$$missing"; \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing) \
	      || { echo "kvtier: apt-get install failed"; exit 1; }; \
	  else \
	    echo "kvtier: missing build dependencies. Run:"; \
	    echo "    sudo apt-get install -y$$missing"; exit 1; \
	  fi; \
	fi; \
	pcs=""; for d in $(1); do pcs="$$pcs $${d%%:*}"; done; \
	{ echo "$(3)_CFLAGS := $$(pkg-config --cflags $$pcs)"; \
	  echo "$(3)_LIBS := $$(pkg-config --libs $$pcs)"; } > $(2).tmp && mv $(2).tmp $(2)
endef

NODEP_GOALS := clean distclean uninstall help
ifneq ($(filter-out $(NODEP_GOALS),$(or $(MAKECMDGOALS),all)),)
include $(O)/config.mk
# The example decoder's OpenBLAS: not for goals that build only the library.
ifneq ($(filter-out install lib abi-dump abi-check,$(or $(MAKECMDGOALS),all)),)
include $(O)/config-decode.mk
endif
ifneq ($(filter check% tsan-run tests gpu-tests gpu-bins $(O)/tests/%,$(MAKECMDGOALS)),)
include $(O)/config-test.mk
endif
include $(O)/config-redis.mk
endif
# REDIS=0 leaves the remote tier out (kvtier/remote.h: KVT_ENOTSUP).
ifeq ($(REDIS),0)
REDIS_HAVE := 0
endif

$(O)/config.mk: Makefile
	$(call kvt_deps,$(LIB_DEPS),$@,DEP)
$(O)/config-decode.mk: Makefile $(O)/config.mk   # one apt-get at a time under -j
	$(call kvt_deps,$(DECODE_DEPS),$@,BLAS)
$(O)/config-test.mk: Makefile $(O)/config.mk $(O)/config-decode.mk
	$(call kvt_deps,$(TEST_DEPS),$@,CMOCKA)
	@# The remote tier's tests start redis-server themselves (exit 77 without it).
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-benchmark >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "kvtier: installing redis-server redis-tools (the remote tier's tests)"; \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server \
	      redis-tools) || echo "kvtier: could not install redis-server: its tests will skip"; \
	  else echo "kvtier: no redis-server: the remote tier's tests skip (sudo apt-get install -y redis-server redis-tools)"; fi; \
	fi
# hiredis, for the remote tier: optional (like nvcc). Used when pkg-config
# finds it, installed when it can be (root and apt-get), else left out.
$(O)/config-redis.mk: Makefile $(O)/config.mk $(O)/config-decode.mk
	@mkdir -p $(dir $@)
	@if [ "$(REDIS)" != 0 ] && ! pkg-config --exists hiredis 2>/dev/null && \
	    [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "kvtier: installing libhiredis-dev (the remote tier)"; \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libhiredis-dev) \
	    || echo "kvtier: apt-get install libhiredis-dev failed: no remote tier"; \
	fi; \
	if pkg-config --exists hiredis 2>/dev/null; then \
	  { echo "REDIS_HAVE := 1"; echo "REDIS_CFLAGS := $$(pkg-config --cflags hiredis)"; \
	    echo "REDIS_LIBS := $$(pkg-config --libs hiredis)"; } > $@.tmp; \
	else echo "kvtier: hiredis not found: building without the remote tier"; \
	  echo "REDIS_HAVE := 0" > $@.tmp; fi; mv $@.tmp $@

# ---- sources ----------------------------------------------------------------
LIB_SRCS := $(wildcard lib/core/*.c lib/select/*.c lib/attn/*.c lib/policy/*.c lib/tier/*.c \
                      lib/step/*.c lib/api/*.c) lib/backend/cpu.c
ifeq ($(REDIS_HAVE),1)
LIB_SRCS := $(filter-out lib/tier/rclient_none.c,$(LIB_SRCS))
DEP_CFLAGS += $(patsubst -I%,-isystem %,$(REDIS_CFLAGS)) # (its headers warn)
DEP_LIBS += $(REDIS_LIBS)
else
LIB_SRCS := $(filter-out lib/tier/rclient.c lib/tier/rconn.c lib/tier/rreply.c,$(LIB_SRCS))
endif
ifeq ($(CUDA),1)
CU_SRCS  := $(wildcard cuda/*.cu)
LIB_SRCS += $(filter-out lib/backend/cuda_none.c,$(wildcard lib/backend/cuda_*.c))
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lpthread
else
LIB_SRCS += lib/backend/cuda_none.c
CU_SRCS  :=
CUDA_LIBS :=
endif
LIB_OBJS := $(LIB_SRCS:%.c=$(O)/obj/%.o) $(CU_SRCS:%.cu=$(O)/obj/%.o)

BASE_CFLAGS := -std=c11 -D_GNU_SOURCE -fPIC -fvisibility=hidden -Iinclude $(WARN) $(SANFLAGS)
LIB_LDLIBS   = $(DEP_LIBS) $(CUDA_LIBS) -lm -lpthread

LIB_SO := $(O)/lib/$(SOFILE)
LIB_A  := $(O)/lib/$(LIBNAME).a

PROGS := $(O)/bin/kvtier-pool-demo $(O)/bin/kvtier-bench $(O)/bin/kvtier-profile \
         $(O)/bin/kvtier-decode
PROG_RPATH := -Wl,-rpath,'$$ORIGIN/../lib'

# ---- tests ------------------------------------------------------------------
# Tests of the public ABI link the shared library; tests of internal helpers
# (kvt__*) link the static one.
TESTS_SHARED := test_errors test_opts test_pool test_append test_random test_c_headers \
                test_select test_decode test_step test_mover test_policy test_place test_multi \
                test_tokenselect
TESTS_STATIC := test_convert test_crc32c test_mckp test_profiler test_contract test_redis_slot
# Static tests with the tier helpers (tests/tiertest.c).
TESTS_STATIC_TIER := test_share test_hostlru
# Fault-injection tests link a static library whose tier sources are built
# with KVT_FAULT_INJECTION; the installed library never has the hooks.
TESTS_FAULT  := test_mover_faults test_place_faults test_prefix test_prefix_load test_remote
# Tests of the example decoder's own parts (GGUF reader, tokenizers): no
# libkvtier; test_decode_model runs the decoder's engine on a GGUF it writes.
TESTS_DECODE := test_gguf test_tokenizer test_decode_model
TEST_BINS := $(addprefix $(O)/tests/,$(TESTS_SHARED) $(TESTS_STATIC) $(TESTS_STATIC_TIER) $(TESTS_FAULT) \
             $(TESTS_DECODE) test_cxx_headers)
# CUDA kernel tests (tests/gpu, mk/cuda.mk): each built against the GPU
# (exits 77 without one) and against the CPU emulation of cuda/emu.
include mk/cuda.mk
TEST_BINS += $(GPU_TEST_BINS)
TEST_SCRIPTS := tests/test_symbols.sh tests/test_man.sh tests/test_install.sh \
                tests/test_profile_tool.sh tests/test_decode_tool.sh tests/test_cpp_example.sh \
                tests/test_rust.sh tests/test_gpu_scripts.sh tests/test_layers.sh \
                tests/test_bench_prefix.sh tests/test_redis_slot.sh tests/test_bench_remote.sh
TEST_SCRIPTS += $(GPU_TEST_SCRIPTS)

.PHONY: all lib programs check check-asan check-tsan tsan-run check-valgrind demo install uninstall clean \
        distclean help tests cuda-compile fuzz
all: lib programs
lib: $(LIB_SO) $(LIB_A) $(O)/lib/kvtier.pc
programs: $(PROGS)
tests: $(TEST_BINS)

# The SIMD kernels are one source (lib/attn/kern_impl.h) compiled three
# times; the library picks one at run time from cpuid.
$(O)/obj/lib/attn/kern_avx2.o: ISA_CFLAGS = -mavx2 -mfma -mf16c
$(O)/obj/lib/attn/kern_avx512.o: ISA_CFLAGS = -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c

$(O)/obj/%.o: %.c $(wildcard include/kvtier/*.h lib/*/*.h cuda/*.h) | $(O)/config.mk
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) $(DEP_CFLAGS) $(CFLAGS) $(ISA_CFLAGS) -c $< -o $@

$(O)/obj/%.o: %.cu $(wildcard include/kvtier/*.h cuda/*.h cuda/*.cuh) lib/core/forced.h
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O2 $(NVCC_ARCH) -Iinclude -Icuda $(NVCC_WARN) \
	  -Xcompiler -fPIC,-fvisibility=hidden,-fno-threadsafe-statics -c $< -o $@

$(LIB_SO): $(LIB_OBJS) lib/libkvtier.map $(wildcard $(O)/build.mk)
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=lib/libkvtier.map -Wl,-z,defs \
	  -Wl,--as-needed $(SANFLAGS) $(LDFLAGS) -o $@ $(LIB_OBJS) $(LIB_LDLIBS)
	ln -sf $(SOFILE) $(O)/lib/$(SONAME)
	ln -sf $(SONAME) $(O)/lib/$(LIBNAME).so

TIER_SRCS  := $(filter lib/tier/%,$(LIB_SRCS))
FAULT_OBJS := $(filter-out $(TIER_SRCS:%.c=$(O)/obj/%.o),$(LIB_OBJS)) \
              $(TIER_SRCS:%.c=$(O)/obj-fault/%.o)
$(O)/obj-fault/%.o: %.c $(wildcard include/kvtier/*.h lib/*/*.h) | $(O)/config.mk
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) $(DEP_CFLAGS) $(CFLAGS) -DKVT_FAULT_INJECTION -c $< -o $@
$(O)/lib/libkvtier-fault.a: $(FAULT_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $(FAULT_OBJS)

$(LIB_A): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $(LIB_OBJS)

# The .pc file is written again at install time so PREFIX/LIBDIR given to
# `make install` are the ones recorded.
define kvt_pc
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
	    -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(VERSION)|g' \
	    -e 's|@LIBS_PRIVATE@|$(strip $(CUDA_LIBS) $(if $(filter 1,$(REDIS_HAVE)),$(REDIS_LIBS)) -lm -lpthread)|g' pkgconfig/kvtier.pc.in > $(1)
endef
$(O)/lib/kvtier.pc: pkgconfig/kvtier.pc.in Makefile
	@mkdir -p $(dir $@)
	$(call kvt_pc,$@)

$(O)/bin/kvtier-pool-demo: examples/pool-demo/pool_demo.c $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -Iinclude $(WARN) $(SANFLAGS) $(CFLAGS) $< -o $@ \
	  -L$(O)/lib -lkvtier $(PROG_RPATH) $(LDFLAGS) -lm

# bench_io.c's reference reader uses liburing directly. With CUDA the
# program also carries bench_cuda.c (--backend cuda), which calls the
# library's hidden kernel launchers: it links the static library then.
BENCH_SRCS := examples/bench/bench.c examples/bench/bench_io.c examples/bench/bench_tier.c \
              examples/bench/bench_fork.c examples/bench/bench_prefix.c examples/bench/bench_remote.c
BENCH_HDRS := examples/bench/bench_io.h examples/bench/bench_cuda.h
ifeq ($(CUDA),1)
$(O)/bin/kvtier-bench: $(BENCH_SRCS) examples/bench/bench_cuda.c $(BENCH_HDRS) $(LIB_A) $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -Iinclude -Icuda -I$(CUDA_HOME)/include -DKVT_BENCH_CUDA $(WARN) \
	  $(SANFLAGS) $(DEP_CFLAGS) $(CFLAGS) -pthread $(filter %.c,$^) -o $@ $(LIB_A) $(LDFLAGS) \
	  $(LIB_LDLIBS) -lstdc++
# The same program on the CPU emulation of CUDA (cuda/emu): --smoke runs
# its CUDA cases here (tests/test_bench_cuda.sh).
$(O)/bin/kvtier-bench-emu: $(BENCH_SRCS) examples/bench/bench_cuda.c $(BENCH_HDRS) $(EMU_LIB)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -Iinclude -Icuda -I$(CUDA_HOME)/include -DKVT_BENCH_CUDA \
	  -DKVT_BENCH_EMU $(WARN) $(SANFLAGS) $(DEP_CFLAGS) $(CFLAGS) -pthread $(filter %.c,$^) -o $@ \
	  $(EMU_LIB) $(LDFLAGS) $(DEP_LIBS) -lstdc++ -lm -lpthread
else
$(O)/bin/kvtier-bench: $(BENCH_SRCS) $(BENCH_HDRS) $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -Iinclude $(WARN) $(SANFLAGS) $(DEP_CFLAGS) $(CFLAGS) -pthread \
	  $(filter %.c,$^) -o $@ -L$(O)/lib -lkvtier $(PROG_RPATH) $(LDFLAGS) $(DEP_LIBS) -lm
endif

# The example decoder: OpenBLAS for the model's products, -O3 and
# -fopenmp-simd so its small loops vectorise.
DECODE_SRCS := examples/decode/main.c examples/decode/engine.c examples/decode/model.c \
               examples/decode/gguf.c examples/decode/tokenizer.c examples/decode/session.c \
               examples/decode/draft.c examples/decode/prefill_ab.c examples/decode/prefix_demo.c \
               examples/decode/remote_run.c examples/decode/selmass.c
DECODE_HDRS := $(wildcard examples/decode/*.h)
$(O)/bin/kvtier-decode: $(DECODE_SRCS) $(DECODE_HDRS) $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -Iinclude $(WARN) $(SANFLAGS) $(BLAS_CFLAGS) $(CFLAGS) -O3 \
	  -fopenmp-simd -pthread $(DECODE_SRCS) -o $@ -L$(O)/lib -lkvtier $(PROG_RPATH) $(LDFLAGS) \
	  $(BLAS_LIBS) -lm

$(O)/bin/kvtier-profile: examples/profile/profile.c $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -Iinclude $(WARN) $(SANFLAGS) $(CFLAGS) $< -o $@ \
	  -L$(O)/lib -lkvtier $(PROG_RPATH) $(LDFLAGS) -lm

# ---- tests ------------------------------------------------------------------
TEST_CFLAGS = -std=c11 -D_GNU_SOURCE -Iinclude -Ilib/core $(WARN) -Wno-conversion -pthread \
              -DKVT_TEST_EXPECT_CUDA=$(CUDA) -DKVT_TEST_EXPECT_REDIS=$(or $(REDIS_HAVE),0) \
              $(SANFLAGS) $(CMOCKA_CFLAGS) $(CFLAGS)

# Test helpers (tests/tiertest.c, tests/placetest.c): compiled into each test
# that includes their header, with that test's flags (-DKVT_FAULT_INJECTION
# for the fault tests); the recipes compile every .c prerequisite.
TIERTEST_SRCS  := tests/tiertest.c
PLACETEST_SRCS := tests/placetest.c $(TIERTEST_SRCS)
$(O)/tests/test_mover $(O)/tests/test_mover_faults $(O)/tests/test_tokenselect: $(TIERTEST_SRCS)
$(O)/tests/test_place $(O)/tests/test_place_faults $(O)/tests/test_multi: $(PLACETEST_SRCS)
# The prefix cache tests: tests/prefixtest.c too.
PREFIXTEST_SRCS := tests/prefixtest.c $(PLACETEST_SRCS)
$(O)/tests/test_prefix $(O)/tests/test_prefix_load: $(PREFIXTEST_SRCS) tests/prefixtest.h
# The remote tier's test: its Redis servers (tests/redistest.c) where hiredis is.
$(O)/tests/test_remote: $(PREFIXTEST_SRCS) tests/prefixtest.h \
                        $(if $(filter 1,$(REDIS_HAVE)),tests/redistest.c tests/redistest.h)
$(O)/tests/test_remote: TEST_EXTRA = $(patsubst -I%,-isystem %,$(REDIS_CFLAGS)) -DCTOK=16384

$(addprefix $(O)/tests/,$(TESTS_SHARED)): $(O)/tests/%: tests/%.c tests/testutil.h tests/tiertest.h \
                                           tests/placetest.h $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) $(TEST_EXTRA) $(filter %.c,$^) -o $@ -L$(O)/lib -lkvtier \
	  -Wl,-rpath,'$$ORIGIN/../lib' $(CMOCKA_LIBS) $(LDFLAGS) -lm

$(addprefix $(O)/tests/,$(TESTS_STATIC)): $(O)/tests/%: tests/%.c tests/testutil.h $(LIB_A)
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) $< -o $@ $(LIB_A) $(CMOCKA_LIBS) $(LIB_LDLIBS) $(LDFLAGS)

$(addprefix $(O)/tests/,$(TESTS_STATIC_TIER)): $(O)/tests/%: tests/%.c tests/testutil.h \
                                               tests/tiertest.h $(TIERTEST_SRCS) $(LIB_A)
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) $(filter %.c,$^) -o $@ $(LIB_A) $(CMOCKA_LIBS) $(LIB_LDLIBS) $(LDFLAGS)

$(addprefix $(O)/tests/,$(TESTS_FAULT)): $(O)/tests/%: tests/%.c tests/testutil.h tests/tiertest.h \
                                          tests/placetest.h $(O)/lib/libkvtier-fault.a
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) $(TEST_EXTRA) -DKVT_FAULT_INJECTION $(filter %.c,$^) -o $@ $(O)/lib/libkvtier-fault.a \
	  $(CMOCKA_LIBS) $(LIB_LDLIBS) $(LDFLAGS)

$(O)/tests/test_gguf: tests/test_gguf.c tests/gguf_writer.h examples/decode/gguf.c \
                     examples/decode/gguf.h
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) -Iexamples/decode tests/test_gguf.c examples/decode/gguf.c -o $@ \
	  $(CMOCKA_LIBS) $(LDFLAGS) -lm
$(O)/tests/test_tokenizer: tests/test_tokenizer.c examples/decode/tokenizer.c examples/decode/gguf.c \
                           $(DECODE_HDRS) tests/testutil.h
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) -Iexamples/decode tests/test_tokenizer.c examples/decode/tokenizer.c \
	  examples/decode/gguf.c -o $@ $(CMOCKA_LIBS) $(LDFLAGS) -lm

DECODE_LIB_SRCS := examples/decode/engine.c examples/decode/model.c examples/decode/gguf.c \
                   examples/decode/tokenizer.c examples/decode/selmass.c
$(O)/tests/test_decode_model: tests/test_decode_model.c $(DECODE_LIB_SRCS) $(DECODE_HDRS) \
                              tests/testutil.h tests/gguf_writer.h $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) $(BLAS_CFLAGS) -fopenmp-simd -Iexamples/decode tests/test_decode_model.c \
	  $(DECODE_LIB_SRCS) -o $@ -L$(O)/lib -lkvtier -Wl,-rpath,'$$ORIGIN/../lib' $(CMOCKA_LIBS) \
	  $(LDFLAGS) $(BLAS_LIBS) -lm

# The public headers must compile as strict C11 and as C++17, warnings fatal.
$(O)/tests/test_c_headers: TEST_EXTRA = -Wpedantic -Werror
$(O)/tests/test_cxx_headers: tests/test_cxx_headers.cpp $(wildcard include/kvtier/*.h) $(LIB_SO)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -Iinclude -Wall -Wextra -Wpedantic -Werror $(SANFLAGS) $(CXXFLAGS) \
	  $< -o $@ -L$(O)/lib -lkvtier -Wl,-rpath,'$$ORIGIN/../lib' $(CMOCKA_LIBS) $(LDFLAGS)

# Under valgrind the CUDA kernel tests are left out: their emulated runs
# are checked by ASan + UBSan (check-asan), the GPU runs by compute-sanitizer
# (check-gpu).
check: all $(TEST_BINS)
	@O=$(O) VALGRIND="$(VALGRIND)" MAKE="$(MAKE)" CC="$(CC)" CXX="$(CXX)" NVCC="$(NVCC)" \
	  sh tests/run.sh $(if $(VALGRIND),$(filter-out $(GPU_TEST_BINS),$(TEST_BINS)),$(TEST_BINS)) \
	  $(if $(VALGRIND)$(SAN),,$(TEST_SCRIPTS))

check-asan:
	$(MAKE) O=$(O)/asan SAN=1 check

# ThreadSanitizer over the tests that run the worker threads and the tier
# mover (the CUDA emulation's fibers are not TSan-clean by design, so the
# build is CUDA=0).
TSAN_TESTS := test_decode test_step test_random test_contract test_mover test_place test_share test_multi \
              test_prefix test_prefix_load test_remote
check-tsan:
	$(MAKE) O=$(O)/tsan SAN=thread CUDA=0 tsan-run
tsan-run: $(addprefix $(O)/tests/,$(TSAN_TESTS))
	@O=$(O) TSAN_OPTIONS="halt_on_error=1 exitcode=66" sh tests/run.sh $^

check-valgrind:
	@command -v valgrind >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -q && apt-get install -y -q valgrind; \
	  else echo "kvtier: run: sudo apt-get install -y valgrind"; exit 1; fi; }
	$(MAKE) O=$(O) check VALGRIND="valgrind -q --error-exitcode=1 --leak-check=full \
	  --show-leak-kinds=definite,indirect,possible --errors-for-leak-kinds=definite,indirect,possible"

# libFuzzer on the profile parser: the library is rebuilt with clang and
# the sanitizers under $(O)/fuzz, then the target runs for FUZZ_TIME seconds
# over a scratch corpus seeded from tests/fuzz/corpus/policy_load (kept
# read-only, so a run leaves the tree clean). Crash inputs go to $(O)/fuzz/.
FUZZ_TIME ?= 60
FUZZ_CC   ?= clang
FUZZ_SAN  := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
fuzz: | $(O)/config.mk
	@probe='int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return d && n; }'; \
	echo "$$probe" | $(FUZZ_CC) -fsanitize=fuzzer -x c - -o $(O)/.fuzz-probe >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "kvtier: installing clang and libFuzzer (clang libclang-rt-dev)"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang libclang-rt-dev; \
	  else echo "kvtier: make fuzz needs clang with libFuzzer. Run:"; \
	    echo "    sudo apt-get install -y clang libclang-rt-dev"; exit 1; fi; }; \
	rm -f $(O)/.fuzz-probe
	$(MAKE) O=$(O)/fuzz CC=$(FUZZ_CC) CUDA=0 SAN= \
	  CFLAGS="-O1 -g -fsanitize=fuzzer-no-link $(FUZZ_SAN)" $(O)/fuzz/lib/$(LIBNAME).a
	@mkdir -p $(O)/fuzz/bin $(O)/fuzz/corpus/policy_load
	$(FUZZ_CC) -std=c11 -D_GNU_SOURCE -Iinclude -Ilib/core -O1 -g -fsanitize=fuzzer $(FUZZ_SAN) \
	  tests/fuzz/fuzz_policy_load.c $(O)/fuzz/lib/$(LIBNAME).a $(DEP_LIBS) -lm -lpthread \
	  -o $(O)/fuzz/bin/fuzz_policy_load
	$(O)/fuzz/bin/fuzz_policy_load -max_total_time=$(FUZZ_TIME) -timeout=10 -rss_limit_mb=2048 \
	  -print_final_stats=1 -artifact_prefix=$(O)/fuzz/ \
	  $(O)/fuzz/corpus/policy_load tests/fuzz/corpus/policy_load
	@mkdir -p $(O)/fuzz/corpus/gguf
	$(FUZZ_CC) -std=c11 -D_GNU_SOURCE -Iexamples/decode -O1 -g -fsanitize=fuzzer $(FUZZ_SAN) \
	  tests/fuzz/fuzz_gguf.c examples/decode/gguf.c -o $(O)/fuzz/bin/fuzz_gguf
	$(O)/fuzz/bin/fuzz_gguf -max_total_time=$(FUZZ_TIME) -timeout=10 -rss_limit_mb=2048 \
	  -print_final_stats=1 -artifact_prefix=$(O)/fuzz/gguf- \
	  $(O)/fuzz/corpus/gguf tests/fuzz/corpus/gguf
	@mkdir -p $(O)/fuzz/corpus/seq_restore $(O)/fuzz/seeds/seq_restore
	$(FUZZ_CC) -std=c11 -D_GNU_SOURCE -Iinclude -O1 -g $(FUZZ_SAN) tests/fuzz/gen_seq_corpus.c \
	  $(O)/fuzz/lib/$(LIBNAME).a $(DEP_LIBS) -lm -lpthread -o $(O)/fuzz/bin/gen_seq_corpus
	$(O)/fuzz/bin/gen_seq_corpus $(O)/fuzz/seeds/seq_restore
	$(FUZZ_CC) -std=c11 -D_GNU_SOURCE -Iinclude -Ilib/core -O1 -g -fsanitize=fuzzer $(FUZZ_SAN) \
	  tests/fuzz/fuzz_seq_restore.c $(O)/fuzz/lib/$(LIBNAME).a $(DEP_LIBS) -lm -lpthread \
	  -o $(O)/fuzz/bin/fuzz_seq_restore
	$(O)/fuzz/bin/fuzz_seq_restore -max_total_time=$(FUZZ_TIME) -timeout=10 -rss_limit_mb=2048 \
	  -print_final_stats=1 -artifact_prefix=$(O)/fuzz/seq- \
	  $(O)/fuzz/corpus/seq_restore $(O)/fuzz/seeds/seq_restore

include mk/abi.mk

# CI: make sure cuda/ compiles whenever nvcc exists.
cuda-compile:
	@if [ -n "$(NVCC)" ]; then $(MAKE) O=$(O) CUDA=1 lib && echo "cuda-compile: ok ($(NVCC))"; \
	 else echo "cuda-compile: nvcc not found, skipped"; fi

# The main job: the example decoder on its embedded default model, tiered.
# The main job on its embedded model: dense and tiered decoding side by
# side on one prompt (one prefill feeds both).
demo: $(O)/bin/kvtier-decode
	$(O)/bin/kvtier-decode --compare

# ---- install ------------------------------------------------------------------
# Installs what `make` built (the library, headers, pkg-config file, man
# pages, and the programs that exist): it builds the library if needed,
# never the example programs (nor their OpenBLAS dependency).
install: lib
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR)/kvtier $(DESTDIR)$(PKGCONFIGDIR) \
	  $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man3 $(DESTDIR)$(MANDIR)/man5 \
	  $(DESTDIR)$(MANDIR)/man7 $(DESTDIR)$(BINDIR)
	install -m 644 include/kvtier/*.h $(DESTDIR)$(INCLUDEDIR)/kvtier/
	install -m 755 $(LIB_SO) $(DESTDIR)$(LIBDIR)/
	ln -sf $(SOFILE) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/$(LIBNAME).so
	install -m 644 $(LIB_A) $(DESTDIR)$(LIBDIR)/
	$(call kvt_pc,$(DESTDIR)$(PKGCONFIGDIR)/kvtier.pc)
	install -m 644 man/man1/*.1 $(DESTDIR)$(MANDIR)/man1/
	install -m 644 man/man3/*.3 $(DESTDIR)$(MANDIR)/man3/
	install -m 644 man/man5/*.5 $(DESTDIR)$(MANDIR)/man5/
	install -m 644 man/man7/*.7 $(DESTDIR)$(MANDIR)/man7/
	$(if $(wildcard $(filter-out %-emu,$(PROGS))),install -m 755 \
	  $(wildcard $(filter-out %-emu,$(PROGS))) $(DESTDIR)$(BINDIR)/)

uninstall:
	rm -f $(DESTDIR)$(LIBDIR)/$(SOFILE) $(DESTDIR)$(LIBDIR)/$(SONAME) \
	  $(DESTDIR)$(LIBDIR)/$(LIBNAME).so $(DESTDIR)$(LIBDIR)/$(LIBNAME).a \
	  $(DESTDIR)$(PKGCONFIGDIR)/kvtier.pc
	rm -rf $(DESTDIR)$(INCLUDEDIR)/kvtier
	for f in man/man1/*.1; do rm -f $(DESTDIR)$(MANDIR)/man1/$${f##*/}; done
	for f in man/man3/*.3; do rm -f $(DESTDIR)$(MANDIR)/man3/$${f##*/}; done
	for f in man/man5/*.5; do rm -f $(DESTDIR)$(MANDIR)/man5/$${f##*/}; done
	for f in man/man7/*.7; do rm -f $(DESTDIR)$(MANDIR)/man7/$${f##*/}; done
	for f in $(PROGS); do rm -f $(DESTDIR)$(BINDIR)/$${f##*/}; done

clean distclean:
	rm -rf $(O)

help:
	@sed -n '2,11p' Makefile
