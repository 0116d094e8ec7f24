"""Micro-benchmarks that measure pdserve against a baseline in the same run."""
