"""Audits that run before anything is merged."""
