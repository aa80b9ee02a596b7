import sys

from kvviz.cli import main

sys.exit(main())
