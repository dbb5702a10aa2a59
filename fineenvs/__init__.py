"""fineenvs: RL for open models inside real, unmodified coding agents."""

__version__ = "0.1.0"
