import sys

from services.store_node import main

sys.exit(main())
