import sys

from common.cpu import apply_from_env

apply_from_env("router", torch_threads=False)  # before any thread exists; see common/cpu.py

from services.router import main  # noqa: E402

sys.exit(main())
