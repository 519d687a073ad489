import sys

from common.cpu import apply_from_env

apply_from_env("prefill", torch_threads=True)  # before any thread exists; see common/cpu.py

from services.prefill import main  # noqa: E402

sys.exit(main())
