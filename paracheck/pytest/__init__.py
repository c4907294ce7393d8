"""pytest integration: the mixins, the plugin, the payload handed to ranks."""
