# CUDA kernels: the emulated build and the kernel tests (included by the
# Makefile). With CUDA=1 (nvcc found):
#   - cuda/*.cu are built by nvcc into the library (rules in the Makefile);
#   - the same sources are built by the host C++ compiler against the CPU
#     emulation of the CUDA execution model (cuda/emu, -DKVT_CUDA_EMU) into
#     $(O)/lib/libkvtier-emu.a, so the kernels' logic is tested on any
#     machine;
#   - every tests/gpu/test_cu_*.c links twice: $(O)/tests/gpu/test_cu_X
#     (the GPU; exits 77 where there is none) and test_cu_X-emu (emulated).
#   make gpu-bins    the GPU binaries alone (no emulated build)
#   make check-gpu   the GPU binaries alone, each also under compute-sanitizer
#                    memcheck and racecheck when the toolkit has it

GPU_TEST_SRCS := $(wildcard tests/gpu/test_cu_*.c)
GPU_TESTS     := $(GPU_TEST_SRCS:tests/gpu/%.c=%)

ifeq ($(CUDA),1)
EMU_SRCS := $(CU_SRCS) $(wildcard cuda/emu/*.cpp)
EMU_OBJS := $(patsubst %.cpp,$(O)/obj-emu/%.o,$(EMU_SRCS:%.cu=$(O)/obj-emu/%.o))
EMU_LIB  := $(O)/lib/libkvtier-emu.a
# The emulation alone (cuda/emu/*.cpp, no kernels): what test_emu links.
EMU_CORE_OBJS := $(patsubst %.cpp,$(O)/obj-emu/%.o,$(wildcard cuda/emu/*.cpp))
EMU_CXXFLAGS = -std=c++17 -O1 -g -DKVT_CUDA_EMU -Iinclude -Icuda -I$(CUDA_HOME)/include -fPIC \
               -fvisibility=hidden -Wall -Wextra $(if $(filter 1,$(WERROR)),-Werror) $(SANFLAGS)
CUDA_HDRS := $(wildcard include/kvtier/*.h cuda/*.h cuda/*.cuh cuda/emu/*.h) lib/core/forced.h

$(O)/obj-emu/%.o: %.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -x c++ -c $< -o $@
$(O)/obj-emu/%.o: %.cpp $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@

# The CUDA backend's test hooks (lib/backend/backend.h) exist only in the
# test libraries: the sources that hold them are built again with
# -DKVT_TEST_HOOKS, for the GPU tests (libkvtier-hooks.a) and the
# emulation library; the installed library never has them.
HOOK_SRCS := lib/backend/cuda_copy.c lib/step/decode.c
HOOK_OBJS := $(HOOK_SRCS:%.c=$(O)/obj-hooks/%.o)
HOOKS_LIB := $(O)/lib/libkvtier-hooks.a
$(O)/obj-hooks/%.o: %.c $(wildcard include/kvtier/*.h lib/*/*.h cuda/*.h) | $(O)/config.mk
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) $(DEP_CFLAGS) $(CFLAGS) -DKVT_TEST_HOOKS -c $< -o $@
$(HOOKS_LIB): $(filter-out $(HOOK_SRCS:%.c=$(O)/obj/%.o),$(LIB_OBJS)) $(HOOK_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

$(EMU_LIB): $(filter-out $(CU_SRCS:%.cu=$(O)/obj/%.o) $(HOOK_SRCS:%.c=$(O)/obj/%.o),$(LIB_OBJS)) \
            $(HOOK_OBJS) $(EMU_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

PROGS += $(O)/bin/kvtier-bench-emu
GPU_TEST_SCRIPTS := tests/test_bench_cuda.sh tests/test_cuda_resources.sh tests/test_gpu_session.sh

GPU_TEST_CFLAGS = $(TEST_CFLAGS) -DKVT_TEST_HOOKS -Icuda -Itests
GPU_REAL_BINS := $(GPU_TESTS:%=$(O)/tests/gpu/%)
GPU_EMU_BINS  := $(GPU_TESTS:%=$(O)/tests/gpu/%-emu) $(if $(wildcard tests/gpu/test_emu.cpp),$(O)/tests/gpu/test_emu)
GPU_TEST_BINS := $(GPU_REAL_BINS) $(GPU_EMU_BINS)

$(O)/obj-test/gpu/%.o: tests/gpu/%.c tests/testutil.h $(wildcard tests/gpu/*.h) $(CUDA_HDRS) \
                       $(wildcard lib/*/*.h) | $(O)/config-test.mk
	@mkdir -p $(dir $@)
	$(CC) $(GPU_TEST_CFLAGS) -c $< -o $@
$(GPU_REAL_BINS): $(O)/tests/gpu/%: $(O)/obj-test/gpu/%.o $(HOOKS_LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(SANFLAGS) $< -o $@ $(HOOKS_LIB) $(CMOCKA_LIBS) $(LIB_LDLIBS) $(LDFLAGS)
$(O)/tests/gpu/%-emu: $(O)/obj-test/gpu/%.o $(EMU_LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(SANFLAGS) $< -o $@ $(EMU_LIB) $(CMOCKA_LIBS) $(DEP_LIBS) $(LDFLAGS) -lm -lpthread
$(O)/tests/gpu/test_emu: tests/gpu/test_emu.cpp $(EMU_CORE_OBJS) $(O)/obj/lib/core/error.o \
                         $(CUDA_HDRS) | $(O)/config-test.mk
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) $(CMOCKA_CFLAGS) -Ilib/core $< $(EMU_CORE_OBJS) \
	  $(O)/obj/lib/core/error.o -o $@ $(CMOCKA_LIBS) $(LDFLAGS) -lm -lpthread
else
GPU_REAL_BINS :=
GPU_TEST_BINS :=
GPU_TEST_SCRIPTS :=
endif

gpu-tests: $(GPU_TEST_BINS)
# The GPU binaries alone (no emulation): what examples/bench/gpu-session.sh
# builds on a GPU machine.
gpu-bins: $(GPU_REAL_BINS)

COMPUTE_SANITIZER ?= $(or $(shell command -v compute-sanitizer 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/compute-sanitizer $(CUDA_HOME)/compute-sanitizer/compute-sanitizer))
check-gpu: $(GPU_REAL_BINS)
	@if [ -z "$(GPU_REAL_BINS)" ]; then echo "check-gpu: built without CUDA (nvcc not found or CUDA=0)"; exit 1; fi
	@O=$(O) sh tests/run.sh $(GPU_REAL_BINS)
	@if [ -n "$(COMPUTE_SANITIZER)" ]; then \
	  for tool in memcheck racecheck; do \
	    echo "::: compute-sanitizer --tool $$tool"; \
	    VALGRIND="$(COMPUTE_SANITIZER) --tool $$tool --error-exitcode 1" O=$(O) \
	      sh tests/run.sh $(GPU_REAL_BINS) || exit 1; \
	  done; \
	else echo "check-gpu: compute-sanitizer not found (CUDA_HOME=$(CUDA_HOME)): sanitizer runs skipped"; fi

.PHONY: gpu-tests gpu-bins check-gpu
