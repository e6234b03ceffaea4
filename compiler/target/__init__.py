"""The target description: target files, the CPU instruction set, this machine, one compile's build plan."""
