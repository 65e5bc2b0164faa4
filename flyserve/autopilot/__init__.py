"""Autopilot: thresholds tuned by measurement. sequential.py is its statistical core."""
