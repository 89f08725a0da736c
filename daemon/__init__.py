"""erld, the per-node supervisor daemon: membership in etcd, placement, restarts, engine health."""
