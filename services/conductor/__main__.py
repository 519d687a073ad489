import sys

from common.cpu import apply_from_env

apply_from_env("conductor", torch_threads=False)  # before any thread exists; see common/cpu.py

from services.conductor import main  # noqa: E402

sys.exit(main())
