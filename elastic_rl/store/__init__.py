"""etcd access: the key layout, the client wrapper, and the embedded etcd for single machines."""
