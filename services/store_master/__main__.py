import sys

from services.store_master import main

sys.exit(main())
