"""Reliability and security: faults, bad input, soak (issue 12)."""
