import sys

from flyserve.doctor.cli import main

sys.exit(main())
