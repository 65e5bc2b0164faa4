"""flyserve.control"""
