import sys

from meshrun.cli.main import main

sys.exit(main())
