"""Store node: a DRAM segment (a /dev/shm file by default) registered with the transfer
engine, plus an optional SSD tier. Carries bytes only through the transfer engine (or
same-host mappings of its segment file); the master owns all metadata.

``python -m services.store_node --config FILE --index I`` registers ``store_node-I`` with the
master of the cluster config, prints ``ready`` once registered, and exits 1 if the master
stays unreachable for ``store.register_deadline_s`` (server.py).
"""
