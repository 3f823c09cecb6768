"""Vision encoders of the multimodal families: pixels in, one feature row per image placeholder token out."""
