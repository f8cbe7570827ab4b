import sys

from servecap.traces.command import entry

sys.exit(entry("validate", "servecap.validate.cli"))
