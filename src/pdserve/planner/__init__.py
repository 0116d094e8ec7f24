"""Capacity planning: a hardware profile, a simulator of splits, and the recommended prefill:decode ratio."""
