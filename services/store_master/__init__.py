"""Store master: metadata only (keys → replicas, space, leases, eviction, liveness).

``python -m services.store_master --config FILE`` serves at the cluster config's
``inbox("store_master")`` with the ``[store]`` table's settings (server.py) until stopped.
"""
