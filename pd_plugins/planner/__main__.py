import sys

from pd_plugins.planner.cli import main

sys.exit(main())
