"""The numerics: payload codecs, token-weighted merge and RDA, the outer optimizer."""
