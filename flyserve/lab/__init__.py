"""flyserve.lab"""
