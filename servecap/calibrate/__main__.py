import sys

from servecap.traces.command import entry

sys.exit(entry("calibrate", "servecap.calibrate.cli"))
