import sys

from common.cpu import apply_from_env

apply_from_env("decode", torch_threads=True)  # before any thread exists; see common/cpu.py

from services.decode import main  # noqa: E402

sys.exit(main())
