import sys

from services.conductor import main

sys.exit(main())
