"""Torch-free records and rules every layer shares: layouts, backends, shapes, cases, check ids."""
