"""Calibration: microbenchmark fits, measured phases of executor runs, the least-squares fit, the loop, reports."""
