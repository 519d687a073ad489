"""``python -m services.decode``: the one bootstrap every service starts through."""
import sys

from common.service import bootstrap

sys.exit(bootstrap("decode"))
