"""Geometry: layer and end specs, model presets, the byte arena with its page envelopes, registered regions."""
