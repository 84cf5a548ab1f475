"""A whole training run: failures by component, detection, recovery, checkpoints, spares; goodput, cost, energy."""
