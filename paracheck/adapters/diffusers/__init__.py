"""The diffusers adapter: its private attributes, routes, fitting and attention backend."""
