"""The cluster catalogue: one YAML file per cluster, every number with its source; calibrated/ holds fitted ones."""
