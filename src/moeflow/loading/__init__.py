"""The one door to a model: from a folder or a config to weights on a rank's device, in every layout."""
