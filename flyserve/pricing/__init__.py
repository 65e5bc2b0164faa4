"""Pricing batch shapes: measured cost tables, the interpolating cost model, the threshold fitter.

Imported by ``lab`` (calibrate, replay) and by the sidecar (live regret, advice, drift); depends
only on ``policy`` and numpy.
"""
