"""``python -m services.prefill``: the one bootstrap every service starts through."""
import sys

from common.service import bootstrap

sys.exit(bootstrap("prefill"))
