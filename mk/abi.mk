# ABI guard (issue 9): abi-dump and abi-check. Filled in by the ABI work.
