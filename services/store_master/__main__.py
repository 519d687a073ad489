import sys

from common.cpu import apply_from_env

apply_from_env("store_master", torch_threads=False)  # before any thread exists; see common/cpu.py

from services.store_master import main  # noqa: E402

sys.exit(main())
