"""One rank's share of its world, which every adapter uses per case: the meshes it reuses, where a case runs."""
