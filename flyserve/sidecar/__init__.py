"""flyserve.sidecar"""
