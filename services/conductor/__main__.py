"""``python -m services.conductor``: the one bootstrap every service starts through."""
import sys

from common.service import bootstrap

sys.exit(bootstrap("conductor"))
