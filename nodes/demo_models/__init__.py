"""The demo models shipped with the pack: a tiny Flux and Wan trained on captioned shapes, their
tiny CLIP and the picture code that stands in for a VAE (see ``shapes.py``)."""
