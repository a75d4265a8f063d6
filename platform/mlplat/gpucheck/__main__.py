import sys

from mlplat.gpucheck.cli import main

if __name__ == "__main__":  # a spawned check imports this module again (as __mp_main__): it must not rerun the check
    sys.exit(main())
