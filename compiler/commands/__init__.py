"""The `mobilec` commands that build: the CLI and compile, estimate, inspect, tune, package."""
