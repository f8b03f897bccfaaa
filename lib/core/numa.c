/* Thin wrappers over libnuma so the rest of the library does not care
 * whether the machine has NUMA at all. */
#include <numa.h>

#include "arena.h"

bool kvt__numa_available(void)
{
    return numa_available() >= 0;
}

int kvt__numa_max_node(void)
{
    return kvt__numa_available() ? numa_max_node() : 0;
}

bool kvt__numa_node_ok(int node)
{
    if (node < 0)
        return false;
    if (!kvt__numa_available())
        return node == 0; /* no NUMA: the one implicit node */
    /* Node numbers can be sparse and a node can have no memory. */
    return node <= numa_max_node() && numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)node);
}
