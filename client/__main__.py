import sys

from client.cli import main

sys.exit(main(prog="python -m client"))
