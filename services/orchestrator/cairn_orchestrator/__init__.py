"""cairn's orchestrator: the agent loop, its tools, and the trajectory of every run."""
