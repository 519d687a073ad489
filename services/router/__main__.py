import sys

from services.router import main

sys.exit(main())
