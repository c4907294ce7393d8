"""`paracheck explore`: hypothesis draws, the probe, hunts, found cases."""
