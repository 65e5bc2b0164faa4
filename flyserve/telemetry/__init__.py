"""flyserve.telemetry"""
