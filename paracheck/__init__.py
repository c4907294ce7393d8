"""paracheck: does a diffusers transformer run with TP, Ulysses, Ring or all of them compute what it
computes on one device? Checked on every rank, with negative controls that prove each check can fail."""

__version__ = "0.1.0"
