import sys

from servecap.traces.command import entry

sys.exit(entry("engine", "servecap.engine.cli"))
