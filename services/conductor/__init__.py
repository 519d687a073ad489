"""The conductor: global scheduler, worker registry, SLO admission (``run`` in service.py)."""
