"""Load the parity pytest plugin for every test and suite run from this tree."""

pytest_plugins = ["parity.plugin"]
