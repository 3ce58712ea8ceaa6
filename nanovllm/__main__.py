import sys

from nanovllm.entrypoints.cli import main

sys.exit(main())
