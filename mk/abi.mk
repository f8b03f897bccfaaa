# ABI guard (issue 9), included by the Makefile.
#
#   make abi-dump    writes lib/libkvtier.abi (abidw, from the -g build in $(O))
#   make abi-check   compares the library built in $(O) with lib/libkvtier.abi
#                    (tests/test_abi.sh): fails on an incompatible change (a
#                    changed layout or parameter, a removed symbol; struct_size
#                    structs may grow at their end) and on a new symbol in a
#                    version node that the baseline already has; also runs
#                    tests/test_symbols.sh
#                    (readelf --dyn-syms against lib/libkvtier.map).
#
# The baseline is the ABI of the last release. Regenerate it (make abi-dump)
# only when a release is cut, after its version node has been added to
# lib/libkvtier.map. Both tools come from Debian's abigail-tools.
ABI_FILE := lib/libkvtier.abi
ABI_HDRS := include/kvtier
# Output that does not depend on where or how the tree was built: no paths
# (corpus, compilation dir; locations by file name only), no DT_NEEDED
# (CUDA on/off changes it), content-hashed type ids, only what the exported
# symbols reach. Locations stay: without them abidiff 2.2 filters every
# type change out as "private" and exits 0.
ABIDW_FLAGS := --headers-dir $(ABI_HDRS) --drop-private-types --exported-interfaces-only \
               --no-corpus-path --no-comp-dir-path --short-locs --no-architecture \
               --no-elf-needed --type-id-style hash

.PHONY: abi-dump abi-check abi-tools

abi-tools:
	@command -v abidw >/dev/null 2>&1 && command -v abidiff >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "kvtier: installing abigail-tools (abidw, abidiff)"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q abigail-tools; \
	  else echo "kvtier: the ABI targets need abidw and abidiff. Run:"; \
	    echo "    sudo apt-get install -y abigail-tools"; exit 1; fi; }

abi-dump: $(LIB_SO) | abi-tools
	@readelf -S -W $(LIB_SO) | grep -q '\.debug_info' || { \
	  echo "kvtier: $(LIB_SO) has no debug info (build it with CFLAGS containing -g)"; exit 1; }
	abidw $(ABIDW_FLAGS) $(LIB_SO) --out-file $(ABI_FILE).tmp
	@mv $(ABI_FILE).tmp $(ABI_FILE)
	@echo "abi-dump: $(ABI_FILE) ($$(grep -c '<elf-symbol ' $(ABI_FILE)) symbols," \
	  "nodes: $$(sed -n "s/.*<elf-symbol .* version='\([^']*\)'.*/\1/p" $(ABI_FILE) | sort -u | tr '\n' ' ' | sed 's/ $$//'))"

abi-check: $(LIB_SO) | abi-tools
	@O=$(O) ABI_FILE=$(ABI_FILE) ABI_HDRS=$(ABI_HDRS) sh tests/test_abi.sh
