import sys

from paracheck.cli.main import main

sys.exit(main())
