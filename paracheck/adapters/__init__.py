"""Library adapters, one subpackage each, every one implementing `domain.adapter.Adapter` and registered in the
entry-point group `paracheck.adapters` (see `domain.registry`). The host never imports one by name."""
