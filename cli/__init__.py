"""Thin click layer over the mergekit_lite Python API."""
