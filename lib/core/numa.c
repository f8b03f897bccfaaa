/* Thin wrappers over libnuma so the rest of the library does not care
 * whether the machine has NUMA at all. */
#include <numa.h>

#include "internal.h"

bool kvt__numa_available(void)
{
    return numa_available() >= 0;
}

int kvt__numa_max_node(void)
{
    return kvt__numa_available() ? numa_max_node() : 0;
}
