"""``python -m services.store_node``: the one bootstrap every service starts through."""
import sys

from common.service import bootstrap

sys.exit(bootstrap("store_node"))
