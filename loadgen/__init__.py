"""loadgen: the SLO benchmark harness for pdserve's public Generate API."""
