import sys

from servecap.traces.command import entry

sys.exit(entry("sim", "servecap.sim.cli"))
