import sys

from client.cli import LAB_COMMANDS, main

sys.exit(main(prog="python -m lab", commands=LAB_COMMANDS))
