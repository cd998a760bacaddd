"""Benchmarks behind ``python -m fedring bench comm|aggregators|prism``: each prints ratios measured in one run."""
