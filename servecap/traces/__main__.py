import sys

from servecap.traces.command import entry

sys.exit(entry("traces", "servecap.traces.cli"))
