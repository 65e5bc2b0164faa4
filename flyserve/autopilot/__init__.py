"""Autopilot: thresholds tuned by measurement (issue 30). sequential.py is its statistical core."""
