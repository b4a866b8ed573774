"""Distilling drafters from a target on this machine: ``specray train-drafter`` (docs/training.md)."""
