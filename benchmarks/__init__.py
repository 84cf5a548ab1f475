"""Speed and fidelity benchmarks, and the published tables they and the tests check the twin against."""
