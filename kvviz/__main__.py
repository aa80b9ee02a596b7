import sys

from kvviz.cli.main import main

sys.exit(main())
