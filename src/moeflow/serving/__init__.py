"""Serving: whether an exported model serves in an inference engine as moeflow trained it."""
